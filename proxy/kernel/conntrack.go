package kernel

// Conntrack over netlink (ctnetlink): the few requests the daemon makes —
// a client's source NAT created before its dial's first packet, an entry's
// state looked up or deleted, a new UDP flow's destination before NAT, and
// the UDP entries deleted after a rule change — with only the attributes
// they send and read.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"

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
	ctaFilter     = 25 // Linux 5.8

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

	ctaFilterOrigFlags   = 1      // CTA_FILTER_ORIG_FLAGS
	ctaFilterFlagProtoNo = 1 << 3 // CTA_FILTER_F_CTA_PROTO_NUM

	sizeofNfgenmsg = 4

	// natEntryTimeout is a created entry's life until its first packet;
	// conntrack's own timeouts take over from there.
	natEntryTimeout = 120
)

// Tuple names one of an entry's two directions.
type Tuple uint16

const (
	Original Tuple = ctaTupleOrig  // as the first packet went
	Reply    Tuple = ctaTupleReply // as its answers come back
)

// ErrEntryLive is DeleteIfOver's error for the entry of a connection that
// is not over.
var ErrEntryLive = errors.New("conntrack: a connection with that address and port is still open")

// Conntrack makes conntrack requests over a pool of netlink sockets.
type Conntrack struct{ pool *Pool }

// OpenConntrack opens n netlink sockets (at least one); requests fail
// where the kernel has no conntrack netlink (nf_conntrack_netlink).
func OpenConntrack(n int) (*Conntrack, error) {
	p, err := OpenPool(unix.NETLINK_NETFILTER, n)
	if err != nil {
		return nil, err
	}
	return &Conntrack{pool: p}, nil
}

// Close closes the sockets once no request uses them.
func (c *Conntrack) Close() { c.pool.Close() }

// message starts a ctnetlink request of type msg for family (unix.AF_INET
// or AF_INET6).
func message(msg, flags uint16, family byte) []byte {
	return NewMessage(nfnlSubsysCtnetlink<<8|msg, flags, family, unix.NFNETLINK_V0, 0, 0) // struct nfgenmsg
}

func familyOf(a netip.Addr) byte {
	if a.Is4() {
		return unix.AF_INET
	}
	return unix.AF_INET6
}

// appendTuple appends a tuple of a connection from src to dst.
func appendTuple(b []byte, t Tuple, proto uint8, src, dst netip.AddrPort) []byte {
	return AppendNested(b, uint16(t), func(b []byte) []byte {
		b = AppendNested(b, ctaTupleIP, func(b []byte) []byte {
			if src.Addr().Is4() {
				s, d := src.Addr().As4(), dst.Addr().Unmap().As4()
				return AppendAttr(AppendAttr(b, ctaIPv4Src, s[:]), ctaIPv4Dst, d[:])
			}
			s, d := src.Addr().As16(), dst.Addr().As16()
			return AppendAttr(AppendAttr(b, ctaIPv6Src, s[:]), ctaIPv6Dst, d[:])
		})
		return AppendNested(b, ctaTupleProto, func(b []byte) []byte {
			b = AppendAttr(b, ctaProtoNum, []byte{proto})
			b = AppendAttr(b, ctaProtoSrc, binary.BigEndian.AppendUint16(nil, src.Port()))
			return AppendAttr(b, ctaProtoDst, binary.BigEndian.AppendUint16(nil, dst.Port()))
		})
	})
}

// entryAttr is the attribute at path in the conntrack entry msg (with its
// netlink header), or nil.
func entryAttr(msg []byte, path ...uint16) []byte {
	if len(msg) < unix.SizeofNlMsghdr+sizeofNfgenmsg {
		return nil
	}
	return Attr(msg[unix.SizeofNlMsghdr+sizeofNfgenmsg:], path...)
}

// CreateNAT creates the entry of the connection (proto, unix.IPPROTO_TCP
// or _UDP) from local to remote with a source NAT to client: its address,
// and its port unless that is 0 (then local's stays). A TCP entry starts in
// SYN_SENT. EEXIST: an entry with one of its two tuples is still there.
func (c *Conntrack) CreateNAT(proto uint8, local, remote, client netip.AddrPort) error {
	b := message(ctMsgNew, unix.NLM_F_ACK|unix.NLM_F_CREATE|unix.NLM_F_EXCL, familyOf(local.Addr()))
	b = appendTuple(b, Original, proto, local, remote)
	b = appendTuple(b, Reply, proto, remote, local)
	b = binary.BigEndian.AppendUint32(appendAttrHeader(b, ctaTimeout, 4), natEntryTimeout)
	if proto == unix.IPPROTO_TCP {
		b = AppendNested(b, ctaProtoinfo, func(b []byte) []byte {
			return AppendNested(b, ctaProtoinfoTCP, func(b []byte) []byte {
				return AppendAttr(b, ctaProtoinfoTCPState, []byte{tcpConntrackSynSent})
			})
		})
	}
	b = AppendNested(b, ctaNATSrc, func(b []byte) []byte {
		if a := client.Addr(); a.Is4() {
			v := a.As4()
			b = AppendAttr(AppendAttr(b, ctaNATv4MinIP, v[:]), ctaNATv4MaxIP, v[:])
		} else {
			v := a.As16()
			b = AppendAttr(AppendAttr(b, ctaNATv6MinIP, v[:]), ctaNATv6MaxIP, v[:])
		}
		if client.Port() == 0 {
			return b
		}
		port := binary.BigEndian.AppendUint16(nil, client.Port())
		return AppendNested(b, ctaNATProto, func(b []byte) []byte {
			return AppendAttr(AppendAttr(b, ctaProtoNATPortMin, port), ctaProtoNATPortMax, port)
		})
	})
	return c.pool.Do(b, nil)
}

