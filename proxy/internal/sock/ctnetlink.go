package sock

// Conntrack over netlink (ctnetlink), written by hand: one request at a
// time per socket, answers bounded by SO_RCVTIMEO, and only the few
// attributes the proxy sends and reads. The ClientNAT creates and deletes
// entries with it; a Conntrack (below) only reads them.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Netlink and ctnetlink constants (linux/netfilter/nfnetlink.h,
// nfnetlink_conntrack.h).
const (
	nfnlSubsysCtnetlink = 1
	ctMsgNew            = 0
	ctMsgGet            = 1
	ctMsgDelete         = 2

	ctaTupleOrig  = 1
	ctaTupleReply = 2
	ctaProtoinfo  = 4
	ctaNATSrc     = 6
	ctaTimeout    = 7

	ctaTupleIP    = 1
	ctaTupleProto = 2
	ctaIPv4Src    = 1
	ctaIPv4Dst    = 2
	ctaIPv6Src    = 3
	ctaIPv6Dst    = 4
	ctaProtoNum   = 1
	ctaProtoSrc   = 2
	ctaProtoDst   = 3

	ctaProtoinfoTCP      = 1
	ctaProtoinfoTCPState = 1
	tcpConntrackSynSent  = 1
	tcpConntrackTimeWait = 7
	tcpConntrackClose    = 8

	ctaNATv4MinIP      = 1
	ctaNATv4MaxIP      = 2
	ctaNATProto        = 3
	ctaNATv6MinIP      = 4
	ctaNATv6MaxIP      = 5
	ctaProtoNATPortMin = 1
	ctaProtoNATPortMax = 2
	nlaTypeMask        = ^uint16(unix.NLA_F_NESTED | unix.NLA_F_NET_BYTEORDER)
	sizeofNfgenmsg     = 4

	// natEntryTimeout is the created entry's life until its first packet;
	// conntrack's own timeouts take over from there.
	natEntryTimeout = 120
)

// ctnetlink is a pool of conntrack netlink sockets, each used by one
// request at a time.
type ctnetlink struct {
	socks  chan int
	closed chan struct{}
	seq    atomic.Uint32
}

// open opens n sockets (at least one).
func (c *ctnetlink) open(n int) error {
	c.socks, c.closed = make(chan int, max(n, 1)), make(chan struct{})
	for range cap(c.socks) {
		fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
		if err != nil {
			c.Close()
			return os.NewSyscallError("socket", err)
		}
		// A bound: the kernel answers at once, or the request is lost.
		tv := unix.NsecToTimeval(int64(time.Second))
		if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
			unix.Close(fd)
			c.Close()
			return os.NewSyscallError("setsockopt", err)
		}
		if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
			unix.Close(fd)
			c.Close()
			return os.NewSyscallError("bind", err)
		}
		c.socks <- fd
	}
	return nil
}

// errNetlinkClosed is a request's error after Close.
var errNetlinkClosed = errors.New("conntrack netlink: closed")

// Close closes the sockets; requests after it fail. Only after every
// request has returned: a socket in use when it is called stays open.
func (c *ctnetlink) Close() {
	select {
	case <-c.closed:
	default:
		close(c.closed)
	}
	for {
		select {
		case fd := <-c.socks:
			unix.Close(fd)
		default:
			return
		}
	}
}

// header starts a ctnetlink request of type msg for the family of addr.
func (c *ctnetlink) header(msg uint16, flags uint16, addr netip.AddrPort) []byte {
	b := make([]byte, unix.SizeofNlMsghdr, 256)
	binary.NativeEndian.PutUint16(b[4:], nfnlSubsysCtnetlink<<8|msg)
	binary.NativeEndian.PutUint16(b[6:], unix.NLM_F_REQUEST|unix.NLM_F_ACK|flags)
	binary.NativeEndian.PutUint32(b[8:], c.seq.Add(1))
	family := byte(unix.AF_INET)
	if !addr.Addr().Is4() {
		family = unix.AF_INET6
	}
	return append(b, family, unix.NFNETLINK_V0, 0, 0) // struct nfgenmsg
}

