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

func withPorts(fes []proxy.Frontend, port uint16) []proxy.Frontend {
	for i := range fes {
		fes[i].Listen = netip.AddrPortFrom(fes[i].Listen.Addr(), port)
	}
	return fes
}

var allFeatures = Features{Comment: true, Addrtype: true, Conntrack: true}

func TestRenderDevpaasy(t *testing.T) {
	fes := withPorts(proxy.Plan(devpaasy(t), netip.IPv4Unspecified(), true), 40000)
	rs := Render(fes, RenderOptions{Family: 4, Features: allFeatures, AllLocal: true})
	want := map[string][]string{
		ChainPortalsContainer:  {`-d 10.0.0.41/32 -p tcp -m comment --comment "dev/devpaasy:http" -m tcp --dport 8080 -j REDIRECT --to-ports 40000`},
		ChainPortalsHost:       {`-d 10.0.0.41/32 -p tcp -m comment --comment "dev/devpaasy:http" -m tcp --dport 8080 -j REDIRECT --to-ports 40000`},
		ChainNodePortContainer: {`-p tcp -m comment --comment "dev/devpaasy:http" -m tcp --dport 31341 -j REDIRECT --to-ports 40000`},
		ChainNodePortHost:      {`-p tcp -m comment --comment "dev/devpaasy:http" -m tcp --dport 31341 -j REDIRECT --to-ports 40000`},
	}
	if !reflect.DeepEqual(rs.Nat, want) {
		t.Fatalf("nat rules:\n%v\nwant\n%v", rs.Nat, want)
	}
	if g := rs.Filter[ChainGuard]; len(g) != 1 || g[0] != "! -i lo -p tcp -m tcp --dport 40000 -m conntrack ! --ctstate DNAT -j DROP" {
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
	for _, forbidden := range []string{"comment", "addrtype", "conntrack", "*filter"} {
		if strings.Contains(in, forbidden) {
			t.Errorf("basic ruleset uses %q:\n%s", forbidden, in)
		}
	}
	if got := rs.Nat[ChainNodePortContainer]; len(got) != 2 || !strings.HasPrefix(got[0], "-d 127.0.0.1/32 -p tcp -m tcp --dport 31341") {
		t.Fatalf("NodePort rules per address: %v", got)
	}
}

func TestRenderSpecificBindAddressUsesDNAT(t *testing.T) {
	fes := withPorts(proxy.Plan(devpaasy(t), netip.MustParseAddr("10.251.19.1"), true), 40000)
	rs := Render(fes, RenderOptions{Family: 4, Features: allFeatures, AllLocal: true})
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
	rs := Render(fes, RenderOptions{Family: 4, Features: allFeatures, AllLocal: true})
	var internalPort string
	for _, fe := range fes {
		if fe.Family == 4 && fe.Kind == proxy.KindInternal {
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
	rs := Render(fes, RenderOptions{Family: 4, Features: allFeatures, AllLocal: true})
	if len(rs.Nat[ChainNodePortContainer]) != 0 || len(rs.Nat[ChainPortalsContainer]) != 1 {
		t.Fatalf("NodePort held by another process still redirected: %v", rs.Nat)
	}
	fes[0].Err = errTest
	rs = Render(fes, RenderOptions{Family: 4, Features: allFeatures, AllLocal: true})
	if n, f := rs.Count(); n+f != 0 {
		t.Fatalf("a frontend without listener got rules: %v", rs.Nat)
	}
}

type testErr struct{}

func (testErr) Error() string { return "test" }

var errTest = testErr{}

func TestPartialInput(t *testing.T) {
	a := chainRule{"nat", ChainPortalsContainer, "rule-a"}
	b := chainRule{"nat", ChainPortalsContainer, "rule-b"}
	c := chainRule{"nat", ChainPortalsContainer, "rule-c"}
	g := chainRule{"filter", ChainGuard, "guard"}
	got := partialInput([]chainRule{a, b}, []chainRule{b, c, g})
	want := "*nat\n-D KUBE-PORTALS-CONTAINER rule-a\n-A KUBE-PORTALS-CONTAINER rule-c\nCOMMIT\n" +
		"*filter\n-A KUBE-PORTALS-GUARD guard\nCOMMIT\n"
	if got != want {
		t.Fatalf("got\n%s\nwant\n%s", got, want)
	}
	if partialInput(nil, nil) != "" {
		t.Fatal("no change produced input")
	}
}

// Only the frontends that changed are rendered into a partial update.
func TestPartialTouchesOnlyChangedFrontends(t *testing.T) {
	st := devpaasy(t)
	sp := st.Ports[config.ServicePortName{Namespace: "dev", Name: "devpaasy", Port: "http"}]
	other := *sp
	other.Name.Name, other.ClusterIPs = "other", []netip.Addr{netip.MustParseAddr("10.0.0.42")}
	st.Ports[other.Name] = &other
	fes := withPorts(proxy.Plan(st, netip.IPv4Unspecified(), true), 40000)
	opts := RenderOptions{Family: 4, Features: allFeatures, AllLocal: true}
	f := &family{fam: 4, features: allFeatures, installed: map[feKey]*feRules{}}
	changes, in, _ := f.partial(fes, opts)
	if strings.Count(in, "-A ") != 10 { // 2 services × (2 portal + 2 NodePort + 1 guard)
		t.Fatalf("first partial:\n%s", in)
	}
	f.apply(changes)
	if f.nat != 8 || f.filter != 2 {
		t.Fatalf("counted nat %d, filter %d rules; want 8 and 2", f.nat, f.filter)
	}
	if _, in, _ := f.partial(fes, opts); in != "" {
		t.Fatalf("unchanged frontends produced:\n%s", in)
	}
	moved := append([]proxy.Frontend(nil), fes...)
	for i := range moved {
		if moved[i].Service.Name.Name == "other" {
			c := *moved[i].Service
			c.Port = 9090
			moved[i].Service = &c
		}
	}
	_, in, _ = f.partial(moved, opts)
	if strings.Contains(in, "dev/devpaasy") || strings.Count(in, "-D ") != 2 || strings.Count(in, "-A ") != 2 {
		t.Fatalf("a port change of one service touched:\n%s", in)
	}
	_, in, _ = f.partial(moved[:1], opts)
	if strings.Count(in, "-D ") != 5 || strings.Count(in, "-A ") != 0 {
		t.Fatalf("removing a service:\n%s", in)
	}
	// Nothing above was applied: the removal is still computed against the
	// first state, and applying it leaves one service's rules.
	changes, in, _ = f.partial(fes[:1], opts)
	if strings.Count(in, "-D ") != 5 || strings.Count(in, "-A ") != 0 {
		t.Fatalf("removing a service after unapplied partials:\n%s", in)
	}
	f.apply(changes)
	if nat, filter := f.counts(); len(f.installed) != 1 || f.nat != nat || f.filter != filter || nat != 4 || filter != 1 {
		t.Fatalf("after the removal: %d frontends, counted nat %d filter %d, recount nat %d filter %d", len(f.installed), f.nat, f.filter, nat, filter)
	}
}

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
	rs := Render(fes, RenderOptions{Family: 4, Features: allFeatures, AllLocal: true})
	if len(rs.Nat[ChainNodePortContainer])+len(rs.Nat[ChainNodePortHost])+len(rs.Filter[ChainGuard]) != 0 {
		t.Fatalf("rules for a listener on its NodePort: %v %v", rs.Nat, rs.Filter)
	}
	if r := rs.Nat[ChainPortalsContainer]; len(r) != 1 || !strings.HasSuffix(r[0], "-j REDIRECT --to-ports 31341") {
		t.Fatalf("ClusterIP rule %v", r)
	}
}

// manyFrontends returns n ClusterIP frontends of distinct services.
func manyFrontends(n int) []proxy.Frontend {
	var out []proxy.Frontend
	for i := 0; i < n; i++ {
		sp := &config.ServicePort{
			Name:       config.ServicePortName{Namespace: "ns", Name: fmt.Sprintf("s%d", i)},
			Protocol:   config.TCP,
			Port:       80,
			ClusterIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 96, byte(i / 250), byte(i%250 + 1)})},
		}
		out = append(out, proxy.Frontend{Service: sp, Kind: proxy.KindAll, Family: 4, Protocol: config.TCP,
			Listen: netip.AddrPortFrom(netip.IPv4Unspecified(), uint16(20000+i))})
	}
	return out
}