// Delete deletes the entry whose original tuple goes from local to remote
// (ENOENT: none).
func (c *Conntrack) Delete(proto uint8, local, remote netip.AddrPort) error {
	b := appendTuple(message(ctMsgDelete, unix.NLM_F_ACK, familyOf(local.Addr())), Original, proto, local, remote)
	return c.pool.Do(b, nil)
}

// DeleteIfOver deletes the TCP entry whose tuple t goes from src to dst if
// its connection is over (TIME_WAIT, CLOSE), as conntrack lets a new SYN
// take such an entry over; ErrEntryLive if it is not (a connection open or
// still closing, whose last packets would be taken for a new one's); nil
// if there is none.
func (c *Conntrack) DeleteIfOver(t Tuple, src, dst netip.AddrPort) error {
	state, err := c.TCPState(t, src, dst)
	switch {
	case errors.Is(err, unix.ENOENT):
		return nil
	case err != nil:
		return err
	case state != tcpConntrackTimeWait && state != tcpConntrackClose:
		return ErrEntryLive
	}
	b := appendTuple(message(ctMsgDelete, unix.NLM_F_ACK, familyOf(src.Addr())), t, unix.IPPROTO_TCP, src, dst)
	if err := c.pool.Do(b, nil); err != nil && !errors.Is(err, unix.ENOENT) {
		return err
	}
	return nil
}

// TCPState is the conntrack TCP state (TCP_CONNTRACK_*) of the entry whose
// tuple t goes from src to dst, -1 if it has none (ENOENT: no entry).
func (c *Conntrack) TCPState(t Tuple, src, dst netip.AddrPort) (int, error) {
	state := -1
	b := appendTuple(message(ctMsgGet, unix.NLM_F_ACK, familyOf(src.Addr())), t, unix.IPPROTO_TCP, src, dst)
	err := c.pool.Do(b, func(msg []byte) {
		if v := entryAttr(msg, ctaProtoinfo, ctaProtoinfoTCP, ctaProtoinfoTCPState); len(v) > 0 {
			state = int(v[0])
		}
	})
	return state, err
}

// RepliesTo says whether the TCP entry of the connection from local to
// remote replies to client: conntrack replaces a closed entry (a reset
// while the handshake was under way) with one of its own, without the NAT,
// when the next SYN comes.
func (c *Conntrack) RepliesTo(local, remote netip.AddrPort, client netip.Addr) (bool, error) {
	var dst []byte
	b := appendTuple(message(ctMsgGet, unix.NLM_F_ACK, familyOf(local.Addr())), Original, unix.IPPROTO_TCP, local, remote)
	attr := uint16(ctaIPv4Dst)
	if !client.Is4() {
		attr = ctaIPv6Dst
	}
	err := c.pool.Do(b, func(msg []byte) { dst = slices.Clone(entryAttr(msg, ctaTupleReply, ctaTupleIP, attr)) })
	if err != nil {
		return false, err
	}
	return slices.Equal(dst, client.AsSlice()), nil
}

// UDPOriginalDst is the destination, before NAT, of the UDP flow whose
// datagrams from peer arrived at local, found by its conntrack entry's
// reply tuple (from local to peer): a Service address when a rule
// redirected it, local itself when the peer sent to local. found is false
// when there is no entry: no rule can have redirected the flow.
func (c *Conntrack) UDPOriginalDst(local, peer netip.AddrPort) (dst netip.AddrPort, found bool, err error) {
	dst, err = c.originalDst(unix.IPPROTO_UDP, local, peer)
	if errors.Is(err, unix.ENOENT) {
		return netip.AddrPort{}, false, nil
	}
	return dst, err == nil, err
}

