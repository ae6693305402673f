package sock

// The client's own address on a backend connection, by conntrack. Before a
// dial connects, it creates the conntrack entry of its own connection (the
// node's address and the port it bound, to the endpoint) with a source NAT
// to the client's address. The backend sees the client. Its replies,
// addressed to the client, meet the same entry wherever they enter this
// node (routed from another node, or bridged from a local pod through
// br_netfilter, as kube-proxy's DNAT needs too), and are turned back into
// replies to the dial's socket. No mark, no policy routing, no
// IP_TRANSPARENT: one netlink request per connection, and per packet only
// the NAT conntrack does for kube-proxy's DNAT.
//
// The entry must be created before the first packet: conntrack only looks
// for NAT rules when it sees a connection's first packet, and then finds
// the entry already there, with the NAT done.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ClientNAT creates conntrack entries with a source NAT through netlink
// sockets of its own, each used by one request at a time.
type ClientNAT struct {
	socks  chan int
	closed chan struct{}
	seq    atomic.Uint32
	ports  *sourcePorts // nil: ports the kernel picks (sourceports.go)
	routes routeCache
}

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

// NewClientNAT opens n netlink sockets (at least one). Its dials bind
// local ports first..first+count-1, a range the kernel's automatic choice
// of ports never takes (sourceports.go); count 0 leaves the ports to the
// kernel.
func NewClientNAT(n int, first, count int) (*ClientNAT, error) {
	c := &ClientNAT{socks: make(chan int, max(n, 1)), closed: make(chan struct{})}
	if count > 0 {
		c.ports = &sourcePorts{base: first, size: count}
	}
	for range cap(c.socks) {
		fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
		if err != nil {
			c.Close()
			return nil, os.NewSyscallError("socket", err)
		}
		// A bound: the kernel answers at once, or the request is lost.
		tv := unix.NsecToTimeval(int64(time.Second))
		if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
			unix.Close(fd)
			c.Close()
			return nil, os.NewSyscallError("setsockopt", err)
		}
		if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
			unix.Close(fd)
			c.Close()
			return nil, os.NewSyscallError("bind", err)
		}
		c.socks <- fd
	}
	return c, nil
}

// errNATClosed is a request's error after Close.
var errNATClosed = errors.New("conntrack netlink: closed")

