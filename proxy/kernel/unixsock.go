package kernel

// Unix sockets that carry descriptors (SCM_RIGHTS) between processes: the
// handover's and the keeper's SOCK_SEQPACKET sockets.

import (
	"errors"
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// ErrTruncated is ReceiveMsg's error for a record, or its descriptors,
// larger than the buffers given.
var ErrTruncated = errors.New("message truncated")

// SendMsg writes one record, b, with the descriptors fds (SCM_RIGHTS);
// they stay the caller's.
func SendMsg(c *net.UnixConn, b []byte, fds []int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	_, _, err := c.WriteMsgUnix(b, oob, nil)
	return err
}

// ReceiveMsg reads one record into buf, with at most maxFDs descriptors,
// each made close-on-exec and the caller's: n is the record's length.
func ReceiveMsg(c *net.UnixConn, buf []byte, maxFDs int) (n int, files []*os.File, err error) {
	oob := make([]byte, unix.CmsgSpace(maxFDs*4))
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return 0, nil, err
	}
	cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		return 0, nil, fmt.Errorf("control message: %w", err)
	}
	for _, cm := range cmsgs {
		fds, err := unix.ParseUnixRights(&cm)
		if err != nil {
			closeFiles(files)
			return 0, nil, fmt.Errorf("control message: %w", err)
		}
		for _, fd := range fds {
			unix.CloseOnExec(fd)
			files = append(files, os.NewFile(uintptr(fd), "received"))
		}
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		closeFiles(files)
		return 0, nil, ErrTruncated
	}
	return n, files, nil
}

func closeFiles(files []*os.File) {
	for _, f := range files {
		f.Close()
	}
}

// NetNS identifies this process's network namespace: the inode of
// /proc/self/ns/net, the same for every process in it and unique on the
// machine while the namespace lives.
func NetNS() (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/self/ns/net", &st); err != nil {
		return 0, fmt.Errorf("network namespace: %w", err)
	}
	return st.Ino, nil
}

// SeqpacketFromFD is the SOCK_SEQPACKET unix socket of descriptor fd (one
// this process inherited), made close-on-exec; an error when fd is not
// such a socket.
func SeqpacketFromFD(fd int, name string) (*net.UnixConn, error) {
	if t, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE); err != nil || t != unix.SOCK_SEQPACKET {
		return nil, fmt.Errorf("descriptor %d is not a SOCK_SEQPACKET socket (type %d, %v)", fd, t, err)
	}
	unix.CloseOnExec(fd)
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		return nil, err
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		c.Close()
		return nil, fmt.Errorf("descriptor %d is not a unix socket", fd)
	}
	return uc, nil
}

// SeqpacketPair makes a connected pair of SOCK_SEQPACKET unix sockets:
// this process's end, and the other as a file to hand to a child (close it
// here once the child started).
func SeqpacketPair(name, otherName string) (*net.UnixConn, *os.File, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, os.NewSyscallError("socketpair", err)
	}
	f := os.NewFile(uintptr(fds[0]), name)
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		unix.Close(fds[1])
		return nil, nil, err
	}
	return c.(*net.UnixConn), os.NewFile(uintptr(fds[1]), otherName), nil
}
