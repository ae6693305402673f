package sock

import (
	"errors"
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// Sockets handed to a successor process (package handover) leave as a
// duplicate descriptor (File, UDPFile) and come back as the successor's
// own (FileListener, FileUDP). A duplicate shares the socket, not the
// descriptor: closing one side's keeps the socket open while the other
// holds it, so connections queue in the listener's backlog until whoever
// serves accepts them.

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
		return nil, fmt.Errorf("handed-over socket is not a TCP socket (type %d, %v)", t, err)
	}
	if a, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN); err != nil || a != 1 {
		return nil, errors.New("handed-over socket is not listening")
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

// UDPFile returns a duplicate of a UDP socket's descriptor (from
// ListenUDP); the caller closes it.
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

// FileUDP makes a frontend UDP socket (as ListenUDP's) of one another
// process handed over; its options (buffers, IP_PKTINFO) came with it. f
// stays the caller's.
func FileUDP(f *os.File) (*net.UDPConn, error) {
	pc, err := net.FilePacketConn(f)
	if err != nil {
		return nil, err
	}
	c, ok := pc.(*net.UDPConn)
	if !ok {
		pc.Close()
		return nil, errors.New("handed-over socket is not a UDP socket")
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
