package iptables

// UDP conntrack hygiene. A UDP client that keeps sending from one source port
// (resolvers, syslog, statsd, game and VoIP clients) keeps its conntrack entry
// alive, and the entry keeps the REDIRECT it got first: after the listener
// behind a service address changes (a Service re-created, an address added, a
// traffic policy changed, a daemon restart), the client's datagrams go to the
// old listener port — nowhere, or to another Service that took the port.
// TCP has no such problem (a new connection is a new entry). So after every
// rule sync the entries of UDP service addresses whose target changed, came
// or went are deleted, as the classic proxier did with `conntrack -D`, through
// netlink instead of an exec.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"syscall"

	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// udpTarget is a UDP address clients send to: a service address and port, or
// (addr invalid) a NodePort on any node address. local marks the target of
// clients on this node where it differs (the short-circuit of
// externalTrafficPolicy: Local): a change of either deletes the address's
// entries.
type udpTarget struct {
	addr  netip.Addr
	port  uint16
	local bool
}

// conntrackCleaner deletes the conntrack entries of UDP service addresses
// whose listener changed since the last sync, for one IP family.
type conntrackCleaner struct {
	fam int
	// targets maps every UDP service address to the listener port it is
	// redirected to (0: none); nil before the first sync, when every
	// address counts as changed (entries may survive a daemon restart) but
	// an entry already redirected to the listener it has now is spared.
	targets map[udpTarget]uint16
	// delete removes the entries filter matches (netlink; tests replace it).
	delete func(fam int, filter *udpFilter) (uint, error)
	warned bool // the kernel refused once: said, not said again
}

func newConntrackCleaner(fam int) *conntrackCleaner {
	return &conntrackCleaner{fam: fam, delete: deleteConntrack}
}

// udpTargets maps the UDP service addresses of frontends to their listener
// ports.
func udpTargets(frontends []config.Frontend) map[udpTarget]uint16 {
	out := map[udpTarget]uint16{}
	for _, fe := range frontends {
		sp := fe.Service
		if fe.Protocol != config.UDP {
			continue
		}
		port := fe.Listen.Port()
		if fe.Err != nil {
			port = 0
		}
		addAs := func(local bool, addrs []netip.Addr) {
			for _, a := range addrs {
				if config.Family(a) == fe.Family {
					out[udpTarget{addr: a, port: uint16(sp.Port), local: local}] = port
				}
			}
		}
		add := func(addrs []netip.Addr) { addAs(false, addrs) }
		if fe.ServesLocalClients() {
			addAs(true, sp.ExternalIPs)
			addAs(true, sp.LoadBalancerIPs)
			if sp.NodePort != 0 {
				out[udpTarget{port: uint16(sp.NodePort), local: true}] = port
			}
		}
		if fe.Kind.ClusterIPs() {
			add(sp.ClusterIPs)
		}
		if fe.Kind.External() {
			add(sp.ExternalIPs)
			add(sp.LoadBalancerIPs)
			if sp.NodePort != 0 {
				np := port
				if fe.NodePortErr != nil {
					np = 0
				}
				out[udpTarget{port: uint16(sp.NodePort)}] = np
			}
		}
	}
	return out
}

// sync deletes the entries of every UDP service address whose target is not
// what it was at the last sync. Call it after the rules are in place, so that
// the next datagram meets the new rules.
func (c *conntrackCleaner) sync(frontends []config.Frontend, log logrus.FieldLogger) {
	now := udpTargets(frontends)
	filter := &udpFilter{addrs: map[netip.AddrPort]bool{}, ports: map[uint16]bool{}}
	if c.targets == nil {
		// The first sync knows nothing of what the rules said before: an
		// entry already redirected to the listener its address has now
		// stays (a successor that took its predecessor's listeners over,
		// a restart that got the same ports). Deleting a live flow's entry
		// would do harm: the flow's next reply makes an entry of its own,
		// and the client's next datagram, clashing with it, comes with
		// another source port, a new client to us.
		filter.current = listenerPorts(now)
	}
	stale := func(t udpTarget) {
		if t.addr.IsValid() {
			filter.addrs[netip.AddrPortFrom(t.addr, t.port)] = true
		} else {
			filter.ports[t.port] = true
		}
	}
	for t, port := range now {
		if old, ok := c.targets[t]; !ok || old != port || c.targets == nil {
			stale(t)
		}
	}
	for t := range c.targets {
		if _, ok := now[t]; !ok {
			stale(t)
		}
	}
	c.targets = now
	if len(filter.addrs) == 0 && len(filter.ports) == 0 {
		return
	}
	n, err := c.delete(c.fam, filter)
	switch {
	case err != nil && !c.warned:
		c.warned = true
		log.WithError(err).WithField("family", c.fam).Warn("Cannot delete stale UDP conntrack entries (is nf_conntrack loaded?); " +
			"UDP clients that keep one source port may reach an old listener until their entry expires. Not said again")
	case err == nil && n > 0:
		conntrackDeleted.Add(float64(n))
		conntrackReconcilerDeleted.WithLabelValues(familyName(c.fam)).Add(float64(n))
		log.WithFields(logrus.Fields{"family": c.fam, "entries": n, "addresses": len(filter.addrs) + len(filter.ports)}).
			Debug("Deleted stale UDP conntrack entries")
	}
}

