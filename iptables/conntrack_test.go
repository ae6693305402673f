package iptables

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"testing"

	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

func udpFrontend(name string, listen uint16, nodePort int, ips ...string) config.Frontend {
	sp := &config.ServicePort{Name: config.ServicePortName{Namespace: "ns", Name: name}, Protocol: config.UDP, Port: 53, NodePort: nodePort}
	for _, ip := range ips {
		sp.ClusterIPs = append(sp.ClusterIPs, netip.MustParseAddr(ip))
	}
	return config.Frontend{Service: sp, Kind: config.KindAll, Family: 4, Protocol: config.UDP,
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
	c.sync([]config.Frontend{dns, stats, tcp}, log)
	if len(*got) != 1 || len((*got)[0].addrs) != 2 || !(*got)[0].ports[30053] || len((*got)[0].ports) != 1 {
		t.Fatalf("first sync deleted %+v, want both UDP ClusterIPs and the NodePort", *got)
	}
	// ... but for the entries already redirected to today's listeners.
	first := (*got)[0]
	if first.match(kernel.UDPEntry{Dst: netip.MustParseAddrPort("10.96.0.10:53"), ReplyPort: 45001}) ||
		first.match(kernel.UDPEntry{Dst: netip.MustParseAddrPort("192.168.1.7:30053"), ReplyPort: 45002}) ||
		!first.match(kernel.UDPEntry{Dst: netip.MustParseAddrPort("10.96.0.10:53"), ReplyPort: 45002}) {
		t.Fatalf("first sync's filter spares %v, want the entries redirected to 45001 (dns) and 45002 (stats' NodePort)", first.current)
	}
	// Nothing changed: nothing deleted.
	*got = nil
	c.sync([]config.Frontend{dns, stats, tcp}, log)
	if len(*got) != 0 {
		t.Fatalf("an unchanged sync deleted %+v", (*got)[0])
	}
	// dns's listener moved; stats went: their addresses are stale, every
	// entry of theirs.
	dns2 := udpFrontend("dns", 45009, 0, "10.96.0.10")
	c.sync([]config.Frontend{dns2, tcp}, log)
	if len(*got) == 1 && (*got)[0].current != nil {
		t.Fatalf("a later sync spares %v", (*got)[0].current)
	}
	want := map[netip.AddrPort]bool{netip.MustParseAddrPort("10.96.0.10:53"): true, netip.MustParseAddrPort("10.96.0.20:53"): true}
	if len(*got) != 1 || len((*got)[0].addrs) != 2 || !(*got)[0].addrs[netip.MustParseAddrPort("10.96.0.10:53")] ||
		!(*got)[0].addrs[netip.MustParseAddrPort("10.96.0.20:53")] || !(*got)[0].ports[30053] {
		t.Fatalf("deleted %+v, want %v and NodePort 30053", *got, want)
	}
	// An address added to a Service: the new one only.
	*got = nil
	dns3 := udpFrontend("dns", 45009, 0, "10.96.0.10")
	dns3.Service.ExternalIPs = []netip.Addr{netip.MustParseAddr("203.0.113.5")}
	c.sync([]config.Frontend{dns3, tcp}, log)
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
	c.sync([]config.Frontend{udpFrontend("a", 45001, 0, "10.96.0.10")}, log)
	c.sync([]config.Frontend{udpFrontend("a", 45002, 0, "10.96.0.10")}, log)
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
	cases := []struct {
		dst      string
		redirect uint16
		want     bool
	}{
		{"10.96.0.10:53", 45001, true},
		{"10.96.0.10:54", 45001, false},
		{"192.168.1.7:30053", 45002, true},
		{"10.96.0.11:53", 45001, false},
	}
	for _, tc := range cases {
		if got := f.match(kernel.UDPEntry{Dst: netip.MustParseAddrPort(tc.dst), ReplyPort: tc.redirect}); got != tc.want {
			t.Errorf("to %s: %v, want %v", tc.dst, got, tc.want)
		}
	}
	// The first sync's filter spares what is redirected to today's
	// listener: 10.96.0.10:53 to 45001, the NodePort to 45002.
	f.current = map[netip.AddrPort]map[uint16]bool{
		netip.MustParseAddrPort("10.96.0.10:53"):     {45001: true},
		netip.AddrPortFrom(netip.Addr{}, 30053):      {45002: true},
		netip.MustParseAddrPort("192.168.1.7:30053"): {45003: true}, // an externalIP on the NodePort's number
		netip.MustParseAddrPort("10.96.0.99:53"):     {45009: true},
	}
	for _, tc := range []struct {
		dst      string
		redirect uint16
		want     bool
	}{
		{"10.96.0.10:53", 45001, false},
		{"10.96.0.10:53", 45999, true}, // an old listener's
		{"10.96.0.10:53", 0, true},     // not redirected: came before the rules
		{"192.168.1.7:30053", 45002, false},
		{"192.168.1.7:30053", 45003, false},
		{"192.168.1.8:30053", 45003, true},
		{"10.96.0.10:53", 45009, true}, // another address's listener
	} {
		if got := f.match(kernel.UDPEntry{Dst: netip.MustParseAddrPort(tc.dst), ReplyPort: tc.redirect}); got != tc.want {
			t.Errorf("first sync: to %s redirected to %d: %v, want %v", tc.dst, tc.redirect, got, tc.want)
		}
	}
}

// In a network namespace of its own holding 300 TCP entries and five UDP
// ones, the cleanup deletes the three UDP entries its filter names (a
// ClusterIP's, one of it redirected to an old listener, a NodePort's),
// keeps another Service's, the one redirected to today's listener and
// every TCP entry, and the kernel hands it only the UDP entries (Linux 5.8 and later filter the
// dump by protocol); IPv6 entries the same, in their own family's dump.
func TestDeleteUDPConntrackInNamespace(t *testing.T) {
	testutil.RequireRoot(t, "it creates a network namespace")
	name := fmt.Sprintf("kupct%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	ns, err := netns.GetFromName(name)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_NETFILTER)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()

	flow := func(proto uint8, src, dst string) *netlink.ConntrackFlow {
		s, d := netip.MustParseAddrPort(src), netip.MustParseAddrPort(dst)
		fl := &netlink.ConntrackFlow{FamilyType: unix.AF_INET, TimeOut: 300}
		if d.Addr().Is6() {
			fl.FamilyType = unix.AF_INET6
		}
		fl.Forward = netlink.IPTuple{SrcIP: s.Addr().AsSlice(), DstIP: d.Addr().AsSlice(), SrcPort: s.Port(), DstPort: d.Port(), Protocol: proto}
		fl.Reverse = netlink.IPTuple{SrcIP: d.Addr().AsSlice(), DstIP: s.Addr().AsSlice(), SrcPort: d.Port(), DstPort: s.Port(), Protocol: proto}
		if proto == unix.IPPROTO_TCP {
			fl.ProtoInfo = &netlink.ProtoInfoTCP{State: nl.TCP_CONNTRACK_ESTABLISHED}
		}
		return fl
	}
	const tcpEntries = 300
	for i := 0; i < tcpEntries; i++ {
		if err := h.ConntrackCreate(
			netlink.ConntrackTable,
			unix.AF_INET,
			flow(unix.IPPROTO_TCP, fmt.Sprintf("10.1.%d.%d:40000", i/200, i%200+1), "10.96.0.10:53"),
		); err != nil {
			t.Fatalf("create TCP entry %d: %v", i, err)
		}
	}
	// redirected is an entry REDIRECTed to a listener: its replies come
	// from the node's listener port.
	redirected := func(src, dst string, listener uint16) *netlink.ConntrackFlow {
		fl := flow(unix.IPPROTO_UDP, src, dst)
		fl.Reverse.SrcIP, fl.Reverse.SrcPort = net.ParseIP("10.1.0.1"), listener
		return fl
	}
	for _, f := range []*netlink.ConntrackFlow{
		flow(unix.IPPROTO_UDP, "10.1.9.1:40053", "10.96.0.10:53"),     // a stale ClusterIP's
		flow(unix.IPPROTO_UDP, "10.1.9.2:40053", "192.168.7.7:30053"), // a stale NodePort's
		flow(unix.IPPROTO_UDP, "10.1.9.3:40053", "10.96.0.11:53"),     // another Service's
		redirected("10.1.9.4:40053", "10.96.0.10:53", 45001),          // to today's listener
		redirected("10.1.9.5:40053", "10.96.0.10:53", 45999),          // to an old one
	} {
		if err := h.ConntrackCreate(netlink.ConntrackTable, unix.AF_INET, f); err != nil {
			t.Fatalf("create UDP entry: %v", err)
		}
	}

	filter := &udpFilter{addrs: map[netip.AddrPort]bool{netip.MustParseAddrPort("10.96.0.10:53"): true}, ports: map[uint16]bool{30053: true},
		current: map[netip.AddrPort]map[uint16]bool{netip.MustParseAddrPort("10.96.0.10:53"): {45001: true}}}
	var deleted, read uint
	err = inNamespace(ns, func() (err error) {
		deleted, read, err = deleteUDPConntrack(4, filter)
		return err
	})
	if err != nil || deleted != 3 {
		t.Fatalf("deleted %d (%v), want 3", deleted, err)
	}
	left, err := h.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET)
	if err != nil {
		t.Fatal(err)
	}
	var tcp int
	var udp []string
	for _, f := range left {
		switch f.Forward.Protocol {
		case unix.IPPROTO_TCP:
			tcp++
		case unix.IPPROTO_UDP:
			udp = append(udp, fmt.Sprintf("%v:%d>%d", f.Forward.DstIP, f.Forward.DstPort, f.Reverse.SrcPort))
		}
	}
	slices.Sort(udp)
	if tcp != tcpEntries || !slices.Equal(udp, []string{"10.96.0.10:53>45001", "10.96.0.11:53>53"}) {
		t.Fatalf("left %d TCP entries and UDP %v, want %d and [10.96.0.10:53>45001 10.96.0.11:53>53]", tcp, udp, tcpEntries)
	}
	// IPv6: its own dump, its own addresses.
	for _, f := range []*netlink.ConntrackFlow{
		flow(unix.IPPROTO_UDP, "[fd00::1]:40053", "[fd00:96::10]:53"),
		flow(unix.IPPROTO_UDP, "[fd00::2]:40053", "[fd00:96::11]:53"),
	} {
		if err := h.ConntrackCreate(netlink.ConntrackTable, unix.AF_INET6, f); err != nil {
			t.Fatalf("create IPv6 UDP entry: %v", err)
		}
	}
	filter6 := &udpFilter{addrs: map[netip.AddrPort]bool{netip.MustParseAddrPort("[fd00:96::10]:53"): true}}
	err = inNamespace(ns, func() (err error) {
		deleted, _, err = deleteUDPConntrack(6, filter6)
		return err
	})
	left6, lerr := h.ConntrackTableList(netlink.ConntrackTable, unix.AF_INET6)
	if err != nil || lerr != nil || deleted != 1 || len(left6) != 1 || !left6[0].Forward.DstIP.Equal(net.ParseIP("fd00:96::11")) {
		t.Fatalf("IPv6: deleted %d (%v, %v), left %v, want fd00:96::11:53 left", deleted, err, lerr, left6)
	}

	var uts unix.Utsname
	_ = unix.Uname(&uts)
	var major, minor int
	_, _ = fmt.Sscanf(unix.ByteSliceToString(uts.Release[:]), "%d.%d", &major, &minor)
	if (major > 5 || major == 5 && minor >= 8) && read != 5 {
		t.Fatalf("the dump returned %d entries on Linux %d.%d, want the 5 UDP ones", read, major, minor)
	}
}

// inNamespace runs fn on a thread in network namespace ns. The thread stays
// locked to its goroutine and ends with it, never going back to the pool in
// the wrong namespace.
func inNamespace(ns netns.NsHandle, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		if err := unix.Setns(int(ns), unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("setns: %w", err)
			return
		}
		errc <- fn()
	}()
	return <-errc
}

