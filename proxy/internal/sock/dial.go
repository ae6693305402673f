package sock

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// DialTCP connects to ep within timeout, or until ctx is done, from the
// address the kernel chooses (the node's on the route to ep). The socket
// gets TCP_NODELAY; keep-alive waits for KeepAlive. Errors are
// *net.OpError; DialFailure names them.
func DialTCP(ctx context.Context, ep netip.AddrPort, timeout time.Duration) (*Conn, error) {
	c, _, err := DialTCPFrom(ctx, ep, timeout, Source{})
	return c, err
}

// Source says whose address the backend sees on a dialled connection. The
// zero Source leaves it to the kernel: the node's.
type Source struct {
	// Client is the address the backend should see. A local address of
	// this node (a client on the node itself) is bound; any other, with
	// NAT, is set through a conntrack source NAT (clientnat.go); a
	// loopback one is never used (no reply could come back to it).
	Client netip.Addr
	// Port is the client's port, kept too by the source NAT where no
	// other connection holds it (0: the port the dial bound).
	Port uint16
	NAT  *ClientNAT
}

// Dialed says what a dial's Source came to.
type Dialed struct {
	// Sees is the address the backend sees: the Source's, or invalid for
	// the node's address (the zero Source, or a Source that could not be
	// used).
	Sees netip.Addr
	// SourceErr is why a Source could not be used; the connection was
	// made from the node's address all the same.
	SourceErr error
}

// DialTCPFrom is DialTCP from src: the backend sees the client's address
// (src.Client, and src.Port where free) where it can; where it cannot, the node's, never
// a failed connection.
func DialTCPFrom(ctx context.Context, ep netip.AddrPort, timeout time.Duration, src Source) (*Conn, Dialed, error) {
	replaced := false
	for range 8 {
		c, d, ownPort, err := dialFrom(ctx, ep, timeout, src)
		if err == nil && errors.Is(d.SourceErr, errNATReplaced) && !replaced {
			// The connection went out from the node's address after all:
			// once more, from a port of the range (the client's own port
			// is where the earlier state that reset it was), before the
			// backend is sent anything.
			replaced = true
			_ = c.SetResetOnClose()
			c.Close()
			src.Port = 0
			continue
		}
		// A port of the source NAT's range whose last connection to ep
		// is still in TIME_WAIT (and not reusable), or still open in
		// another socket: the next port.
		if !ownPort || !IsNoLocalPort(err) && !errors.Is(err, errPortLive) {
			return c, d, err
		}
	}
	// Ports in a row still in TIME_WAIT with ep: the node's address
	// rather than no connection.
	c, _, _, err := dialFrom(ctx, ep, timeout, Source{})
	return c, Dialed{SourceErr: fmt.Errorf("8 ports of the proxy port range in a row still in TIME_WAIT with %s (which the kernel reuses only with TCP timestamps, net.ipv4.tcp_timestamps) or connected to it", ep)}, err
}

// dialFrom is one try of DialTCPFrom; ownPort says the socket was bound to
// a port of the source NAT's range.
func dialFrom(ctx context.Context, ep netip.AddrPort, timeout time.Duration, src Source) (_ *Conn, _ Dialed, ownPort bool, _ error) {
	family := familyOf(ep)
	sfd, _, errno := unix.RawSyscall(unix.SYS_SOCKET, uintptr(domain(family)), unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if errno != 0 {
		return nil, Dialed{}, false, &net.OpError{Op: "dial", Net: "tcp", Addr: net.TCPAddrFromAddrPort(ep), Err: os.NewSyscallError("socket", errno)}
	}
	fd := int(sfd)
	for _, o := range dialOptions {
		_ = o.set(fd) // on a fresh socket of our own they cannot fail but for ENOMEM
	}
	b, err := bindSource(fd, ep, src, unix.IPPROTO_TCP)
	ownPort = b.putPort != nil
	failed := func() { b.undo(src.NAT, unix.IPPROTO_TCP, ep) }
	if errors.Is(err, errPortLive) {
		unix.Close(fd)
		failed()
		return nil, Dialed{}, ownPort, err
	}
	if err != nil {
		b.Dialed = Dialed{SourceErr: err} // from the node's address, on the port bound if any
	}
	var sa unix.RawSockaddrInet6
	n := putSockaddr(&sa, ep, family)
	_, _, errno = unix.RawSyscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&sa)), uintptr(n))
	if errno != 0 && errno != unix.EINPROGRESS && errno != unix.EINTR {
		unix.Close(fd)
		failed()
		return nil, b.Dialed, ownPort, dialError(ep, errno)
	}
	c, err := newConn(fd)
	if err != nil {
		failed()
		return nil, b.Dialed, ownPort, err
	}
	// The handshake has often finished inside connect: look at the state
	// before waiting, which saves a park on the poller.
	if err := c.awaitConnect(ctx, timeout); err != nil {
		c.Close()
		failed()
		return nil, b.Dialed, ownPort, dialError(ep, err)
	}
	c.onClose = b.putPort
	if b.local.IsValid() {
		// Conntrack may have replaced the entry during the handshake
		// (natted): then the backend sees the node's address.
		if ok, err := src.NAT.natted(b.local, ep, b.Sees); err != nil {
			b.Dialed = Dialed{SourceErr: fmt.Errorf("%w: %w", errNATReplaced, err)}
		} else if !ok {
			b.Dialed = Dialed{SourceErr: errNATReplaced}
		}
	}
	return c, b.Dialed, ownPort, nil
}

