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
)

// DialTCP connects to ep within timeout, or until ctx is done. The socket
// gets TCP_NODELAY and keep-alive (the kernel's probe count). Errors are
// *net.OpError; DialFailure names them.
func DialTCP(ctx context.Context, ep netip.AddrPort, timeout time.Duration) (*Conn, error) {
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
	c, err := newConn(int(fd))
	if err != nil {
		return nil, err
	}
	// The handshake has often finished inside connect: look at the state
	// before waiting, which saves a park on the poller.
	if err := c.awaitConnect(ctx, timeout); err != nil {
		c.Close()
		return nil, dialError(ep, err)
	}
	return c, nil
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
// "file limit", "cancelled" or "error".
func DialFailure(err error) string {
	var errno syscall.Errno
	switch {
	case errors.Is(err, context.Canceled):
		return "cancelled"
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, syscall.ETIMEDOUT):
		return "timeout"
	case IsFileLimit(err):
		return "file limit"
	case !errors.As(err, &errno):
		return "error"
	}
	switch errno {
	case syscall.ECONNREFUSED:
		return "refused"
	case syscall.EHOSTUNREACH, syscall.ENETUNREACH, syscall.EHOSTDOWN, syscall.ENETDOWN, syscall.EADDRNOTAVAIL:
		return "unreachable"
	case syscall.ECONNRESET, syscall.ECONNABORTED:
		return "reset"
	}
	return "error"
}
