package iptables

import (
	"errors"
	"net"
	"net/netip"
	"testing"

	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

func udpFrontend(name string, listen uint16, nodePort int, ips ...string) proxy.Frontend {
	sp := &config.ServicePort{Name: config.ServicePortName{Namespace: "ns", Name: name}, Protocol: config.UDP, Port: 53, NodePort: nodePort}
	for _, ip := range ips {
		sp.ClusterIPs = append(sp.ClusterIPs, netip.MustParseAddr(ip))
	}
	return proxy.Frontend{Service: sp, Kind: proxy.KindAll, Family: 4, Protocol: config.UDP,
		Listen: netip.AddrPortFrom(netip.IPv4Unspecified(), listen)}
}

// recorder is a conntrackCleaner whose deletions are recorded.
func recorder() (*conntrackCleaner, *[]*udpFilter) {
	var got []*udpFilter
	c := newConntrackCleaner(4)
	c.delete = func(fam int, f *udpFilter) (uint, error) { got = append(got, f); return 1, nil }
	return c, &got
}

func TestConntrackDeletesWhatChanged(t *testing.T) {
	log := logrus.New()
	c, got := recorder()
	dns := udpFrontend("dns", 45001, 0, "10.96.0.10")
	stats := udpFrontend("stats", 45002, 30053, "10.96.0.20")
	tcp := udpFrontend("web", 45003, 0, "10.96.0.30")
	tcp.Protocol = config.TCP

	// The first sync after start: every UDP address (entries may survive
	// a restart), none of TCP.
	c.sync([]proxy.Frontend{dns, stats, tcp}, log)
	if len(*got) != 1 || len((*got)[0].addrs) != 2 || !(*got)[0].ports[30053] || len((*got)[0].ports) != 1 {
		t.Fatalf("first sync deleted %+v, want both UDP ClusterIPs and the NodePort", *got)
	}
	// Nothing changed: nothing deleted.
	*got = nil
	c.sync([]proxy.Frontend{dns, stats, tcp}, log)
	if len(*got) != 0 {
		t.Fatalf("an unchanged sync deleted %+v", (*got)[0])
	}
	// dns's listener moved; stats went: their addresses are stale.
	dns2 := udpFrontend("dns", 45009, 0, "10.96.0.10")
	c.sync([]proxy.Frontend{dns2, tcp}, log)
	want := map[netip.AddrPort]bool{netip.MustParseAddrPort("10.96.0.10:53"): true, netip.MustParseAddrPort("10.96.0.20:53"): true}
	if len(*got) != 1 || len((*got)[0].addrs) != 2 || !(*got)[0].addrs[netip.MustParseAddrPort("10.96.0.10:53")] ||
		!(*got)[0].addrs[netip.MustParseAddrPort("10.96.0.20:53")] || !(*got)[0].ports[30053] {
		t.Fatalf("deleted %+v, want %v and NodePort 30053", *got, want)
	}
	// An address added to a Service: the new one only.
	*got = nil
	dns3 := udpFrontend("dns", 45009, 0, "10.96.0.10")
	dns3.Service.ExternalIPs = []netip.Addr{netip.MustParseAddr("203.0.113.5")}
	c.sync([]proxy.Frontend{dns3, tcp}, log)
	if len(*got) != 1 || len((*got)[0].addrs) != 1 || !(*got)[0].addrs[netip.MustParseAddrPort("203.0.113.5:53")] {
		t.Fatalf("deleted %+v, want only the added externalIP", *got)
	}
}

// A kernel without conntrack is said once, and syncing goes on.
func TestConntrackFailureWarnsOnce(t *testing.T) {
	log := logrus.New()
	hook := &countHook{}
	log.AddHook(hook)
	c := newConntrackCleaner(4)
	c.delete = func(int, *udpFilter) (uint, error) { return 0, errors.New("protocol not supported") }
	c.sync([]proxy.Frontend{udpFrontend("a", 45001, 0, "10.96.0.10")}, log)
	c.sync([]proxy.Frontend{udpFrontend("a", 45002, 0, "10.96.0.10")}, log)
	if hook.warnings != 1 {
		t.Fatalf("%d warnings, want 1", hook.warnings)
	}
}

type countHook struct{ warnings int }

func (h *countHook) Levels() []logrus.Level { return []logrus.Level{logrus.WarnLevel} }
func (h *countHook) Fire(*logrus.Entry) error {
	h.warnings++
	return nil
}

func TestUDPFilterMatches(t *testing.T) {
	f := &udpFilter{addrs: map[netip.AddrPort]bool{netip.MustParseAddrPort("10.96.0.10:53"): true}, ports: map[uint16]bool{30053: true}}
	flow := func(proto uint8, dst string) *netlink.ConntrackFlow {
		ap := netip.MustParseAddrPort(dst)
		fl := &netlink.ConntrackFlow{}
		fl.Forward.Protocol = proto
		fl.Forward.DstIP = net.IP(ap.Addr().AsSlice())
		fl.Forward.DstPort = ap.Port()
		return fl
	}
	for _, tc := range []struct {
		proto uint8
		dst   string
		want  bool
	}{
		{unix.IPPROTO_UDP, "10.96.0.10:53", true},
		{unix.IPPROTO_TCP, "10.96.0.10:53", false},
		{unix.IPPROTO_UDP, "10.96.0.10:54", false},
		{unix.IPPROTO_UDP, "192.168.1.7:30053", true},
		{unix.IPPROTO_UDP, "10.96.0.11:53", false},
	} {
		if got := f.MatchConntrackFlow(flow(tc.proto, tc.dst)); got != tc.want {
			t.Errorf("proto %d to %s: %v, want %v", tc.proto, tc.dst, got, tc.want)
		}
	}
}
