package sock

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Sockets handed to a successor process (package handover) leave as a
// duplicate descriptor (File, UDPFile) and come back as the successor's
// own (FileListener, FileUDP). A duplicate shares the socket, not the
// descriptor: closing one side's keeps the socket open while the other
// holds it, so connections queue in the listener's backlog until whoever
// serves accepts them.

// ErrDetached is Copy's answer once its source was detached (Conn.Detach):
// nothing is in flight.
var ErrDetached = errors.New("sock: detached for a handover")

// Detach has a Copy reading from c return ErrDetached at its next pause:
// when it waits for c to be readable, having written on all it read (at
// once if it waits already, or is parked: the Parker wakes it). A Copy
// held up writing to a peer that does not read returns only once that
// write is done. Writes on c are not affected. Like Abort it never waits.
func (c *Conn) Detach() {
	c.mu.Lock()
	if c.done.Load() || c.detach.Swap(true) {
		c.mu.Unlock()
		return
	}
	_ = c.f.SetReadDeadline(abortedAt)
	c.mu.Unlock()
	if e := c.parked.Load(); e != nil {
		e.p.unpark(e)
	}
}

// Undetach takes a Detach back: the next Copy from c runs as before.
func (c *Conn) Undetach() {
	c.mu.Lock()
	if c.detach.Swap(false) && !c.done.Load() {
		_ = c.f.SetReadDeadline(time.Time{})
	}
	c.mu.Unlock()
}

// File returns a duplicate of c's descriptor, for a successor process;
// the caller closes it. Closing c afterwards leaves the connection open
// in the successor (no FIN: the socket lives while a descriptor does).
func (c *Conn) File() (*os.File, error) {
	var f *os.File
	var ferr error
	if err := c.control(func(fd int) { f, ferr = dupFile(fd, "tcp") }); err != nil {
		return nil, err
	}
	return f, ferr
}

// FileConn makes a Conn of a connected TCP socket that another process
// transferred; f stays the caller's (close it).
func FileConn(f *os.File) (*Conn, error) {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("fcntl", err)
	}
	if t, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE); err != nil || t != unix.SOCK_STREAM {
		unix.Close(fd)
		return nil, fmt.Errorf("inherited socket is not a TCP socket (type %d, %v)", t, err)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("fcntl", err)
	}
	c, err := newConn(fd)
	if err != nil {
		return nil, err
	}
	inq, _ := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_INQ)
	c.inq = inq == 1
	return c, nil
}

// HoldSourcePort makes the port of c, a backend connection a predecessor
// dialled from the port range of nat (a source-NATed dial), this
// process's own while c is open, as if c had been dialled here: no dial
// of this process binds it meanwhile, and c's Close gives it back. A port
// outside the range is left alone.
func (c *Conn) HoldSourcePort(nat *ClientNAT) {
	if nat == nil || nat.ports == nil {
		return
	}
	var local netip.AddrPort
	_ = c.control(func(fd int) { local, _ = localAddr(fd) })
	addr := local.Addr().Unmap()
	if local.IsValid() && nat.ports.claim(addr, local.Port()) {
		c.onClose = func() { nat.ports.put(addr, local.Port()) }
	}
}

// File returns a duplicate of the listener's descriptor; the caller
// closes it. The listener serves on as before.
func (l *Listener) File() (*os.File, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil, net.ErrClosed
	}
	return dupFile(l.fd, "listener "+l.addr.String())
}

// FileListener makes a Listener of a listening TCP socket that another
// process handed over; f stays the caller's (close it).
func FileListener(f *os.File) (*Listener, error) {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("fcntl", err)
	}
	ok := false
	defer func() {
		if !ok {
			unix.Close(fd)
		}
	}()
	if t, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE); err != nil || t != unix.SOCK_STREAM {
		return nil, fmt.Errorf("inherited socket is not a TCP socket (type %d, %v)", t, err)
	}
	if a, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN); err != nil || a != 1 {
		return nil, errors.New("inherited socket is not listening")
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		return nil, os.NewSyscallError("fcntl", err)
	}
	addr, err := localAddr(fd)
	if err != nil {
		return nil, err
	}
	inq, _ := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_INQ)
	ok = true
	return &Listener{fd: fd, addr: addr, inq: inq == 1}, nil
}

// UDPFile returns a duplicate of a UDP socket's descriptor (a frontend's
// from ListenUDP, or a flow's from DialUDPFrom), still non-blocking; the
// caller closes it.
func UDPFile(c *net.UDPConn) (*os.File, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var f *os.File
	var ferr error
	if err := raw.Control(func(fd uintptr) { f, ferr = dupFile(int(fd), "udp "+c.LocalAddr().String()) }); err != nil {
		return nil, err
	}
	return f, ferr
}

// FileUDP makes a UDP socket (a frontend's as ListenUDP's, or a flow's)
// of one another process handed over; its options (buffers, IP_PKTINFO)
// came with it. f stays the caller's.
func FileUDP(f *os.File) (*net.UDPConn, error) {
	pc, err := net.FilePacketConn(f)
	if err != nil {
		return nil, err
	}
	c, ok := pc.(*net.UDPConn)
	if !ok {
		pc.Close()
		return nil, errors.New("inherited socket is not a UDP socket")
	}
	return c, nil
}

func dupFile(fd int, name string) (*os.File, error) {
	d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("fcntl", err)
	}
	return os.NewFile(uintptr(d), name), nil
}
