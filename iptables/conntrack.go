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
	"net/netip"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
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

// match says whether e, an entry of a UDP datagram, is one to delete:
// sent to one of the filter's addresses or ports, and not redirected to
// the listener its address has now (e.ReplyPort, the listener a REDIRECT
// sent it to; 0: not known).
func (f *udpFilter) match(e kernel.UDPEntry) bool {
	if !f.ports[e.Dst.Port()] && !f.addrs[e.Dst] {
		return false
	}
	if f.current == nil || e.ReplyPort == 0 {
		return true
	}
	nodePort := netip.AddrPortFrom(netip.Addr{}, e.Dst.Port())
	return !f.current[e.Dst][e.ReplyPort] && !f.current[nodePort][e.ReplyPort]
}

// deleteConntrack deletes the UDP entries of family fam that filter
// matches, in one dump (kernel.Conntrack.DeleteUDP).
func deleteConntrack(fam int, filter *udpFilter) (uint, error) {
	deleted, _, err := deleteUDPConntrack(fam, filter)
	return deleted, err
}

// deleteUDPConntrack is deleteConntrack that also says how many entries
// the dump read.
func deleteUDPConntrack(fam int, filter *udpFilter) (deleted, read uint, err error) {
	ct, err := kernel.OpenConntrack(1)
	if err != nil {
		return 0, 0, err
	}
	defer ct.Close()
	return ct.DeleteUDP(fam, filter.match)
}