// errPortLive: the port a source-NATed dial bound has a live connection
// to the same endpoint in another socket; the dial takes another port.
var errPortLive = errors.New("the port has a live connection to the endpoint")

// errNATReplaced: the source NAT's entry was replaced during the handshake,
// and the connection made from the node's address.
var errNATReplaced = errors.New("conntrack replaced the source NAT's entry during the handshake")

// boundSource is what bindSource made of a Source.
type boundSource struct {
	Dialed
	local   netip.AddrPort // the bound address of a conntrack entry it created
	putPort func()         // gives the bound port back once the socket is closed
}

// undo gives back what bindSource took for a socket of proto to ep that is
// closed or never used: the conntrack entry it created, the port it bound.
func (b boundSource) undo(nat *ClientNAT, proto uint8, ep netip.AddrPort) {
	if b.local.IsValid() {
		_ = nat.release(proto, b.local, ep)
	}
	if b.putPort != nil {
		b.putPort()
	}
}

// bindSource binds fd, a socket of proto (TCP or UDP), as src asks before
// it connects to ep. On an error the socket may still hold a port of the
// range (putPort set).
func bindSource(fd int, ep netip.AddrPort, src Source, proto uint8) (boundSource, error) {
	client := src.Client.Unmap()
	if !client.IsValid() || client.IsLoopback() {
		return boundSource{}, nil
	}
	if client.Is4() != ep.Addr().Is4() {
		return boundSource{}, fmt.Errorf("the client %s and the endpoint %s are of two families", client, ep)
	}
	// A client on the node itself: its own address, if it is one of ours.
	// A TCP socket's port is chosen at connect (IP_BIND_ADDRESS_NO_PORT),
	// as for one not bound: unique per endpoint, where a bind takes a port
	// of the address's for every endpoint, runs out at the size of the
	// ephemeral range and searches it among the listeners' ports.
	if proto == unix.IPPROTO_TCP {
		_ = unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_BIND_ADDRESS_NO_PORT, 1)
	}
	err := bindTo(fd, netip.AddrPortFrom(client, 0))
	if err == nil {
		return boundSource{Dialed: Dialed{Sees: client}}, nil
	}
	if !errors.Is(err, syscall.EADDRNOTAVAIL) {
		return boundSource{}, err
	}
	if src.NAT == nil {
		return boundSource{}, nil
	}
	from, err := src.NAT.routes.from(ep)
	if err != nil {
		return boundSource{}, err
	}
	local, putPort, err := src.NAT.bindSourcePort(fd, from, proto == unix.IPPROTO_TCP)
	if errors.Is(err, syscall.EADDRNOTAVAIL) {
		src.NAT.routes.forget(ep)
	}
	if err != nil {
		return boundSource{}, err
	}
	as := netip.AddrPortFrom(client, src.Port)
	err = src.NAT.claim(proto, local, ep, as)
	if errors.Is(err, syscall.EEXIST) {
		// An earlier connection's entry, which conntrack keeps for its
		// TIME_WAIT (120 s): one from this socket's port, or one of the
		// client's from the same port to this endpoint (a client reusing
		// its port at once), each taken over only when over. One from
		// this socket's port that is not over is another socket's live
		// connection (SO_REUSEADDR lets TCP sockets share a port: a
		// predecessor's, or one it transferred), whose NAT goes with its
		// entry: this dial takes another port. UDP sockets never share a
		// port, so an entry from this one's is a closed flow's; but UDP
		// has no TIME_WAIT, and its entry from the client's port is
		// another flow's, live.
		if err := src.NAT.dropEarlier(proto, local, ep); errors.Is(err, kernel.ErrEntryLive) {
			return boundSource{putPort: putPort}, fmt.Errorf("%w: %s to %s", errPortLive, local, ep)
		} else if err != nil {
			return boundSource{putPort: putPort}, fmt.Errorf("conntrack source NAT to %s: %w", as, err)
		}
		if as.Port() != 0 && (proto != unix.IPPROTO_TCP || src.NAT.deleteIfOver(kernel.Reply, ep, as) != nil) {
			as = netip.AddrPortFrom(client, 0)
		}
		err = src.NAT.claim(proto, local, ep, as)
	}
	if errors.Is(err, syscall.EEXIST) && as.Port() != 0 {
		as = netip.AddrPortFrom(client, 0)
		err = src.NAT.claim(proto, local, ep, as)
	}
	if err != nil {
		return boundSource{putPort: putPort}, fmt.Errorf("conntrack source NAT to %s: %w", client, err)
	}
	return boundSource{Dialed: Dialed{Sees: client}, local: local, putPort: putPort}, nil
}