// Close closes the sockets; requests after it fail. Only after every
// request has returned: a socket in use when it is called stays open.
func (c *ClientNAT) Close() {
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

// Probe creates and deletes the entry of a connection between two
// documentation addresses of family 4 or 6 (nothing is sent): it
// fails where the kernel lacks a piece the source NAT needs
// (nf_conntrack_netlink, NAT for the family).
func (c *ClientNAT) Probe(family int) error {
	local, remote, client := netip.MustParseAddrPort("192.0.2.1:9"), netip.MustParseAddrPort("192.0.2.2:9"), netip.MustParseAddr("192.0.2.3")
	if family == 6 {
		local, remote, client = netip.MustParseAddrPort("[2001:db8::1]:9"), netip.MustParseAddrPort("[2001:db8::2]:9"), netip.MustParseAddr("2001:db8::3")
	}
	if err := c.claim(unix.IPPROTO_TCP, local, remote, netip.AddrPortFrom(client, 9)); err != nil && !errors.Is(err, syscall.EEXIST) {
		return err
	}
	return c.release(unix.IPPROTO_TCP, local, remote)
}

// claim creates the entry of the connection from local to remote with a
// source NAT to client: its address, and its port unless that is 0 (then
// local's stays). EEXIST: an entry with one of its two tuples is still
// there (an earlier connection's, in TIME_WAIT; see deleteIfOver).
func (c *ClientNAT) claim(proto uint8, local, remote, client netip.AddrPort) error {
	b := c.header(ctMsgNew, unix.NLM_F_CREATE|unix.NLM_F_EXCL, local)
	b = putTuple(b, ctaTupleOrig, proto, local, remote)
	b = putTuple(b, ctaTupleReply, proto, remote, local)
	b = binary.BigEndian.AppendUint32(putAttrHeader(b, ctaTimeout, 4), natEntryTimeout)
	if proto == unix.IPPROTO_TCP {
		b = nest(b, ctaProtoinfo, func(b []byte) []byte {
			return nest(b, ctaProtoinfoTCP, func(b []byte) []byte {
				return putAttr(b, ctaProtoinfoTCPState, []byte{tcpConntrackSynSent})
			})
		})
	}
	b = nest(b, ctaNATSrc, func(b []byte) []byte {
		if a := client.Addr(); a.Is4() {
			v := a.As4()
			b = putAttr(putAttr(b, ctaNATv4MinIP, v[:]), ctaNATv4MaxIP, v[:])
		} else {
			v := a.As16()
			b = putAttr(putAttr(b, ctaNATv6MinIP, v[:]), ctaNATv6MaxIP, v[:])
		}
		if client.Port() == 0 {
			return b
		}
		port := binary.BigEndian.AppendUint16(nil, client.Port())
		return nest(b, ctaNATProto, func(b []byte) []byte {
			return putAttr(putAttr(b, ctaProtoNATPortMin, port), ctaProtoNATPortMax, port)
		})
	})
	return c.do(b, nil)
}

// errEntryLive: deleteIfOver found the entry of a connection still open.
var errEntryLive = errors.New("conntrack: a connection with that address and port is still open")

// deleteIfOver deletes the TCP entry whose tuple typ (ctaTupleOrig or
// ctaTupleReply) goes from src to dst if its connection is over
// (TIME_WAIT, CLOSE), as conntrack lets a new SYN take such an entry over.
// errEntryLive if it is not over: a connection still open, or one still
// closing, whose last packets would be taken for the new one's, and
// which loses its NAT with its entry (another socket's: a predecessor's
// connection, or one a predecessor handed over). nil if there is none.
func (c *ClientNAT) deleteIfOver(typ uint16, src, dst netip.AddrPort) error {
	state, err := c.tcpState(typ, src, dst)
	switch {
	case errors.Is(err, syscall.ENOENT):
		return nil
	case err != nil:
		return err
	case state != tcpConntrackTimeWait && state != tcpConntrackClose:
		return errEntryLive
	}
	b := putTuple(c.header(ctMsgDelete, 0, src), typ, unix.IPPROTO_TCP, src, dst)
	if err := c.do(b, nil); err != nil && !errors.Is(err, syscall.ENOENT) {
		return err
	}
	return nil
}

// tcpState is the TCP state of the entry whose tuple typ goes from src to
// dst (ENOENT: none).
func (c *ClientNAT) tcpState(typ uint16, src, dst netip.AddrPort) (int, error) {
	state := -1
	b := putTuple(c.header(ctMsgGet, 0, src), typ, unix.IPPROTO_TCP, src, dst)
	err := c.do(b, func(msg []byte) { state = entryTCPState(msg) })
	return state, err
}

// entryTCPState is the TCP state of the conntrack entry in msg (a ctnetlink
// message with its netlink header), or -1.
func entryTCPState(msg []byte) int {
	if v := entryAttr(msg, ctaProtoinfo, ctaProtoinfoTCP, ctaProtoinfoTCPState); len(v) > 0 {
		return int(v[0])
	}
	return -1
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

// natted says whether the TCP entry of the connection from local to remote
// still replies to client: conntrack replaces a closed entry (a reset
// while the handshake was under way, say a late SYN-ACK of an earlier
// try) with one of its own, without the NAT, when the next SYN comes.
func (c *ClientNAT) natted(local, remote netip.AddrPort, client netip.Addr) (bool, error) {
	var dst []byte
	b := putTuple(c.header(ctMsgGet, 0, local), ctaTupleOrig, unix.IPPROTO_TCP, local, remote)
	attr := uint16(ctaIPv4Dst)
	if !client.Is4() {
		attr = ctaIPv6Dst
	}
	err := c.do(b, func(msg []byte) { dst = slices.Clone(entryAttr(msg, ctaTupleReply, ctaTupleIP, attr)) })
	if err != nil {
		return false, err
	}
	return slices.Equal(dst, client.AsSlice()), nil
}

// dropEarlier deletes the entry of an earlier connection (or flow) from
// local to remote, found by a claim for a new one: a TCP entry only once
// its connection is over (errEntryLive if not), a UDP one always.
func (c *ClientNAT) dropEarlier(proto uint8, local, remote netip.AddrPort) error {
	if proto == unix.IPPROTO_TCP {
		return c.deleteIfOver(ctaTupleOrig, local, remote)
	}
	if err := c.release(proto, local, remote); err != nil && !errors.Is(err, syscall.ENOENT) {
		return err
	}
	return nil
}

// release deletes the entry of the connection from local to remote (after
// a dial that failed: no packet of it will come again).
func (c *ClientNAT) release(proto uint8, local, remote netip.AddrPort) error {
	b := c.header(ctMsgDelete, 0, local)
	b = putTuple(b, ctaTupleOrig, proto, local, remote)
	return c.do(b, nil)
}

// header starts a ctnetlink request of type msg for the family of addr.
func (c *ClientNAT) header(msg uint16, flags uint16, addr netip.AddrPort) []byte {
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
func (c *ClientNAT) do(b []byte, onData func(msg []byte)) error {
	binary.NativeEndian.PutUint32(b, uint32(len(b)))
	seq := binary.NativeEndian.Uint32(b[8:])
	var fd int
	select {
	case <-c.closed:
		return errNATClosed
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