// BenchmarkUDPConntrackCleanup is one cleanup (a dump of the UDP entries,
// the matches deleted) in a namespace whose table holds
// KUP_BENCH_CT_TCP TCP entries (default 100 000) and 100 stale UDP ones,
// created again before each run: the cost of a rule change's cleanup on a
// busy node. docs/benchmarks-history.md (2026-12-07) has its figures.
func BenchmarkUDPConntrackCleanup(b *testing.B) {
	testutil.RequireRoot(b, "it creates a network namespace")
	tcpEntries := 100000
	if v, err := strconv.Atoi(os.Getenv("KUP_BENCH_CT_TCP")); err == nil {
		tcpEntries = v
	}
	name := fmt.Sprintf("kupctb%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		b.Fatalf("ip netns add: %v: %s", err, out)
	}
	b.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	ns, err := netns.GetFromName(name)
	if err != nil {
		b.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_NETFILTER)
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close()
	create := func(proto uint8, src, dst netip.AddrPort) {
		fl := &netlink.ConntrackFlow{FamilyType: unix.AF_INET, TimeOut: 3000}
		fl.Forward = netlink.IPTuple{SrcIP: src.Addr().AsSlice(), DstIP: dst.Addr().AsSlice(), SrcPort: src.Port(), DstPort: dst.Port(), Protocol: proto}
		fl.Reverse = netlink.IPTuple{SrcIP: dst.Addr().AsSlice(), DstIP: src.Addr().AsSlice(), SrcPort: dst.Port(), DstPort: src.Port(), Protocol: proto}
		if proto == unix.IPPROTO_TCP {
			fl.ProtoInfo = &netlink.ProtoInfoTCP{State: nl.TCP_CONNTRACK_ESTABLISHED}
		}
		if err := h.ConntrackCreate(netlink.ConntrackTable, unix.AF_INET, fl); err != nil {
			b.Fatalf("create entry: %v", err)
		}
	}
	for i := 0; i < tcpEntries; i++ {
		create(
			unix.IPPROTO_TCP,
			netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}), uint16(1024+i%60000)),
			netip.MustParseAddrPort("10.96.0.10:80"),
		)
	}
	filter := &udpFilter{addrs: map[netip.AddrPort]bool{netip.MustParseAddrPort("10.96.0.10:53"): true}, ports: map[uint16]bool{}}
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		for i := 0; i < 100; i++ {
			create(unix.IPPROTO_UDP, netip.AddrPortFrom(netip.MustParseAddr("10.2.0.1"), uint16(40000+i)), netip.MustParseAddrPort("10.96.0.10:53"))
		}
		b.StartTimer()
		err := inNamespace(ns, func() error {
			deleted, _, err := deleteUDPConntrack(4, filter)
			if err == nil && deleted != 100 {
				err = fmt.Errorf("deleted %d entries, want 100", deleted)
			}
			return err
		})
		if err != nil {
			b.Fatal(err)
		}
	}
}
