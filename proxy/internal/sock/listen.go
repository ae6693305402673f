package sock

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// Listener is a listening TCP socket whose accepted sockets inherit
// keep-alive, TCP_NODELAY and TCP_INQ from it: none of them costs a system
// call per connection. It is not Go's poller's: an Acceptor waits on it
// (Serve), so that an idle listener costs a descriptor and this record, no
// goroutine.
type Listener struct {
	fd   int
	addr netip.AddrPort
	inq  bool // TCP_INQ is on, and so on every accepted socket

	// Set by Serve.
	acc    *Acceptor
	id     uint32
	handle func(c *Conn, client netip.AddrPort)
	failed func(err error, retryIn time.Duration)

	// mu orders accepting against Close: an accept burst never blocks, so
	// Close waits at most for one.
	mu      sync.Mutex
	closed  bool
	backoff time.Duration // after a failed accept: 5 ms doubling to 1 s
	retry   *time.Timer
}

// ListenTCP opens a listener on ap (port 0: the kernel picks one).
func ListenTCP(ap netip.AddrPort) (*Listener, error) {
	family := familyOf(ap)
	fd, err := unix.Socket(domain(family), unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	// As Go: SO_REUSEADDR lets a restart rebind ports in TIME_WAIT.
	opts := append([]sockOpt{{unix.SOL_SOCKET, unix.SO_REUSEADDR, 1}}, connOptions[:]...)
	if family == 6 {
		opts = append(opts, sockOpt{unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 1})
	}
	for _, o := range opts {
		if errno := o.set(fd); errno != 0 {
			unix.Close(fd)
			return nil, fmt.Errorf("listener option %d/%d: %w", o.level, o.opt, os.NewSyscallError("setsockopt", errno))
		}
	}
	// TCP_INQ (Linux 4.18) lets a copy learn from each read whether the
	// socket is drained; without it the copy reads until EAGAIN.
	inq := sockOpt{unix.IPPROTO_TCP, unix.TCP_INQ, 1}.set(fd) == 0
	var sa unix.RawSockaddrInet6
	n := putSockaddr(&sa, ap, family)
	if _, _, errno := unix.Syscall(unix.SYS_BIND, uintptr(fd), uintptr(unsafe.Pointer(&sa)), uintptr(n)); errno != 0 {
		unix.Close(fd)
		return nil, os.NewSyscallError("bind", errno)
	}
	if err := unix.Listen(fd, listenBacklog()); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("listen", err)
	}
	if ap.Port() == 0 {
		got, err := localAddr(fd)
		if err != nil {
			unix.Close(fd)
			return nil, err
		}
		ap = netip.AddrPortFrom(ap.Addr(), got.Port())
	}
	return &Listener{fd: fd, addr: ap, inq: inq}, nil
}

// Addr is the address the listener is bound to.
func (l *Listener) Addr() netip.AddrPort { return l.addr }

// Serve has a accept l's connections from now on and give each to handle,
// which runs on the acceptor's goroutine, must not block and becomes the
// Conn's owner. A failed accept (EMFILE, say) is told to failed, with the
// back-off after which the listener is tried again (5 ms doubling to 1 s,
// reset by an emptied queue). Serve is called once; Close ends it.
func (l *Listener) Serve(a *Acceptor, handle func(c *Conn, client netip.AddrPort), failed func(err error, retryIn time.Duration)) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return net.ErrClosed
	}
	if l.acc != nil {
		return errors.New("listener is already served")
	}
	l.handle, l.failed = handle, failed
	id, err := a.add(l)
	if err != nil {
		return err
	}
	l.acc, l.id = a, id
	return nil
}

// Close stops the listener: queued connections are reset by the kernel.
// It waits at most for an accept burst in progress, which never blocks.
func (l *Listener) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return net.ErrClosed
	}
	l.closed = true
	if l.retry != nil {
		l.retry.Stop()
	}
	if l.acc != nil {
		l.acc.remove(l)
	}
	return os.NewSyscallError("close", unix.Close(l.fd))
}

// accept takes connections until the queue is empty, or until accept
// fails: then it tries again after the back-off (edge-triggered, the
// acceptor would not be told of connections already queued).
func (l *Listener) accept() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return
	}
	var rsa unix.RawSockaddrInet6
	for {
		n := uint32(unix.SizeofSockaddrInet6)
		nfd, _, errno := unix.RawSyscall6(unix.SYS_ACCEPT4, uintptr(l.fd), uintptr(unsafe.Pointer(&rsa)), uintptr(unsafe.Pointer(&n)),
			unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0, 0)
		var err error
		switch errno {
		case 0:
			var c *Conn
			if c, err = newConn(int(nfd)); err == nil {
				c.inq = l.inq
				l.handle(c, sockaddrAddrPort(&rsa))
				continue
			}
		case unix.EAGAIN:
			l.backoff = 0
			return
		case unix.EINTR, unix.ECONNABORTED:
			continue // the client gave up while queued: next one
		default:
			err = os.NewSyscallError("accept4", errno)
		}
		l.backoff = min(max(2*l.backoff, 5*time.Millisecond), time.Second)
		l.retry = time.AfterFunc(l.backoff, l.accept)
		if l.failed != nil {
			l.failed(err, l.backoff)
		}
		return
	}
}