// originalDst is UDPOriginalDst for the protocol proto; ENOENT: no entry.
func (c *Conntrack) originalDst(proto uint8, local, peer netip.AddrPort) (netip.AddrPort, error) {
	local, peer = unmapPort(local), unmapPort(peer)
	var dst netip.AddrPort
	b := appendTuple(message(ctMsgGet, unix.NLM_F_ACK, familyOf(local.Addr())), Reply, proto, local, peer)
	ipAttr := uint16(ctaIPv4Dst)
	if !local.Addr().Is4() {
		ipAttr = ctaIPv6Dst
	}
	err := c.pool.Do(b, func(msg []byte) {
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
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err == nil {
		return errors.New("conntrack netlink: an entry for a documentation address exists")
	}
	return err
}

// UDPEntry is what DeleteUDP tells its match of one UDP entry.
type UDPEntry struct {
	// Dst is the original destination: the address and port the client
	// sent to.
	Dst netip.AddrPort
	// ReplyPort is the source port of the replies: for a REDIRECTed
	// datagram, the listener's port; 0 when the entry has none.
	ReplyPort uint16
}

// DeleteUDP deletes the UDP entries of family (4 or 6) that match says to,
// in one dump of the table's UDP entries; read is how many entries the
// dump returned. The kernel filters the dump by protocol (CTA_FILTER, Linux
// 5.8; an older kernel ignores it and returns every entry, which are then
// skipped here): a node's table is mostly TCP, hundreds of thousands of
// entries on a busy one, and each is read in place, never parsed whole.
// The matches are deleted after the dump (deleting while dumping can
// interrupt it). An interrupted dump still deletes what it saw, and returns
// ErrDumpInterrupted too; an entry gone meanwhile counts as deleted.
func (c *Conntrack) DeleteUDP(family int, match func(UDPEntry) bool) (deleted, read uint, err error) {
	fam := byte(unix.AF_INET)
	if family == 6 {
		fam = unix.AF_INET6
	}
	dump := message(ctMsgGet, unix.NLM_F_DUMP, fam)
	dump = AppendNested(dump, ctaTupleOrig, func(b []byte) []byte {
		return AppendNested(b, ctaTupleProto, func(b []byte) []byte {
			return AppendAttr(b, ctaProtoNum, []byte{unix.IPPROTO_UDP})
		})
	})
	dump = AppendNested(dump, ctaFilter, func(b []byte) []byte {
		return AppendAttr(b, ctaFilterOrigFlags, binary.NativeEndian.AppendUint32(nil, ctaFilterFlagProtoNo))
	})
	var stale [][]byte // the matching entries' attributes, as the kernel sent them
	err = c.pool.Do(dump, func(msg []byte) {
		read++
		if len(msg) < unix.SizeofNlMsghdr+sizeofNfgenmsg {
			return
		}
		attrs := msg[unix.SizeofNlMsghdr+sizeofNfgenmsg:]
		if e, ok := udpEntry(attrs); ok && match(e) {
			stale = append(stale, slices.Clone(attrs))
		}
	})
	if err != nil && !errors.Is(err, ErrDumpInterrupted) {
		return 0, read, fmt.Errorf("dump conntrack: %w", err)
	}
	for _, attrs := range stale {
		del := append(message(ctMsgDelete, unix.NLM_F_ACK, fam), attrs...)
		switch derr := c.pool.Do(del, nil); {
		case derr == nil, errors.Is(derr, unix.ENOENT): // ENOENT: it expired since the dump
			deleted++
		default:
			err = errors.Join(err, fmt.Errorf("delete conntrack entry: %w", derr))
		}
	}
	return deleted, read, err
}

// udpEntry reads a UDP entry's original destination and reply source port
// from its attributes; false for another protocol or a malformed entry.
func udpEntry(attrs []byte) (UDPEntry, bool) {
	if p := Attr(attrs, ctaTupleOrig, ctaTupleProto, ctaProtoNum); len(p) != 1 || p[0] != unix.IPPROTO_UDP {
		return UDPEntry{}, false
	}
	var addr netip.Addr
	for _, typ := range []uint16{ctaIPv4Dst, ctaIPv6Dst} {
		if v := Attr(attrs, ctaTupleOrig, ctaTupleIP, typ); v != nil {
			addr, _ = netip.AddrFromSlice(v)
		}
	}
	port := Attr(attrs, ctaTupleOrig, ctaTupleProto, ctaProtoDst)
	if !addr.IsValid() || len(port) != 2 {
		return UDPEntry{}, false
	}
	e := UDPEntry{Dst: netip.AddrPortFrom(addr.Unmap(), binary.BigEndian.Uint16(port))}
	if v := Attr(attrs, ctaTupleReply, ctaTupleProto, ctaProtoSrc); len(v) == 2 {
		e.ReplyPort = binary.BigEndian.Uint16(v)
	}
	return e, true
}

// ProbeConntrack asks conntrack netlink for an entry that does not exist:
// nil where the kernel answers (nf_conntrack_netlink), else why not.
func ProbeConntrack() error {
	ct, err := OpenConntrack(1)
	if err != nil {
		return err
	}
	defer ct.Close()
	return ct.Probe()
}
