package handover

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// The exchange's wire: one JSON message per SOCK_SEQPACKET record, its
// descriptors in SCM_RIGHTS; and who is on the other end.

// send writes one message with fds.
func send(c *net.UnixConn, m message, fds []int) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	_, _, err = c.WriteMsgUnix(b, oob, nil)
	return err
}

// receive reads one message and the descriptors it carries.
func receive(c *net.UnixConn) (message, []*os.File, error) {
	buf := make([]byte, maxMessage)
	oob := make([]byte, unix.CmsgSpace(perMessage*4))
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return message{}, nil, err
	}
	files, ferr := parseRights(oob[:oobn])
	switch {
	case ferr != nil:
		return message{}, nil, ferr
	case flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0:
		closeAll(files)
		return message{}, nil, errors.New("message truncated")
	case n == 0:
		closeAll(files)
		return message{}, nil, errors.New("closed by the peer")
	}
	var m message
	if err := json.Unmarshal(buf[:n], &m); err != nil {
		closeAll(files)
		return message{}, nil, fmt.Errorf("bad message: %w", err)
	}
	return m, files, nil
}

func parseRights(oob []byte) ([]*os.File, error) {
	cmsgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("control message: %w", err)
	}
	var files []*os.File
	for _, cm := range cmsgs {
		fds, err := unix.ParseUnixRights(&cm)
		if err != nil {
			closeAll(files)
			return nil, fmt.Errorf("control message: %w", err)
		}
		for _, fd := range fds {
			unix.CloseOnExec(fd)
			files = append(files, os.NewFile(uintptr(fd), "handover"))
		}
	}
	return files, nil
}

func closeAll(files []*os.File) {
	for _, f := range files {
		f.Close()
	}
}

// cred is a unix peer's credentials.
type cred struct{ uid, pid uint32 }

func (c cred) String() string { return fmt.Sprintf("uid %d pid %d", c.uid, c.pid) }

// command is the peer's command line, for the log of who asked (empty
// when it is gone or unreadable).
func (c cred) command() string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", c.pid))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(strings.ReplaceAll(string(b), "\x00", " "))
}

func peerOf(c *net.UnixConn) (cred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return cred{}, err
	}
	var u *unix.Ucred
	var uerr error
	if err := raw.Control(func(fd uintptr) {
		u, uerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return cred{}, err
	}
	if uerr != nil {
		return cred{}, uerr
	}
	return cred{uid: u.Uid, pid: uint32(u.Pid)}, nil
}

// netNS identifies this process's network namespace: the inode of
// /proc/self/ns/net, the same for every process in it and unique on the
// machine while the namespace lives.
func netNS() (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/self/ns/net", &st); err != nil {
		return 0, fmt.Errorf("network namespace: %w", err)
	}
	return st.Ino, nil
}