// Keep-alive probing of proxied connections, as Go's defaults: the first
// probe after 15 s of silence, then every 15 s, the kernel's probe count.
const (
	keepAliveIdle     = 15 * time.Second
	keepAliveInterval = 15 * time.Second
)

// connOptions are the options of both sockets of a proxied connection:
// TCP_NODELAY, and keep-alive with the kernel's probe count. Accepted
// sockets inherit them from the listener. A dial sets TCP_NODELAY
// (dialOptions) and leaves keep-alive to Conn.KeepAlive, called once the
// connection first goes quiet: a short connection never probes, and so
// need not pay three system calls for it.
var connOptions = [...]sockOpt{
	{unix.IPPROTO_TCP, unix.TCP_NODELAY, 1},
	{unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
	{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, int32(keepAliveIdle / time.Second)},
	{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, int32(keepAliveInterval / time.Second)},
}

var dialOptions, keepAliveOptions = connOptions[:1], connOptions[1:]

// listenBacklog is the kernel's somaxconn, as Go's net package uses.
var listenBacklog = sync.OnceValue(func() int {
	n, err := kernel.ProcSys.ReadInt("net.core.somaxconn")
	if err != nil || n <= 0 {
		return unix.SOMAXCONN
	}
	return min(n, 1<<16-1)
})

// Hold is a socket bound to a port without listening on it, so that no
// other process can take the port while nothing answers on it directly: a
// connection that slips past the rules is refused rather than served.
type Hold struct{ fd int }

// HoldPort binds a TCP (udp false) or UDP socket to ap.
func HoldPort(udp bool, ap netip.AddrPort) (*Hold, error) { return holdPort(udp, ap, false) }

func holdPort(udp bool, ap netip.AddrPort, reuseAddr bool) (*Hold, error) {
	family := familyOf(ap)
	typ := unix.SOCK_STREAM
	if udp {
		typ = unix.SOCK_DGRAM
	}
	fd, err := unix.Socket(domain(family), typ|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	if family == 6 {
		_ = unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 1)
	}
	if reuseAddr {
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	}
	var sa unix.RawSockaddrInet6
	n := putSockaddr(&sa, ap, family)
	if _, _, errno := unix.Syscall(unix.SYS_BIND, uintptr(fd), uintptr(unsafe.Pointer(&sa)), uintptr(n)); errno != 0 {
		unix.Close(fd)
		return nil, fmt.Errorf("bind %s: %w", ap, errno)
	}
	return &Hold{fd: fd}, nil
}

// RefusePort binds a socket to ap that refuses what arrives there, as a
// port without a socket would, while keeping the port from other processes:
// a TCP SYN is answered by a reset (the socket does not listen), a UDP
// datagram by an ICMP port unreachable (the socket is connected to its own
// address on loopback, so no datagram from elsewhere matches it).
//
// A TCP port is bound with SO_REUSEADDR, as its listener was: the
// connections that listener accepted still have the port.
func RefusePort(udp bool, ap netip.AddrPort) (*Hold, error) {
	h, err := holdPort(udp, ap, !udp)
	if err != nil || !udp {
		return h, err
	}
	self := ap.Addr()
	if self.IsUnspecified() {
		self = netip.IPv6Loopback()
		if familyOf(ap) == 4 {
			self = netip.AddrFrom4([4]byte{127, 0, 0, 1})
		}
	}
	var sa unix.RawSockaddrInet6
	n := putSockaddr(&sa, netip.AddrPortFrom(self, ap.Port()), familyOf(ap))
	if _, _, errno := unix.Syscall(unix.SYS_CONNECT, uintptr(h.fd), uintptr(unsafe.Pointer(&sa)), uintptr(n)); errno != 0 {
		h.Close()
		return nil, fmt.Errorf("connect %s: %w", ap, errno)
	}
	return h, nil
}

// Close gives the port up. A nil Hold holds nothing.
func (h *Hold) Close() {
	if h != nil && h.fd >= 0 {
		unix.Close(h.fd)
		h.fd = -1
	}
}

// FileLimit is the process's soft RLIMIT_NOFILE (1024 when it cannot be read).
func FileLimit() uint64 {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return 1024
	}
	return lim.Cur
}
