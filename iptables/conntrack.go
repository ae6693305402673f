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
	"errors"
	"net/netip"
	"syscall"

	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// udpTarget is a UDP address clients send to: a service address and port, or
// (addr invalid) a NodePort on any node address.
type udpTarget struct {
	addr netip.Addr
	port uint16
}

// conntrackCleaner deletes the conntrack entries of UDP service addresses
// whose listener changed since the last sync, for one IP family.
type conntrackCleaner struct {
	fam int
	// targets maps every UDP service address to the listener port it is
	// redirected to (0: none); nil before the first sync, when every
	// address counts as changed (entries may survive a daemon restart).
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
func udpTargets(frontends []proxy.Frontend) map[udpTarget]uint16 {
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
		add := func(addrs []netip.Addr) {
			for _, a := range addrs {
				if config.Family(a) == fe.Family {
					out[udpTarget{a, uint16(sp.Port)}] = port
				}
			}
		}
		if fe.Kind != proxy.KindExternal {
			add(sp.ClusterIPs)
		}
		if fe.Kind != proxy.KindInternal {
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
func (c *conntrackCleaner) sync(frontends []proxy.Frontend, log logrus.FieldLogger) {
	now := udpTargets(frontends)
	filter := &udpFilter{addrs: map[netip.AddrPort]bool{}, ports: map[uint16]bool{}}
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
		log.WithFields(logrus.Fields{"family": c.fam, "entries": n, "addresses": len(filter.addrs) + len(filter.ports)}).
			Debug("Deleted stale UDP conntrack entries")
	}
}

// udpFilter matches the conntrack entries of UDP datagrams sent to one of
// addrs, or to one of ports on any address (NodePorts).
type udpFilter struct {
	addrs map[netip.AddrPort]bool
	ports map[uint16]bool
}

var _ netlink.CustomConntrackFilter = (*udpFilter)(nil)

// MatchConntrackFlow implements netlink.CustomConntrackFilter.
func (f *udpFilter) MatchConntrackFlow(flow *netlink.ConntrackFlow) bool {
	if flow.Forward.Protocol != unix.IPPROTO_UDP {
		return false
	}
	if f.ports[flow.Forward.DstPort] {
		return true
	}
	addr, ok := netip.AddrFromSlice(flow.Forward.DstIP)
	return ok && f.addrs[netip.AddrPortFrom(addr.Unmap(), flow.Forward.DstPort)]
}

// deleteConntrack deletes the entries of family fam that filter matches, in
// one dump of the table.
func deleteConntrack(fam int, filter *udpFilter) (uint, error) {
	family := netlink.InetFamily(unix.AF_INET)
	if fam == 6 {
		family = unix.AF_INET6
	}
	n, err := netlink.ConntrackDeleteFilters(netlink.ConntrackTable, family, filter)
	if errors.Is(err, syscall.ENOENT) {
		err = nil // an entry that expired between the dump and the delete
	}
	return n, err
}
