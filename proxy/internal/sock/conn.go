package sock

// Go's net package costs a proxy more per connection than the proxy needs:
// getsockname on every accepted socket and getsockname + getpeername on
// every dialled one, TCP_NODELAY set on each, a goroutine and a timer per
// dial to watch its context, and a park on the poller after every connect
// even when the handshake finished inside the connect call (over veth or
// loopback it does). Here the system calls are made directly, with
// RawSyscall where they cannot block (so that the runtime's monitor is not
// woken to take a P from a connect or accept that carries the peer's
// softirq), and Go's poller is reached through os.File: a non-blocking
// descriptor given to os.NewFile is registered with it, and its RawConn
// waits for readiness and honours deadlines.

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Conn is one TCP socket of a proxied connection. See the package comment
// for who may call what.
type Conn struct {
	f   *os.File
	raw syscall.RawConn
	inq bool // TCP_INQ is on: inherited from the listener, or set by a Copy (one direction's, which owns the field)

	mu     sync.Mutex  // orders Abort and Detach against the deadlines of a dial and of Copy
	done   atomic.Bool // Abort or Close was called: errors after it are net.ErrClosed
	detach atomic.Bool // Detach was called: a Copy from c stops at its next pause (inherit.go)

	onClose func() // the owner's: gives back the port a source-NATed dial bound (sourceports.go)

	parked atomic.Pointer[parked] // in a Parker's set (park.go)
	inSet  bool                   // registered in the Parker's epoll set, armed or not (its mu)
}

// newConn hands the non-blocking descriptor fd to Go's poller; on error fd
// is closed.
func newConn(fd int) (*Conn, error) {
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
	return &Conn{f: f, raw: raw}, nil
}

// abortedAt is the deadline Abort sets: long past, so every wait returns.
var abortedAt = time.Unix(1, 0)

// Abort wakes every read and write waiting on c, now or later, with
// net.ErrClosed, and never waits for anything: not for a copy parked on c,
// not for one parked on another socket. The descriptor stays open until
// Close. It may be called from any goroutine, any number of times.
func (c *Conn) Abort() {
	c.mu.Lock()
	if c.done.Swap(true) {
		c.mu.Unlock()
		return
	}
	// A past deadline readies the poller's waiters at once; setting it
	// takes no lock that a parked read or write holds.
	_ = c.f.SetDeadline(abortedAt)
	c.mu.Unlock()
	// A socket parked without a goroutine is woken by its Parker instead.
	if e := c.parked.Load(); e != nil {
		e.p.unpark(e)
	}
}

// Close releases the descriptor. Only the owner calls it, once nothing else
// uses c: like os.File.Close it waits for system calls in flight on c.
func (c *Conn) Close() error {
	c.done.Store(true)
	err := c.f.Close()
	if c.onClose != nil {
		c.onClose()
		c.onClose = nil
	}
	return err
}

// setWriteDeadline sets the write deadline unless c was aborted (which
// would otherwise be undone).
func (c *Conn) setWriteDeadline(t time.Time) {
	c.mu.Lock()
	if !c.done.Load() {
		_ = c.f.SetWriteDeadline(t)
	}
	c.mu.Unlock()
}

// setReadDeadline is setWriteDeadline's counterpart for reads.
func (c *Conn) setReadDeadline(t time.Time) {
	c.mu.Lock()
	if !c.done.Load() && !c.detach.Load() {
		_ = c.f.SetReadDeadline(t)
	}
	c.mu.Unlock()
}

// read runs a RawConn.Read on the socket, reporting an aborted or closed
// socket as net.ErrClosed, as net.TCPConn would.
func (c *Conn) read(f func(fd uintptr) bool) error {
	return c.wrap(c.raw.Read(f))
}

// write is read's counterpart for RawConn.Write.
func (c *Conn) write(f func(fd uintptr) bool) error {
	return c.wrap(c.raw.Write(f))
}

func (c *Conn) wrap(err error) error {
	if err != nil && c.done.Load() {
		return net.ErrClosed
	}
	return err
}

// control runs fn on the descriptor while it cannot be closed. It does not
// wait for reads or writes in progress.
func (c *Conn) control(fn func(fd int)) error {
	return c.wrap(c.raw.Control(func(fd uintptr) { fn(int(fd)) }))
}