// udpFilter matches the conntrack entries of UDP datagrams sent to one of
// addrs, or to one of ports on any address (NodePorts), but for those
// redirected to a listener port current gives their address.
type udpFilter struct {
	addrs map[netip.AddrPort]bool
	ports map[uint16]bool
	// current maps a service address (a NodePort: the invalid address
	// with its port) to the listener ports it is redirected to; nil: no
	// entry is spared.
	current map[netip.AddrPort]map[uint16]bool
}

// listenerPorts maps every UDP service address of targets to the listener
// ports its datagrams are redirected to (none: no listener).
func listenerPorts(targets map[udpTarget]uint16) map[netip.AddrPort]map[uint16]bool {
	out := map[netip.AddrPort]map[uint16]bool{}
	for t, port := range targets {
		if port == 0 {
			continue
		}
		key := netip.AddrPortFrom(t.addr, t.port)
		if out[key] == nil {
			out[key] = map[uint16]bool{}
		}
		out[key][port] = true
	}
	return out
}

// match says whether an entry whose original direction is proto to dst,
// and whose replies come from port redirect (the listener a REDIRECT sent
// it to; 0: not known), is one to delete.
func (f *udpFilter) match(proto uint8, dst netip.AddrPort, redirect uint16) bool {
	if proto != unix.IPPROTO_UDP || !(f.ports[dst.Port()] || f.addrs[dst]) {
		return false
	}
	if f.current == nil || redirect == 0 {
		return true
	}
	nodePort := netip.AddrPortFrom(netip.Addr{}, dst.Port())
	return !f.current[dst][redirect] && !f.current[nodePort][redirect]
}

// Conntrack netlink attributes the netlink package does not name
// (linux/netfilter/nfnetlink_conntrack.h).
const (
	ctaFilter            = 25     // CTA_FILTER (Linux 5.8)
	ctaFilterOrigFlags   = 1      // CTA_FILTER_ORIG_FLAGS
	ctaFilterFlagProtoNo = 1 << 3 // CTA_FILTER_F_CTA_PROTO_NUM
)

// deleteConntrack deletes the entries of family fam that filter matches.
func deleteConntrack(fam int, filter *udpFilter) (uint, error) {
	deleted, _, err := deleteUDPConntrack(fam, filter)
	return deleted, err
}

