package proxy

// The proxy's own TCP sockets. Go's net package costs a proxy more per
// connection than the proxy needs: getsockname on every accepted socket and
// getsockname + getpeername on every dialled one, TCP_NODELAY set on each,
// a goroutine and a timer per dial to watch its context, and a park on the
// poller after every connect even when the handshake finished inside the
// connect call (over veth or loopback it does). Here the system calls are
// made directly, with RawSyscall where they cannot block (so that the
// runtime's monitor is not woken to take a P from a connect or accept that
// carries the peer's softirq), and Go's poller is reached through os.File:
// a non-blocking descriptor given to os.NewFile is registered with it, and
// its RawConn waits for readiness and honours deadlines.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// sock is one TCP socket of a proxied connection.
type sock struct {
	f      *os.File
	raw    syscall.RawConn
	inq    bool        // TCP_INQ is on (inherited from the listener)
	closed atomic.Bool // Close was called: errors after it are net.ErrClosed
}

// newSock hands the non-blocking descriptor fd to Go's poller; on error fd
// is closed.
func newSock(fd int) (*sock, error) {
	f := os.NewFile(uintptr(fd), "tcp")
	if f == nil {
		unix.Close(fd)
		return nil, fmt.Errorf("os.NewFile(%d) refused the descriptor", fd)
	}
	raw, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	return &sock{f: f, raw: raw}, nil
}

// Close closes the socket; a copy waiting on it returns net.ErrClosed.
func (s *sock) Close() error {
	s.closed.Store(true)
	return s.f.Close()
}

// read runs a RawConn.Read on the socket, reporting a closed socket as
// net.ErrClosed, as net.TCPConn would.
func (s *sock) read(f func(fd uintptr) bool) error {
	return s.wrap(s.raw.Read(f))
}

// write is read's counterpart for RawConn.Write.
func (s *sock) write(f func(fd uintptr) bool) error {
	return s.wrap(s.raw.Write(f))
}

func (s *sock) wrap(err error) error {
	if err != nil && s.closed.Load() && !errors.Is(err, os.ErrDeadlineExceeded) {
		return net.ErrClosed
	}
	return err
}

// control runs fn on the descriptor while it cannot be closed.
func (s *sock) control(fn func(fd int)) error {
	return s.wrap(s.raw.Control(func(fd uintptr) { fn(int(fd)) }))
}

// CloseWrite sends a FIN: shutdown(SHUT_WR).
func (s *sock) CloseWrite() error {
	var errno syscall.Errno
	if err := s.control(func(fd int) {
		_, _, errno = unix.RawSyscall(unix.SYS_SHUTDOWN, uintptr(fd), unix.SHUT_WR, 0)
	}); err != nil {
		return err
	}
	if errno != 0 {
		return os.NewSyscallError("shutdown", errno)
	}
	return nil
}

// SetResetOnClose makes Close send a reset instead of a FIN (SO_LINGER 0).
func (s *sock) SetResetOnClose() error {
	var serr error
	if err := s.control(func(fd int) {
		serr = unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
	}); err != nil {
		return err
	}
	return os.NewSyscallError("setsockopt", serr)
}

// SetReadDeadline sets the deadline of reads that wait (the idle timeout).
func (s *sock) SetReadDeadline(t time.Time) error { return s.f.SetReadDeadline(t) }

// tcpListener is a listening socket whose accepted sockets inherit keep-alive,
// TCP_NODELAY and TCP_INQ from it: none of them costs a system call per
// connection.
type tcpListener struct {
	s    *sock
	addr netip.AddrPort
}

// listenTCP opens a listener on ap (port 0: the kernel picks one).
func listenTCP(ap netip.AddrPort) (*tcpListener, error) {
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
	s, err := newSock(fd)
	if err != nil {
		return nil, err
	}
	s.inq = inq
	return &tcpListener{s: s, addr: ap}, nil
}

// Addr is the address the listener is bound to.
func (l *tcpListener) Addr() netip.AddrPort { return l.addr }

// Close stops the listener; serve returns net.ErrClosed.
func (l *tcpListener) Close() error { return l.s.Close() }

// serve accepts connections and gives each to handle, until the listener is
// closed (net.ErrClosed) or accept fails (the error). It waits for new
// connections inside one RawConn.Read, accepting until the queue is empty
// before it waits again.
func (l *tcpListener) serve(handle func(s *sock, client netip.AddrPort)) error {
	var rsa unix.RawSockaddrInet6
	var aerr error
	err := l.s.read(func(fd uintptr) bool {
		for {
			n := uint32(unix.SizeofSockaddrInet6)
			nfd, _, errno := unix.RawSyscall6(unix.SYS_ACCEPT4, fd, uintptr(unsafe.Pointer(&rsa)), uintptr(unsafe.Pointer(&n)),
				unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0, 0)
			switch errno {
			case 0:
			case unix.EAGAIN:
				return false
			case unix.EINTR, unix.ECONNABORTED:
				continue // the client gave up while queued: next one
			default:
				aerr = os.NewSyscallError("accept4", errno)
				return true
			}
			s, err := newSock(int(nfd))
			if err != nil {
				aerr = err
				return true
			}
			s.inq = l.s.inq
			handle(s, sockaddrAddrPort(&rsa))
		}
	})
	if err != nil {
		return err
	}
	return aerr
}

