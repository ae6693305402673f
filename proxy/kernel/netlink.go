package kernel

// Netlink, written once for every family the daemon speaks (conntrack,
// routes): a message is built by appending to a byte slice, an answer's
// attributes are read in place, and a Pool's sockets each carry one request
// at a time, answers bounded by SO_RCVTIMEO.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// attrTypeMask clears an attribute type's nested and byte-order flags.
const attrTypeMask = ^uint16(unix.NLA_F_NESTED | unix.NLA_F_NET_BYTEORDER)

// NewMessage starts a request of type typ with flags (NLM_F_REQUEST is
// added) and a fixed header of its family (nfgenmsg, rtmsg …). Pool.Do
// fills in its length and sequence number.
func NewMessage(typ, flags uint16, fixed ...byte) []byte {
	b := make([]byte, unix.SizeofNlMsghdr, 256)
	binary.NativeEndian.PutUint16(b[4:], typ)
	binary.NativeEndian.PutUint16(b[6:], unix.NLM_F_REQUEST|flags)
	b = append(b, fixed...)
	for len(b)%unix.NLMSG_ALIGNTO != 0 {
		b = append(b, 0)
	}
	return b
}

// appendAttrHeader appends the header of an attribute whose value of n
// bytes follows (a multiple of 4).
func appendAttrHeader(b []byte, typ uint16, n int) []byte {
	b = binary.NativeEndian.AppendUint16(b, uint16(unix.SizeofNlAttr+n))
	return binary.NativeEndian.AppendUint16(b, typ)
}

// AppendAttr appends one attribute, padded to 4 bytes.
func AppendAttr(b []byte, typ uint16, v []byte) []byte {
	b = append(appendAttrHeader(b, typ, len(v)), v...)
	for len(b)%unix.NLA_ALIGNTO != 0 {
		b = append(b, 0)
	}
	return b
}

// AppendNested appends a nested attribute whose contents add appends.
func AppendNested(b []byte, typ uint16, add func([]byte) []byte) []byte {
	start := len(b)
	b = add(appendAttrHeader(b, typ|unix.NLA_F_NESTED, 0))
	binary.NativeEndian.PutUint16(b[start:], uint16(len(b)-start))
	return b
}

// EachAttr calls fn with every attribute of attrs (its type without the
// flags), in order, until fn returns false; a malformed attribute ends the
// walk.
func EachAttr(attrs []byte, fn func(typ uint16, value []byte) bool) {
	for len(attrs) >= unix.SizeofNlAttr {
		l := int(binary.NativeEndian.Uint16(attrs))
		if l < unix.SizeofNlAttr || l > len(attrs) {
			return
		}
		if !fn(binary.NativeEndian.Uint16(attrs[2:])&attrTypeMask, attrs[unix.SizeofNlAttr:l]) {
			return
		}
		attrs = attrs[min((l+unix.NLA_ALIGNTO-1)&^(unix.NLA_ALIGNTO-1), len(attrs)):]
	}
}

// Attr is the value of the attribute at path (nested attribute types) in
// attrs, or nil.
func Attr(attrs []byte, path ...uint16) []byte {
	for i, typ := range path {
		var found []byte
		EachAttr(attrs, func(t uint16, v []byte) bool {
			if t == typ {
				found = v
				return false
			}
			return true
		})
		if found == nil || i == len(path)-1 {
			return found
		}
		attrs = found
	}
	return nil
}

// ErrDumpInterrupted is a dump's error when the table changed under it:
// what it returned is incomplete, not wrong.
var ErrDumpInterrupted = errors.New("netlink: dump interrupted")

// errPoolClosed is a request's error after Close.
var errPoolClosed = errors.New("netlink: closed")

// Pool is a set of netlink sockets of one protocol, each used by one
// request at a time.
type Pool struct {
	socks  chan *socket
	closed chan struct{}
	seq    atomic.Uint32
}

