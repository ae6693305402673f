package iptables

import (
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

func devpaasy(t *testing.T) *config.State {
	t.Helper()
	st, _, err := config.LoadManifests("../docs/examples/devpaasy.yaml", "node-1")
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func withPorts(fes []config.Frontend, port uint16) []config.Frontend {
	for i := range fes {
		fes[i].Listen = netip.AddrPortFrom(fes[i].Listen.Addr(), port)
	}
	return fes
}

var allFeatures = Features{Comment: true, Addrtype: true, Conntrack: true}

// all4 are the options of an IPv4 node with every optional match.
var all4 = RenderOptions{Family: 4, Features: allFeatures, AllLocal: true, ProxyPorts: config.DefaultPortRange}

func TestRenderDevpaasy(t *testing.T) {
	fes := withPorts(proxy.Plan(devpaasy(t), netip.IPv4Unspecified(), true), 40000)
	rs := Render(fes, all4)
	want := map[string][]string{
		ChainPortalsContainer:  {`-d 10.0.0.41/32 -p tcp -m comment --comment "dev/devpaasy:http" -m tcp --dport 8080 -j REDIRECT --to-ports 40000`},
		ChainPortalsHost:       {`-d 10.0.0.41/32 -p tcp -m comment --comment "dev/devpaasy:http" -m tcp --dport 8080 -j REDIRECT --to-ports 40000`},
		ChainNodePortContainer: {`-p tcp -m comment --comment "dev/devpaasy:http" -m tcp --dport 31341 -j REDIRECT --to-ports 40000`},
		ChainNodePortHost:      {`-p tcp -m comment --comment "dev/devpaasy:http" -m tcp --dport 31341 -j REDIRECT --to-ports 40000`},
	}
	if !reflect.DeepEqual(rs.Nat, want) {
		t.Fatalf("nat rules:\n%v\nwant\n%v", rs.Nat, want)
	}
	if g := rs.Filter[ChainGuard]; len(g) != 2 || g[0] != "! -i lo -p tcp -m tcp --dport 45000:59999 -m conntrack ! --ctstate DNAT -j DROP" ||
		g[1] != "! -i lo -p udp -m udp --dport 45000:59999 -m conntrack ! --ctstate DNAT -j DROP" {
		t.Fatalf("guard %v", g)
	}
	if rs6 := Render(fes, RenderOptions{Family: 6, Features: allFeatures, AllLocal: true}); len(rs6.Nat[ChainPortalsContainer]) != 0 {
		t.Fatalf("IPv4 service produced IPv6 rules: %v", rs6.Nat)
	}
}

// Without optional matches the rules use only -p/--dport/-d and REDIRECT.
func TestRenderBasicNetfilterOnly(t *testing.T) {
	fes := withPorts(proxy.Plan(devpaasy(t), netip.IPv4Unspecified(), true), 40000)
	addrs := []netip.Addr{netip.MustParseAddr("192.168.50.1"), netip.MustParseAddr("127.0.0.1")}
	rs := Render(fes, RenderOptions{Family: 4, NodePortAddresses: addrs})
	in := rs.RestoreInput()
	for _, forbidden := range []string{"comment", "addrtype", "conntrack", "-m state", "mark"} {
		if strings.Contains(in, forbidden) {
			t.Errorf("basic ruleset uses %q:\n%s", forbidden, in)
		}
	}
	// The filter table holds only the (here empty) source-range drops.
	if len(rs.Filter) != 1 || len(rs.Filter[ChainSourceRanges]) != 0 {
		t.Errorf("basic filter chains: %v", rs.Filter)
	}
	if got := rs.Nat[ChainNodePortContainer]; len(got) != 2 || !strings.HasPrefix(got[0], "-d 127.0.0.1/32 -p tcp -m tcp --dport 31341") {
		t.Fatalf("NodePort rules per address: %v", got)
	}
}

func TestRenderSpecificBindAddressUsesDNAT(t *testing.T) {
	fes := withPorts(proxy.Plan(devpaasy(t), netip.MustParseAddr("10.251.19.1"), true), 40000)
	rs := Render(fes, all4)
	if r := rs.Nat[ChainPortalsHost][0]; !strings.HasSuffix(r, "-j DNAT --to-destination 10.251.19.1:40000") {
		t.Fatalf("rule %q", r)
	}
}

func TestRenderTrafficPolicySplit(t *testing.T) {
	st := devpaasy(t)
	for _, sp := range st.Ports {
		sp.ExternalLocal = true
		sp.ExternalIPs = []netip.Addr{netip.MustParseAddr("203.0.113.10")}
		sp.ClusterIPs = append(sp.ClusterIPs, netip.MustParseAddr("fd00::41"))
	}
	fes := proxy.Plan(st, netip.IPv4Unspecified(), true)
	for i := range fes {
		fes[i].Listen = netip.AddrPortFrom(fes[i].Listen.Addr(), uint16(40000+i))
	}
	if len(fes) != 4 { // internal+external × IPv4+IPv6
		t.Fatalf("frontends %d, want 4", len(fes))
	}
	rs := Render(fes, all4)
	var internalPort string
	for _, fe := range fes {
		if fe.Family == 4 && fe.Kind == config.KindInternal {
			internalPort = fmt.Sprint(fe.Listen.Port())
		}
	}
	for _, r := range rs.Nat[ChainPortalsContainer] {
		isCluster := strings.HasPrefix(r, "-d 10.0.0.41/32")
		toInternal := strings.HasSuffix(r, "--to-ports "+internalPort)
		if isCluster != toInternal {
			t.Errorf("rule %q goes to the wrong frontend", r)
		}
	}
	rs6 := Render(fes, RenderOptions{Family: 6, Features: allFeatures, AllLocal: true})
	if r := rs6.Nat[ChainPortalsContainer]; len(r) != 1 || !strings.HasPrefix(r[0], "-d fd00::41/128 -p tcp") {
		t.Fatalf("IPv6 rules %v", r)
	}
}

func TestRenderSkipsFailedFrontendsAndHeldNodePorts(t *testing.T) {
	fes := withPorts(proxy.Plan(devpaasy(t), netip.IPv4Unspecified(), true), 40000)
	fes[0].NodePortErr = errTest
	rs := Render(fes, all4)
	if len(rs.Nat[ChainNodePortContainer]) != 0 || len(rs.Nat[ChainPortalsContainer]) != 1 || len(rs.Filter[ChainGuard]) != 2 {
		t.Fatalf("NodePort held by another process still redirected: %v", rs.Nat)
	}
	fes[0].Err = errTest
	rs = Render(fes, all4)
	if n, f := rs.Count(); n != 0 || f != 2 {
		t.Fatalf("a frontend without listener got rules: %v", rs.Nat)
	}
}

type testErr struct{}

func (testErr) Error() string { return "test" }

var errTest = testErr{}

func TestSplitRule(t *testing.T) {
	got := splitRule(`-A PREROUTING -m comment --comment "handle ClusterIPs; NOTE: x" -j KUBE-PORTALS-CONTAINER`)
	want := []string{"-A", "PREROUTING", "-m", "comment", "--comment", "handle ClusterIPs; NOTE: x", "-j", "KUBE-PORTALS-CONTAINER"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("%q", got)
	}
	if target(got) != "KUBE-PORTALS-CONTAINER" {
		t.Fatal(target(got))
	}
}

// A listener on its NodePort needs no NodePort rule and no guard.
func TestRenderListenerOnNodePort(t *testing.T) {
	fes := proxy.Plan(devpaasy(t), netip.IPv4Unspecified(), false)
	if fes[0].Listen.Port() != 31341 {
		t.Fatalf("planned listener on %s, want the NodePort", fes[0].Listen)
	}
	rs := Render(fes, all4)
	if len(rs.Nat[ChainNodePortContainer])+len(rs.Nat[ChainNodePortHost]) != 0 || len(rs.Filter[ChainGuard]) != 2 {
		t.Fatalf("rules for a listener on its NodePort: %v %v", rs.Nat, rs.Filter)
	}
	if r := rs.Nat[ChainPortalsContainer]; len(r) != 1 || !strings.HasSuffix(r[0], "-j REDIRECT --to-ports 31341") {
		t.Fatalf("ClusterIP rule %v", r)
	}
}

// manyFrontends returns n ClusterIP frontends of distinct services.
func manyFrontends(n int) []config.Frontend {
	var out []config.Frontend
	for i := 0; i < n; i++ {
		sp := &config.ServicePort{
			Name:       config.ServicePortName{Namespace: "ns", Name: fmt.Sprintf("s%d", i)},
			Protocol:   config.TCP,
			Port:       80,
			ClusterIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 96, byte(i / 250), byte(i%250 + 1)})},
		}
		out = append(out, config.Frontend{Service: sp, Kind: config.KindAll, Family: 4, Protocol: config.TCP,
			Listen: netip.AddrPortFrom(netip.IPv4Unspecified(), uint16(20000+i))})
	}
	return out
}