// do sends the request b on a free socket and waits for its answer; data
// answers (a GET's entry) go to onData.
func (c *ctnetlink) do(b []byte, onData func(msg []byte)) error {
	binary.NativeEndian.PutUint32(b, uint32(len(b)))
	seq := binary.NativeEndian.Uint32(b[8:])
	var fd int
	select {
	case <-c.closed:
		return errNetlinkClosed
	case fd = <-c.socks:
	}
	defer func() { c.socks <- fd }()
	if err := unix.Sendto(fd, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return os.NewSyscallError("sendto", err)
	}
	var buf [4096]byte
	for {
		n, _, err := unix.Recvfrom(fd, buf[:], 0)
		if err != nil {
			return fmt.Errorf("conntrack netlink: %w", os.NewSyscallError("recvfrom", err))
		}
		// Answers to requests that timed out earlier are skipped.
		for msg := buf[:n]; len(msg) >= unix.SizeofNlMsghdr; {
			l := int(binary.NativeEndian.Uint32(msg))
			if l < unix.SizeofNlMsghdr || l > len(msg) {
				break
			}
			typ, got := binary.NativeEndian.Uint16(msg[4:]), binary.NativeEndian.Uint32(msg[8:])
			switch {
			case got != seq:
			case typ == unix.NLMSG_ERROR && l >= unix.SizeofNlMsghdr+4:
				if errno := -int32(binary.NativeEndian.Uint32(msg[unix.SizeofNlMsghdr:])); errno != 0 {
					return syscall.Errno(errno)
				}
				return nil
			case onData != nil && typ != unix.NLMSG_DONE:
				onData(msg[:l])
			}
			msg = msg[min((l+3)&^3, len(msg)):]
		}
	}
}

// entryAttr is the value of the attribute at path (nested attribute types)
// in the conntrack entry in msg, or nil.
func entryAttr(msg []byte, path ...uint16) []byte {
	if len(msg) < unix.SizeofNlMsghdr+sizeofNfgenmsg {
		return nil
	}
	attrs := msg[unix.SizeofNlMsghdr+sizeofNfgenmsg:]
	for len(attrs) >= unix.SizeofNlAttr {
		l := int(binary.NativeEndian.Uint16(attrs))
		if l < unix.SizeofNlAttr || l > len(attrs) {
			return nil
		}
		typ, value := binary.NativeEndian.Uint16(attrs[2:])&nlaTypeMask, attrs[unix.SizeofNlAttr:l]
		if typ == path[0] {
			if len(path) == 1 {
				return value
			}
			path, attrs = path[1:], value
			continue
		}
		attrs = attrs[min((l+3)&^3, len(attrs)):]
	}
	return nil
}

// putTuple appends a CTA_TUPLE_ORIG or _REPLY of a connection from src to dst.
func putTuple(b []byte, typ uint16, proto uint8, src, dst netip.AddrPort) []byte {
	return nest(b, typ, func(b []byte) []byte {
		b = nest(b, ctaTupleIP, func(b []byte) []byte {
			if src.Addr().Is4() {
				s, d := src.Addr().As4(), dst.Addr().Unmap().As4()
				return putAttr(putAttr(b, ctaIPv4Src, s[:]), ctaIPv4Dst, d[:])
			}
			s, d := src.Addr().As16(), dst.Addr().As16()
			return putAttr(putAttr(b, ctaIPv6Src, s[:]), ctaIPv6Dst, d[:])
		})
		return nest(b, ctaTupleProto, func(b []byte) []byte {
			b = putAttr(b, ctaProtoNum, []byte{proto})
			b = putAttr(b, ctaProtoSrc, binary.BigEndian.AppendUint16(nil, src.Port()))
			return putAttr(b, ctaProtoDst, binary.BigEndian.AppendUint16(nil, dst.Port()))
		})
	})
}