// Acked returns how many bytes written to the socket the peer has
// acknowledged (TCP_INFO tcpi_bytes_acked): what has reached the peer's
// kernel. ok is false once the socket is closed.
func (c *Conn) Acked() (acked uint64, ok bool) {
	err := c.control(func(fd int) {
		if info, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
			// bytes_acked counts the SYN's sequence number too.
			acked, ok = max(info.Bytes_acked, 1)-1, true
		}
	})
	return acked, ok && err == nil
}

// CloseWrite sends a FIN: shutdown(SHUT_WR).
func (c *Conn) CloseWrite() error {
	var errno syscall.Errno
	if err := c.control(func(fd int) {
		_, _, errno = unix.RawSyscall(unix.SYS_SHUTDOWN, uintptr(fd), unix.SHUT_WR, 0)
	}); err != nil {
		return err
	}
	if errno != 0 {
		return os.NewSyscallError("shutdown", errno)
	}
	return nil
}

// KeepAlive turns on keep-alive probing, as the listener's sockets have
// it (first probe after 15 s of silence): a dialled socket starts
// without it. The kernel counts the silence from the last segment
// received, whenever probing is turned on.
func (c *Conn) KeepAlive() error {
	var errno syscall.Errno
	if err := c.control(func(fd int) {
		for _, o := range keepAliveOptions {
			if errno = o.set(fd); errno != 0 {
				return
			}
		}
	}); err != nil {
		return err
	}
	if errno != 0 {
		return os.NewSyscallError("setsockopt", errno)
	}
	return nil
}

// SetResetOnClose makes Close send a reset instead of a FIN (SO_LINGER 0).
func (c *Conn) SetResetOnClose() error {
	var serr error
	if err := c.control(func(fd int) {
		serr = unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
	}); err != nil {
		return err
	}
	return os.NewSyscallError("setsockopt", serr)
}

// WaitPeerReset waits on c, whose peer has sent its FIN, until the peer
// resets it (true), c is detached for a handover (false, ErrDetached) or
// aborted or closed (false). After the FIN nothing but the reset makes c
// readable again; other wake-ups are checked and ignored.
func (c *Conn) WaitPeerReset() (bool, error) {
	reset := false
	// The first call checks at once: a reset that came between the EOF
	// and this call woke no one.
	err := c.read(func(fd uintptr) bool {
		// The socket is in CLOSE_WAIT until the reset moves it to CLOSE.
		state, err := tcpState(int(fd))
		reset = err == nil && state == tcpClose
		return reset
	})
	if !reset && errors.Is(err, os.ErrDeadlineExceeded) && c.detach.Load() {
		return false, ErrDetached
	}
	return reset, nil
}

// OriginalDst returns where the client was going before iptables redirected
// it (SO_ORIGINAL_DST, from conntrack), or the socket's local address when
// conntrack has no entry for it. listen, the listener's address, gives the
// family and is the answer of last resort.
func (c *Conn) OriginalDst(listen netip.AddrPort) netip.AddrPort {
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

// ReachedDirectly reports whether c, accepted on a listener, came to it
// without a NAT rule redirecting it (its original destination, dst from
// OriginalDst, is the address it arrived at) from an address that is not
// this node's: another host that connected to the listener's port itself.
func (c *Conn) ReachedDirectly(dst netip.AddrPort, peer netip.Addr) bool {
	var local netip.AddrPort
	_ = c.control(func(fd int) { local, _ = localAddr(fd) })
	if !local.IsValid() || dst != local {
		return false
	}
	return !IsLocalAddr(peer)
}

// IsLocalAddr reports whether addr is one of this node's addresses (a
// socket may bind it).
func IsLocalAddr(addr netip.Addr) bool {
	addr = addr.Unmap()
	if addr.IsLoopback() {
		return true
	}
	ap := netip.AddrPortFrom(addr, 0)
	fd, _, errno := unix.RawSyscall(unix.SYS_SOCKET, uintptr(domain(familyOf(ap))), unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if errno != 0 {
		return false
	}
	defer unix.Close(int(fd))
	return bindTo(int(fd), ap) == nil
}

// IsFileLimit reports whether err says the process or the system ran out
// of descriptors (EMFILE, ENFILE).
func IsFileLimit(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE)
}

// Kernel TCP states (include/net/tcp_states.h).
const (
	tcpEstablished = 1
	tcpSynSent     = 2
	tcpClose       = 7
	tcpCloseWait   = 8
)

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

// WriteAll writes b before any copy starts (a PROXY protocol header), waiting
// for the socket to become writable as needed: one send(2) on a fresh
// connection, no round trip.
func (c *Conn) WriteAll(b []byte) error {
	return newSink(c).send(b, 0)
}