func TestShardedLayout(t *testing.T) {
	fes := manyFrontends(2000)
	o := RenderOptions{Family: 4, Features: allFeatures, AllLocal: true, Shards: ShardsFor(len(fes))}
	if o.Shards != ShardCount || ShardsFor(shardAbove-1) != 0 {
		t.Fatalf("ShardsFor(%d) = %d, ShardsFor(%d) = %d", len(fes), o.Shards, shardAbove-1, ShardsFor(shardAbove-1))
	}
	rs := Render(fes, o)
	for _, top := range []string{ChainPortalsContainer, ChainPortalsHost, ChainNodePortContainer, ChainNodePortHost} {
		if got := rs.Nat[top]; len(got) != ShardCount || got[0] != "-j "+top+"-00" || got[ShardCount-1] != "-j "+top+"-1F" {
			t.Fatalf("%s holds %v, want one jump per shard", top, got)
		}
	}
	if got := rs.Filter[ChainGuard]; len(got) != ShardCount {
		t.Fatalf("guard holds %d rules, want %d jumps", len(got), ShardCount)
	}
	// Every frontend's rules sit in one shard, the same for every chain, and
	// the shards share the load.
	total, biggest := 0, 0
	for i := 0; i < ShardCount; i++ {
		c := ShardName(ChainPortalsContainer, i)
		n := len(rs.Nat[c])
		total += n
		biggest = max(biggest, n)
		if len(rs.Nat[ShardName(ChainPortalsHost, i)]) != n || len(rs.Filter[ShardName(ChainGuard, i)]) != n {
			t.Fatalf("shard %02X: container %d, host %d, guard %d rules", i, n, len(rs.Nat[ShardName(ChainPortalsHost, i)]), len(rs.Filter[ShardName(ChainGuard, i)]))
		}
	}
	if total != len(fes) || biggest > 2*len(fes)/ShardCount {
		t.Fatalf("%d rules in container shards (want %d), biggest shard %d", total, len(fes), biggest)
	}
	for _, r := range renderFrontend(fes[7], o) {
		if !isShard(r.chain) {
			t.Fatalf("rule in %s, not in a shard", r.chain)
		}
	}
	// The restore input declares every shard, and the shard names are ours.
	in := rs.RestoreInput()
	for table, chains := range shardChains(allFeatures) {
		for _, c := range chains {
			if !strings.Contains(in, ":"+c+" - [0:0]\n") || !isShard(c) {
				t.Fatalf("%s %s not declared or not recognised as ours", table, c)
			}
		}
	}
	if isShard("KUBE-PORTALS-CONTAINER") || isShard("KUBE-PORTALS-CONTAINER-XYZ") || isShard("KUBE-SVC-00") {
		t.Fatal("isShard accepts a chain that is not a shard")
	}
}

func TestDeleteChainsInput(t *testing.T) {
	got := deleteChainsInput(map[string][]string{"nat": {"A", "B"}, "filter": {"C"}})
	want := "*nat\n:A - [0:0]\n:B - [0:0]\n-X A\n-X B\nCOMMIT\n*filter\n:C - [0:0]\n-X C\nCOMMIT\n"
	if got != want {
		t.Fatalf("got\n%s\nwant\n%s", got, want)
	}
}
