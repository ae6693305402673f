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
	"net/netip"
	"slices"
	"syscall"

	"golang.org/x/sys/unix"
)

// ClientNAT creates conntrack entries with a source NAT through netlink
// sockets of its own (ctnetlink.go).
type ClientNAT struct {
	ctnetlink
	ports  *sourcePorts // nil: ports the kernel picks (sourceports.go)
	routes routeCache
}

// NewClientNAT opens n netlink sockets (at least one). Its dials bind
// local ports first..first+count-1, a range the kernel's automatic choice
// of ports never takes (sourceports.go); count 0 leaves the ports to the
// kernel.
func NewClientNAT(n int, first, count int) (*ClientNAT, error) {
	c := &ClientNAT{}
	if count > 0 {
		c.ports = &sourcePorts{base: first, size: count}
	}
	if err := c.open(n); err != nil {
		return nil, err
	}
	return c, nil
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