// deleteUDPConntrack deletes the entries of family fam that filter matches,
// in one dump of the table's UDP entries; read is how many entries the dump
// returned. The kernel filters the dump by protocol (CTA_FILTER, Linux 5.8;
// an older kernel ignores it and returns every entry, which match then
// skips): a node's table is mostly TCP, hundreds of thousands of entries on
// a busy one, and parsing all of them into the netlink package's flows cost
// a start with 100 000 TCP entries 1.04 s of CPU and 84 MiB of RSS (now
// 0.07 s and 30 MiB). The dump is read a message at a time and only the
// matches are kept, to be deleted after it (deleting while dumping can
// interrupt the dump).
func deleteUDPConntrack(fam int, filter *udpFilter) (deleted, read uint, err error) {
	family := uint8(unix.AF_INET)
	if fam == 6 {
		family = unix.AF_INET6
	}
	header := &nl.Nfgenmsg{NfgenFamily: family, Version: nl.NFNETLINK_V0}
	dump := nl.NewNetlinkRequest(int(netlink.ConntrackTable)<<8|nl.IPCTNL_MSG_CT_GET, unix.NLM_F_DUMP)
	dump.AddData(header)
	orig := nl.NewRtAttr(unix.NLA_F_NESTED|nl.CTA_TUPLE_ORIG, nil)
	orig.AddRtAttr(unix.NLA_F_NESTED|nl.CTA_TUPLE_PROTO, nil).AddRtAttr(nl.CTA_PROTO_NUM, nl.Uint8Attr(unix.IPPROTO_UDP))
	dump.AddData(orig)
	only := nl.NewRtAttr(unix.NLA_F_NESTED|ctaFilter, nil)
	only.AddRtAttr(ctaFilterOrigFlags, nl.Uint32Attr(ctaFilterFlagProtoNo))
	dump.AddData(only)

	var stale [][]byte // the matching entries' attributes, as the kernel sent them
	err = dump.ExecuteIter(unix.NETLINK_NETFILTER, 0, func(msg []byte) bool {
		if len(msg) < nl.SizeofNfgenmsg {
			return true
		}
		read++
		attrs := msg[nl.SizeofNfgenmsg:]
		if proto, dst, ok := origDestination(attrs); ok && filter.match(proto, dst, replySourcePort(attrs)) {
			stale = append(stale, bytes.Clone(attrs))
		}
		return true
	})
	if err != nil && !errors.Is(err, nl.ErrDumpInterrupted) {
		return 0, read, fmt.Errorf("dump conntrack: %w", err)
	}
	// An interrupted dump (the table changed under it) still deletes what
	// it saw; the error is returned too.
	for _, attrs := range stale {
		del := nl.NewNetlinkRequest(int(netlink.ConntrackTable)<<8|nl.IPCTNL_MSG_CT_DELETE, unix.NLM_F_ACK)
		del.AddData(header)
		del.AddRawData(attrs)
		switch _, derr := del.Execute(unix.NETLINK_NETFILTER, 0); {
		case derr == nil, errors.Is(derr, syscall.ENOENT): // ENOENT: it expired since the dump
			deleted++
		default:
			err = errors.Join(err, fmt.Errorf("delete conntrack entry: %w", derr))
		}
	}
	return deleted, read, err
}

// origDestination reads an entry's protocol and original destination from
// its netlink attributes (CTA_TUPLE_ORIG: CTA_TUPLE_IP, CTA_TUPLE_PROTO).
func origDestination(attrs []byte) (proto uint8, dst netip.AddrPort, ok bool) {
	tuple, found := nestedAttr(attrs, nl.CTA_TUPLE_ORIG)
	if !found {
		return 0, dst, false
	}
	var addr netip.Addr
	var port uint16
	if ip, found := nestedAttr(tuple, nl.CTA_TUPLE_IP); found {
		for _, typ := range []uint16{nl.CTA_IP_V4_DST, nl.CTA_IP_V6_DST} {
			if v, found := nestedAttr(ip, typ); found {
				addr, _ = netip.AddrFromSlice(v)
			}
		}
	}
	if p, found := nestedAttr(tuple, nl.CTA_TUPLE_PROTO); found {
		if v, found := nestedAttr(p, nl.CTA_PROTO_NUM); found && len(v) == 1 {
			proto = v[0]
		}
		if v, found := nestedAttr(p, nl.CTA_PROTO_DST_PORT); found && len(v) == 2 {
			port = binary.BigEndian.Uint16(v)
		}
	}
	if !addr.IsValid() || proto == 0 {
		return 0, dst, false
	}
	return proto, netip.AddrPortFrom(addr.Unmap(), port), true
}

// replySourcePort reads the source port of an entry's reply direction
// (CTA_TUPLE_REPLY): for a REDIRECTed datagram, the listener's port; 0 when
// the entry has none.
func replySourcePort(attrs []byte) uint16 {
	tuple, found := nestedAttr(attrs, nl.CTA_TUPLE_REPLY)
	if !found {
		return 0
	}
	p, found := nestedAttr(tuple, nl.CTA_TUPLE_PROTO)
	if !found {
		return 0
	}
	if v, found := nestedAttr(p, nl.CTA_PROTO_SRC_PORT); found && len(v) == 2 {
		return binary.BigEndian.Uint16(v)
	}
	return 0
}

// nestedAttr returns the value of the first attribute of type typ in attrs
// (the nested and byte-order flags ignored).
func nestedAttr(attrs []byte, typ uint16) ([]byte, bool) {
	for len(attrs) >= unix.SizeofNlAttr {
		l := int(binary.NativeEndian.Uint16(attrs[0:2]))
		t := binary.NativeEndian.Uint16(attrs[2:4]) &^ (unix.NLA_F_NESTED | unix.NLA_F_NET_BYTEORDER)
		if l < unix.SizeofNlAttr || l > len(attrs) {
			return nil, false // malformed: stop
		}
		if t == typ {
			return attrs[unix.SizeofNlAttr:l], true
		}
		attrs = attrs[min((l+unix.NLA_ALIGNTO-1)&^(unix.NLA_ALIGNTO-1), len(attrs)):]
	}
	return nil, false
}