func TestDeleteChainsInput(t *testing.T) {
	got := deleteChainsInput(map[string][]string{"nat": {"A", "B"}, "filter": {"C"}})
	want := "*nat\n:A - [0:0]\n:B - [0:0]\n-X A\n-X B\nCOMMIT\n*filter\n:C - [0:0]\n-X C\nCOMMIT\n"
	if got != want {
		t.Fatalf("got\n%s\nwant\n%s", got, want)
	}
}

// loadBalancerSourceRanges: the LoadBalancer IP is redirected only for
// clients inside the ranges of its family, and a DROP in the filter table
// catches the rest; the ClusterIP, the NodePort and externalIPs are left
// alone.
func TestRenderSourceRanges(t *testing.T) {
	sp := &config.ServicePort{
		Name: config.ServicePortName{Namespace: "ns", Name: "lb"}, Protocol: config.TCP, Port: 80, NodePort: 30080,
		ClusterIPs:      []netip.Addr{netip.MustParseAddr("10.96.0.5")},
		ExternalIPs:     []netip.Addr{netip.MustParseAddr("203.0.113.9")},
		LoadBalancerIPs: []netip.Addr{netip.MustParseAddr("203.0.113.10"), netip.MustParseAddr("2001:db8::10")},
		SourceRanges: []netip.Prefix{
			netip.MustParsePrefix("10.244.1.0/24"),
			netip.MustParsePrefix("192.0.2.0/28"),
			netip.MustParsePrefix("2001:db8:1::/48"),
		},
	}
	fe := config.Frontend{Service: sp, Kind: config.KindAll, Family: 4, Protocol: config.TCP, Listen: netip.MustParseAddrPort("0.0.0.0:45001")}
	rs := Render([]config.Frontend{fe}, all4)
	want := []string{
		`-d 10.96.0.5/32 -p tcp -m comment --comment "ns/lb" -m tcp --dport 80 -j REDIRECT --to-ports 45001`,
		`-d 203.0.113.9/32 -p tcp -m comment --comment "ns/lb" -m tcp --dport 80 -j REDIRECT --to-ports 45001`,
		`-s 10.244.1.0/24 -d 203.0.113.10/32 -p tcp -m comment --comment "ns/lb" -m tcp --dport 80 -j REDIRECT --to-ports 45001`,
		`-s 192.0.2.0/28 -d 203.0.113.10/32 -p tcp -m comment --comment "ns/lb" -m tcp --dport 80 -j REDIRECT --to-ports 45001`,
	}
	if got := rs.Nat[ChainPortalsContainer]; !reflect.DeepEqual(got, want) {
		t.Fatalf("portals:\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if got := rs.Filter[ChainSourceRanges]; len(got) != 1 || got[0] != `-d 203.0.113.10/32 -p tcp -m comment --comment "ns/lb" -m tcp --dport 80 -j DROP` {
		t.Fatalf("drops: %v", got)
	}
	fe6 := fe
	fe6.Family, fe6.Listen = 6, netip.MustParseAddrPort("[::]:45001")
	sp6 := *sp
	sp6.SourceRanges = sp.SourceRanges[:1] // no IPv6 range: no IPv6 client is let in
	fe6.Service = &sp6
	o6 := all4
	o6.Family = 6
	rs6 := Render([]config.Frontend{fe6}, o6)
	if got := rs6.Nat[ChainPortalsContainer]; len(got) != 0 {
		t.Fatalf("IPv6 portals without an IPv6 range: %v", got)
	}
	if got := rs6.Filter[ChainSourceRanges]; len(got) != 1 || !strings.HasPrefix(got[0], "-d 2001:db8::10/128 ") {
		t.Fatalf("IPv6 drops: %v", got)
	}

	// The tracer agrees: inside, redirected; outside, dropped in FORWARD.
	in := TraceInput{Rules: rs, Features: allFeatures}
	res := Trace(in, Packet{Src: netip.MustParseAddr("10.244.1.7"), Dst: netip.MustParseAddr("203.0.113.10"), Port: 80, Protocol: "tcp"})
	if res.NAT.Target != "REDIRECT" || res.Filter.Target != "" {
		t.Fatalf("inside the range: %+v %+v", res.NAT, res.Filter)
	}
	res = Trace(in, Packet{Src: netip.MustParseAddr("192.168.100.2"), Dst: netip.MustParseAddr("203.0.113.10"), Port: 80, Protocol: "tcp"})
	if res.NAT.Target != "" || res.Filter.Target != "DROP" || res.FilterHook != "FORWARD" {
		t.Fatalf("outside the range: %+v %+v", res.NAT, res)
	}
	res = Trace(in, Packet{Src: netip.MustParseAddr("192.168.100.2"), Dst: netip.MustParseAddr("10.96.0.5"), Port: 80, Protocol: "tcp"})
	if res.NAT.Target != "REDIRECT" || res.Filter.Target != "" {
		t.Fatalf("the ClusterIP from outside the range: %+v %+v", res.NAT, res.Filter)
	}
}
