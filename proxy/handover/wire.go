package handover

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// The exchange's wire: one JSON message per SOCK_SEQPACKET record, its
// descriptors in SCM_RIGHTS; and who is on the other end.

// send writes one message with fds.
func send(c *net.UnixConn, m message, fds []int) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	return kernel.SendMsg(c, b, fds)
}

// receive reads one message and the descriptors it carries.
func receive(c *net.UnixConn) (message, []*os.File, error) {
	buf := make([]byte, maxMessage)
	n, files, err := kernel.ReceiveMsg(c, buf, perMessage)
	switch {
	case err != nil:
		return message{}, nil, err
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
	k, err := kernel.PeerCred(c)
	return cred{uid: k.UID, pid: k.PID}, err
}