// dialTCP connects to ep within timeout, or until ctx is done. The socket
// gets TCP_NODELAY and keep-alive (the kernel's probe count).
func dialTCP(ctx context.Context, ep netip.AddrPort, timeout time.Duration) (*sock, error) {
	family := familyOf(ep)
	fd, _, errno := unix.RawSyscall(unix.SYS_SOCKET, uintptr(domain(family)), unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if errno != 0 {
		return nil, &net.OpError{Op: "dial", Net: "tcp", Addr: net.TCPAddrFromAddrPort(ep), Err: os.NewSyscallError("socket", errno)}
	}
	for _, o := range connOptions {
		_ = o.set(int(fd)) // on a fresh socket of our own they cannot fail but for ENOMEM
	}
	var sa unix.RawSockaddrInet6
	n := putSockaddr(&sa, ep, family)
	_, _, errno = unix.RawSyscall(unix.SYS_CONNECT, fd, uintptr(unsafe.Pointer(&sa)), uintptr(n))
	if errno != 0 && errno != unix.EINPROGRESS && errno != unix.EINTR {
		unix.Close(int(fd))
		return nil, dialError(ep, errno)
	}
	s, err := newSock(int(fd))
	if err != nil {
		return nil, err
	}
	// The handshake has often finished inside connect: look at the state
	// before waiting, which saves a park on the poller.
	if err := s.awaitConnect(ctx, timeout); err != nil {
		s.Close()
		return nil, dialError(ep, err)
	}
	return s, nil
}

// awaitConnect waits until the non-blocking connect on s is done.
func (s *sock) awaitConnect(ctx context.Context, timeout time.Duration) error {
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
	err := s.write(func(fd uintptr) bool {
		if done(fd) {
			return true
		}
		if stop == nil {
			// Only a connect that did not finish at once pays for the
			// deadline and the watch on ctx.
			_ = s.f.SetWriteDeadline(time.Now().Add(timeout))
			stop = context.AfterFunc(ctx, func() { _ = s.f.SetWriteDeadline(time.Unix(1, 0)) })
		}
		return false
	})
	if stop != nil {
		stop()
		_ = s.f.SetWriteDeadline(time.Time{})
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

// connOptions are the options of both sockets of a proxied connection:
// TCP_NODELAY, and keep-alive with the kernel's probe count. Accepted
// sockets inherit them from the listener; a dial sets them.
var connOptions = [...]sockOpt{
	{unix.IPPROTO_TCP, unix.TCP_NODELAY, 1},
	{unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
	{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, int32(keepAliveIdle / time.Second)},
	{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, int32(keepAliveInterval / time.Second)},
}

// sockOpt is an integer socket option.
type sockOpt struct {
	level, opt int
	value      int32
}

// set is setsockopt(2) of o on fd.
func (o sockOpt) set(fd int) syscall.Errno {
	v := o.value
	_, _, errno := unix.RawSyscall6(unix.SYS_SETSOCKOPT, uintptr(fd), uintptr(o.level), uintptr(o.opt),
		uintptr(unsafe.Pointer(&v)), unsafe.Sizeof(v), 0)
	return errno
}

// getsockopt(2) of fd into the n bytes at p; n becomes the length written.
func getsockopt(fd, level, opt int, p unsafe.Pointer, n *uint32) syscall.Errno {
	_, _, errno := unix.RawSyscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt),
		uintptr(p), uintptr(unsafe.Pointer(n)), 0)
	return errno
}

// Kernel TCP states (include/net/tcp_states.h).
const (
	tcpEstablished = 1
	tcpSynSent     = 2
	tcpClose       = 7
	tcpCloseWait   = 8
)

// localAddr is getsockname(2) of fd.
func localAddr(fd int) (netip.AddrPort, error) {
	var rsa unix.RawSockaddrInet6
	n := uint32(unix.SizeofSockaddrInet6)
	_, _, errno := unix.RawSyscall(unix.SYS_GETSOCKNAME, uintptr(fd), uintptr(unsafe.Pointer(&rsa)), uintptr(unsafe.Pointer(&n)))
	if errno != 0 {
		return netip.AddrPort{}, os.NewSyscallError("getsockname", errno)
	}
	return sockaddrAddrPort(&rsa), nil
}

// listenBacklog is the kernel's somaxconn, as Go's net package uses.
var listenBacklog = sync.OnceValue(func() int {
	b, err := os.ReadFile("/proc/sys/net/core/somaxconn")
	if err != nil {
		return unix.SOMAXCONN
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n <= 0 {
		return unix.SOMAXCONN
	}
	return min(n, 1<<16-1)
})

// tcpState is the kernel's TCP state of the socket fd: tcpi_state, the first
// byte of struct tcp_info.
func tcpState(fd int) (byte, error) {
	var state byte
	n := uint32(1)
	if errno := getsockopt(fd, unix.IPPROTO_TCP, unix.TCP_INFO, unsafe.Pointer(&state), &n); errno != 0 {
		return 0, os.NewSyscallError("getsockopt", errno)
	}
	return state, nil
}

// originalDst returns where the client was going before iptables redirected
// it (SO_ORIGINAL_DST, from conntrack), or the socket's local address when
// conntrack has no entry for it. listen, the listener's address, gives the
// family and is the answer of last resort.
func originalDst(c *sock, listen netip.AddrPort) netip.AddrPort {
	dst := listen
	_ = c.control(func(fd int) {
		level := unix.SOL_IP // SO_ORIGINAL_DST gives a sockaddr_in …
		if listen.Addr().Is6() {
			level = unix.SOL_IPV6 // … or, as IP6T_SO_ORIGINAL_DST, a sockaddr_in6
		}
		var rsa unix.RawSockaddrInet6
		n := uint32(unix.SizeofSockaddrInet6)
		if getsockopt(fd, level, unix.SO_ORIGINAL_DST, unsafe.Pointer(&rsa), &n) == 0 {
			if ap := sockaddrAddrPort(&rsa); ap.IsValid() {
				dst = ap
				return
			}
		}
		if local, err := localAddr(fd); err == nil {
			dst = local
		}
	})
	return dst
}