// bindTo binds fd to ap.
func bindTo(fd int, ap netip.AddrPort) error {
	var sa unix.RawSockaddrInet6
	n := putSockaddr(&sa, ap, familyOf(ap))
	if _, _, errno := unix.RawSyscall(unix.SYS_BIND, uintptr(fd), uintptr(unsafe.Pointer(&sa)), uintptr(n)); errno != 0 {
		return os.NewSyscallError("bind", errno)
	}
	return nil
}

// routeSource is the address the kernel would send from to ep: a UDP
// socket's connect looks the route up and sends nothing.
func routeSource(ep netip.AddrPort) (netip.Addr, error) {
	family := familyOf(ep)
	fd, _, errno := unix.RawSyscall(unix.SYS_SOCKET, uintptr(domain(family)), unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if errno != 0 {
		return netip.Addr{}, os.NewSyscallError("socket", errno)
	}
	defer unix.Close(int(fd))
	var sa unix.RawSockaddrInet6
	n := putSockaddr(&sa, ep, family)
	if _, _, errno := unix.RawSyscall(unix.SYS_CONNECT, fd, uintptr(unsafe.Pointer(&sa)), uintptr(n)); errno != 0 {
		return netip.Addr{}, fmt.Errorf("route to %s: %w", ep, os.NewSyscallError("connect", errno))
	}
	local, err := localAddr(int(fd))
	if err != nil {
		return netip.Addr{}, err
	}
	return local.Addr(), nil
}

// awaitConnect waits until the non-blocking connect on c is done.
func (c *Conn) awaitConnect(ctx context.Context, timeout time.Duration) error {
	var cerr error
	done := func(fd uintptr) bool {
		state, err := tcpState(int(fd))
		switch {
		case err != nil:
			cerr = err
		case state == tcpEstablished, state == tcpCloseWait:
			// Connected (CLOSE_WAIT: and the peer already sent its FIN).
		case state == tcpSynSent:
			return false
		default:
			// Failed: SO_ERROR says why and clears it.
			if e, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR); err == nil && e != 0 {
				cerr = syscall.Errno(e)
			} else {
				cerr = fmt.Errorf("connect: socket in TCP state %d", state)
			}
		}
		return true
	}
	var stop func() bool // set once the connect had to be waited for
	err := c.write(func(fd uintptr) bool {
		if done(fd) {
			return true
		}
		if stop == nil {
			// Only a connect that did not finish at once pays for the
			// deadline and the watch on ctx.
			c.setWriteDeadline(time.Now().Add(timeout))
			stop = context.AfterFunc(ctx, func() { c.setWriteDeadline(abortedAt) })
		}
		return false
	})
	if stop != nil {
		stop()
		c.setWriteDeadline(time.Time{})
		if err != nil && ctx.Err() != nil {
			return ctx.Err()
		}
	}
	if err != nil {
		return err
	}
	return cerr
}

func dialError(ep netip.AddrPort, err error) error {
	if errno, ok := err.(syscall.Errno); ok {
		err = os.NewSyscallError("connect", errno)
	}
	return &net.OpError{Op: "dial", Net: "tcp", Addr: net.TCPAddrFromAddrPort(ep), Err: err}
}

// DialFailure names why a dial failed, in the words of the log line and the
// dial failure metric: "refused", "timeout", "unreachable", "reset",
// "file limit", "no local port", "cancelled" or "error".
func DialFailure(err error) string {
	var errno syscall.Errno
	switch {
	case errors.Is(err, context.Canceled):
		return "cancelled"
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, syscall.ETIMEDOUT):
		return "timeout"
	case IsFileLimit(err):
		return "file limit"
	case IsNoLocalPort(err):
		return "no local port"
	case !errors.As(err, &errno):
		return "error"
	}
	switch errno {
	case syscall.ECONNREFUSED:
		return "refused"
	case syscall.EHOSTUNREACH, syscall.ENETUNREACH, syscall.EHOSTDOWN, syscall.ENETDOWN:
		return "unreachable"
	case syscall.ECONNRESET, syscall.ECONNABORTED:
		return "reset"
	}
	return "error"
}

// IsNoLocalPort reports whether a dial failed for want of a local port: the
// connect found no free port towards the endpoint (EADDRNOTAVAIL), most
// often because the node's earlier connections to it wait out TIME_WAIT.
// That is the node's limit, not the endpoint's fault.
func IsNoLocalPort(err error) bool {
	var se *os.SyscallError
	return errors.As(err, &se) && se.Syscall == "connect" && errors.Is(se.Err, syscall.EADDRNOTAVAIL)
}