// putAttrHeader appends the header of an attribute whose value of n bytes
// follows (a multiple of 4).
func putAttrHeader(b []byte, typ uint16, n int) []byte {
	b = binary.NativeEndian.AppendUint16(b, uint16(unix.SizeofNlAttr+n))
	return binary.NativeEndian.AppendUint16(b, typ)
}

// putAttr appends one attribute, padded to 4 bytes.
func putAttr(b []byte, typ uint16, v []byte) []byte {
	b = append(putAttrHeader(b, typ, len(v)), v...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// nest appends a nested attribute whose contents add appends.
func nest(b []byte, typ uint16, add func([]byte) []byte) []byte {
	start := len(b)
	b = add(putAttrHeader(b, typ|unix.NLA_F_NESTED, 0))
	binary.NativeEndian.PutUint16(b[start:], uint16(len(b)-start))
	return b
}

// Conntrack reads conntrack entries: the guard of a proxy port on a kernel
// without the conntrack match asks it where a new UDP flow was sent.
type Conntrack struct{ ctnetlink }

// OpenConntrack opens n netlink sockets (at least one); it fails where the
// kernel has no conntrack netlink (nf_conntrack_netlink).
func OpenConntrack(n int) (*Conntrack, error) {
	c := &Conntrack{}
	if err := c.open(n); err != nil {
		return nil, err
	}
	return c, nil
}

// UDPOriginalDst is the destination, before NAT, of the UDP flow whose
// datagrams from peer arrived at local, found by its conntrack entry's
// reply tuple (from local to peer): a Service address when a rule
// redirected it, local itself when the peer sent to local. found is false
// when there is no entry: no rule can have redirected the flow.
func (c *Conntrack) UDPOriginalDst(local, peer netip.AddrPort) (dst netip.AddrPort, found bool, err error) {
	dst, err = c.originalDst(unix.IPPROTO_UDP, local, peer)
	if errors.Is(err, syscall.ENOENT) {
		return netip.AddrPort{}, false, nil
	}
	return dst, err == nil, err
}

// originalDst is UDPOriginalDst for the protocol proto; ENOENT: no entry.
func (c *Conntrack) originalDst(proto uint8, local, peer netip.AddrPort) (netip.AddrPort, error) {
	local, peer = unmapPort(local), unmapPort(peer)
	var dst netip.AddrPort
	b := putTuple(c.header(ctMsgGet, 0, local), ctaTupleReply, proto, local, peer)
	ipAttr := uint16(ctaIPv4Dst)
	if !local.Addr().Is4() {
		ipAttr = ctaIPv6Dst
	}
	err := c.do(b, func(msg []byte) {
		ip, ok := netip.AddrFromSlice(entryAttr(msg, ctaTupleOrig, ctaTupleIP, ipAttr))
		port := entryAttr(msg, ctaTupleOrig, ctaTupleProto, ctaProtoDst)
		if ok && len(port) == 2 {
			dst = netip.AddrPortFrom(ip, binary.BigEndian.Uint16(port))
		}
	})
	if err != nil {
		return netip.AddrPort{}, err
	}
	if !dst.IsValid() {
		return netip.AddrPort{}, fmt.Errorf("conntrack netlink: the entry of %v from %v has no original destination", local, peer)
	}
	return dst, nil
}

func unmapPort(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

// Probe looks up the entry of a flow between two documentation addresses
// (there is none): nil when conntrack netlink answers, as it does where
// nf_conntrack_netlink is loaded.
func (c *Conntrack) Probe() error {
	_, err := c.originalDst(unix.IPPROTO_UDP, netip.MustParseAddrPort("192.0.2.1:9"), netip.MustParseAddrPort("192.0.2.2:9"))
	if errors.Is(err, syscall.ENOENT) {
		return nil
	}
	if err == nil {
		return errors.New("conntrack netlink: an entry for a documentation address exists")
	}
	return err
}