// socket is a netlink socket with the buffer its answers are read into.
type socket struct {
	fd  int
	buf [4096]byte
}

// OpenPool opens n sockets (at least one) of protocol proto
// (unix.NETLINK_NETFILTER, unix.NETLINK_ROUTE).
func OpenPool(proto, n int) (*Pool, error) {
	p := &Pool{socks: make(chan *socket, max(n, 1)), closed: make(chan struct{})}
	for range cap(p.socks) {
		fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
		if err != nil {
			p.Close()
			return nil, os.NewSyscallError("socket", err)
		}
		// A bound: the kernel answers at once, or the request is lost.
		tv := unix.NsecToTimeval(int64(time.Second))
		if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
			unix.Close(fd)
			p.Close()
			return nil, os.NewSyscallError("setsockopt", err)
		}
		if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
			unix.Close(fd)
			p.Close()
			return nil, os.NewSyscallError("bind", err)
		}
		p.socks <- &socket{fd: fd}
	}
	return p, nil
}

// Close closes the sockets; requests after it fail. Only after every
// request has returned: a socket in use when it is called stays open.
func (p *Pool) Close() {
	select {
	case <-p.closed:
	default:
		close(p.closed)
	}
	for {
		select {
		case s := <-p.socks:
			unix.Close(s.fd)
		default:
			return
		}
	}
}

// Do sends the request b (from NewMessage) on a free socket and reads its
// answer: the data messages (each with its netlink header) go to onData,
// and Do returns the kernel's error, or nil at its acknowledgement or at
// the end of a dump (NLM_F_DUMP). A dump the kernel interrupted returns
// ErrDumpInterrupted after every message it sent.
func (p *Pool) Do(b []byte, onData func(msg []byte)) error {
	binary.NativeEndian.PutUint32(b, uint32(len(b)))
	seq := p.seq.Add(1)
	binary.NativeEndian.PutUint32(b[8:], seq)
	dump := binary.NativeEndian.Uint16(b[6:])&unix.NLM_F_DUMP == unix.NLM_F_DUMP
	var s *socket
	select {
	case <-p.closed:
		return errPoolClosed
	case s = <-p.socks:
	}
	defer func() { p.socks <- s }()
	if err := unix.Sendto(s.fd, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return os.NewSyscallError("sendto", err)
	}
	buf := s.buf[:]
	if dump {
		buf = make([]byte, 64<<10) // a dump's messages come many to a read
	}
	interrupted := false
	for {
		n, _, err := unix.Recvfrom(s.fd, buf, 0)
		if err != nil {
			return fmt.Errorf("netlink: %w", os.NewSyscallError("recvfrom", err))
		}
		// Answers to requests that timed out earlier are skipped.
		for msg := buf[:n]; len(msg) >= unix.SizeofNlMsghdr; {
			l := int(binary.NativeEndian.Uint32(msg))
			if l < unix.SizeofNlMsghdr || l > len(msg) {
				break
			}
			typ, flags := binary.NativeEndian.Uint16(msg[4:]), binary.NativeEndian.Uint16(msg[6:])
			if binary.NativeEndian.Uint32(msg[8:]) == seq {
				interrupted = interrupted || flags&unix.NLM_F_DUMP_INTR != 0
				switch {
				case typ == unix.NLMSG_ERROR || typ == unix.NLMSG_DONE:
					if l >= unix.SizeofNlMsghdr+4 {
						if errno := -int32(binary.NativeEndian.Uint32(msg[unix.SizeofNlMsghdr:])); errno != 0 {
							return unix.Errno(errno)
						}
					}
					if interrupted {
						return ErrDumpInterrupted
					}
					return nil
				case onData != nil:
					onData(msg[:l])
				}
			}
			msg = msg[min((l+unix.NLMSG_ALIGNTO-1)&^(unix.NLMSG_ALIGNTO-1), len(msg)):]
		}
	}
}
