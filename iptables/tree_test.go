package iptables

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strings"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// walk runs a packet for dst through chain and the chains it jumps to with
// the tracer explain uses; it returns the REDIRECT or DNAT rule that
// catches it ("" for none) and how many rules it was tested against.
func walk(t *testing.T, rs *Ruleset, chain string, dst netip.Addr, proto string, dport int) (string, int) {
	t.Helper()
	tr := tracer{in: TraceInput{Rules: rs}, p: Packet{Dst: dst, Protocol: proto, Port: dport}}
	var steps []Step
	v := tr.walk("nat", chain, false, &steps, 0)
	for _, s := range steps {
		if strings.HasPrefix(s.Note, "unsupported") || strings.HasPrefix(s.Note, "too deep") {
			t.Fatalf("%s: %s", s.Chain, s.Note)
		}
	}
	if v.Target != "REDIRECT" && v.Target != "DNAT" {
		return "", tr.walked
	}
	return steps[len(steps)-1].Rule, tr.walked
}

// frontendsAt returns ClusterIP frontends, one per address, each with port 80
// and a listener port of 20000+i.
func frontendsAt(addrs []netip.Addr) []config.Frontend {
	var out []config.Frontend
	for i, a := range addrs {
		sp := &config.ServicePort{
			Name:       config.ServicePortName{Namespace: "ns", Name: fmt.Sprintf("s%d", i), Port: "http"},
			Protocol:   config.TCP,
			Port:       80,
			ClusterIPs: []netip.Addr{a},
		}
		fam := 4
		if a.Is6() {
			fam = 6
		}
		out = append(out, config.Frontend{Service: sp, Kind: config.KindAll, Family: fam, Protocol: config.TCP,
			Listen: netip.AddrPortFrom(netip.IPv4Unspecified(), uint16(20000+i%40000))})
	}
	return out
}

// randomAddrs returns n distinct addresses drawn at random from prefix, as
// the API server allocates ClusterIPs.
func randomAddrs(r *rand.Rand, prefix string, n int) []netip.Addr {
	p := netip.MustParsePrefix(prefix)
	seen := map[netip.Addr]bool{}
	var out []netip.Addr
	for len(out) < n {
		b := p.Addr().As16()
		if p.Addr().Is4() {
			b4 := p.Addr().As4()
			v := uint32(b4[0])<<24 | uint32(b4[1])<<16 | uint32(b4[2])<<8 | uint32(b4[3])
			v |= r.Uint32() & (1<<(32-p.Bits()) - 1)
			a := netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
			if !seen[a] {
				seen[a] = true
				out = append(out, a)
			}
			continue
		}
		for i := p.Bits() / 8; i < 16; i++ {
			b[i] = byte(r.UintN(256))
		}
		a := netip.PrefixFrom(netip.AddrFrom16(b), 128).Addr()
		if p.Contains(a) && !seen[a] {
			seen[a] = true
			out = append(out, a)
		}
	}
	return out
}

// The point of the trees: at 10 000 service addresses a packet for none of
// them passes a handful of rules, and one for a service address a few dozen,
// in every chain layout the API server's allocation can produce.
func TestPortalTreeCostPerPacket(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct {
		name   string
		addrs  []netip.Addr
		family int
		miss   []string
	}{
		{"random in a /12", randomAddrs(r, "10.96.0.0/12", 10000), 4, []string{"10.244.1.5", "127.0.0.1", "192.168.50.1"}},
		{"dense /16", randomAddrs(r, "10.97.0.0/18", 10000), 4, []string{"10.96.0.1", "8.8.8.8"}},
		{"IPv6 /108", randomAddrs(r, "fd00:96::/108", 10000), 6, []string{"fd00:244::5", "::1"}},
		{"spread over the whole space", randomAddrs(r, "0.0.0.0/0", 10000), 4, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fes := frontendsAt(tc.addrs)
			o := all4
			o.Family = tc.family
			rs := Render(fes, o)
			biggest := 0
			for c, rules := range rs.Nat {
				biggest = max(biggest, len(rules))
				if len(c) > maxChainName {
					t.Fatalf("chain name %q is longer than iptables allows", c)
				}
			}
			if limit := 16 * inlineMax; biggest > limit {
				t.Errorf("a chain holds %d rules, more than %d", biggest, limit)
			}
			worst, total := 0, 0
			for i, a := range tc.addrs {
				got, tested := walk(t, rs, ChainPortalsContainer, a, "tcp", 80)
				if want := fmt.Sprintf("--to-ports %d", 20000+i); !strings.HasSuffix(got, want) {
					t.Fatalf("%s:80 caught by %q, want the rule ending %q", a, got, want)
				}
				if got, _ := walk(t, rs, ChainPortalsContainer, a, "tcp", 81); got != "" {
					t.Fatalf("%s:81 caught by %q", a, got)
				}
				worst, total = max(worst, tested), total+tested
			}
			t.Logf("%d chains; rules tested per service packet: mean %.1f, worst %d", len(rs.Nat), float64(total)/float64(len(tc.addrs)), worst)
			if worst > 100 {
				t.Errorf("a packet for a service address passed %d rules (10k services)", worst)
			}
			for _, m := range tc.miss {
				got, tested := walk(t, rs, ChainPortalsContainer, netip.MustParseAddr(m), "tcp", 80)
				if got != "" || tested > 2 {
					t.Errorf("a packet for %s (no service) passed %d rules and was caught by %q", m, tested, got)
				}
			}
		})
	}
}

// Few services: the entry chains hold the rules themselves, as before trees.
func TestPortalTreeFlatWhenSmall(t *testing.T) {
	addrs := randomAddrs(rand.New(rand.NewPCG(3, 4)), "10.96.0.0/12", leafMax)
	rs := Render(frontendsAt(addrs), all4)
	if len(rs.Nat) != 4 || len(rs.Nat[ChainPortalsContainer]) != leafMax {
		t.Fatalf("%d chains, %d rules in the entry chain; want 4 chains and %d rules", len(rs.Nat), len(rs.Nat[ChainPortalsContainer]), leafMax)
	}
}

// One Service added or removed beside 10 000 rewrites only the chains on its
// path, a few dozen rules, and the result equals a render from scratch.
func TestTreeChangeIsLocal(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	addrs := randomAddrs(r, "10.96.0.0/12", 10001)
	fes := frontendsAt(addrs)
	before := Render(fes[:10000], all4)
	after := Render(fes, all4)
	in := diffInput(before, after)
	if n := strings.Count(in, "\n-A "); n == 0 || n > 120 {
		t.Fatalf("adding one service rewrote %d rules:\n%s", n, in)
	}
	if !strings.Contains(in, addrs[10000].String()+"/32") {
		t.Fatalf("the new service's rule is not in the update:\n%s", in)
	}
	back := diffInput(after, before)
	if n := strings.Count(back, "\n-A "); n > 120 {
		t.Fatalf("removing one service rewrote %d rules", n)
	}
	if diffInput(after, Render(fes, all4)) != "" {
		t.Fatal("the same frontends rendered twice differ")
	}
	// A chain that empties is deleted after the chains that jumped to it.
	small := Render(fes[:leafMax], all4)
	in = diffInput(after, small)
	if !strings.Contains(in, "\n-X "+chainPortalTree) || strings.Index(in, "\n-X ") < strings.LastIndex(in, "\n-A ") {
		t.Fatalf("shrinking to %d services: tree chains not deleted last:\n%.2000s", leafMax, in)
	}
}

// NodePorts (with --nodeport-addresses) are a tree by port, per protocol: a
// connection to a local port that is no NodePort passes one rule per protocol.
func TestNodePortTree(t *testing.T) {
	var fes []config.Frontend
	for i := 0; i < 2000; i++ {
		proto := config.TCP
		if i%4 == 0 {
			proto = config.UDP
		}
		sp := &config.ServicePort{
			Name:       config.ServicePortName{Namespace: "ns", Name: fmt.Sprintf("s%d", i)},
			Protocol:   proto,
			Port:       80,
			NodePort:   30000 + i,
			ClusterIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 96, byte(i / 250), byte(i%250 + 1)})},
		}
		fes = append(fes, config.Frontend{Service: sp, Kind: config.KindAll, Family: 4, Protocol: proto,
			Listen: netip.AddrPortFrom(netip.IPv4Unspecified(), uint16(45000+i))})
	}
	node := netip.MustParseAddr("192.168.50.1")
	o := RenderOptions{Family: 4, Features: Features{}, NodePortAddresses: []netip.Addr{node}}
	rs := Render(fes, o)
	for i, fe := range fes {
		proto := strings.ToLower(string(fe.Protocol))
		got, tested := walk(t, rs, ChainNodePortContainer, node, proto, 30000+i)
		if !strings.HasSuffix(got, fmt.Sprintf("--to-ports %d", 45000+i)) || tested > 60 {
			t.Fatalf("%s NodePort %d: caught by %q after %d rules", proto, 30000+i, got, tested)
		}
	}
	for _, port := range []int{22, 8080, 10250, 45001} {
		if got, tested := walk(t, rs, ChainNodePortContainer, node, "tcp", port); got != "" || tested > 2 {
			t.Errorf("tcp port %d (no NodePort) passed %d rules, caught by %q", port, tested, got)
		}
	}
	if got, _ := walk(t, rs, ChainNodePortContainer, netip.MustParseAddr("10.0.0.1"), "tcp", 30001); got != "" {
		t.Errorf("a NodePort on an address outside --nodeport-addresses was caught by %q", got)
	}
}

// Tree chain names stay within iptables' limit and are unique per prefix,
// also for long IPv6 prefixes.
func TestTreeChainNames(t *testing.T) {
	s := portalTree(6)
	a := addrKey(netip.MustParseAddr("fd00:96::1:0"))
	b := addrKey(netip.MustParseAddr("fd00:96::2:0"))
	for _, plen := range []int{0, 48, 80, 84, 108, 124} {
		n := s.chainName(a, plen)
		if len(n) > maxChainName || !isOurs("nat", n) {
			t.Fatalf("/%d: %q", plen, n)
		}
	}
	if s.chainName(a, 112) == s.chainName(b, 112) || s.chainName(a, 108) != s.chainName(b, 108) {
		t.Fatal("names do not follow the prefix")
	}
	if got := portalTree(4).chainName(addrKey(netip.MustParseAddr("10.96.0.0")), 16); got != "KUBE-PT-0A60" {
		t.Fatalf("IPv4 /16 chain %q", got)
	}
	if got := nodePortTree("tcp").match(portKey(30001), 4); got != "-p tcp -m tcp --dport 28672:32767" {
		t.Fatalf("NodePort prefix match %q", got)
	}
}

// A listener on its NodePort inside the proxy port range is let through the
// guard ahead of the drops.
func TestGuardLetsNodePortListenersThrough(t *testing.T) {
	fes := proxy.Plan(devpaasy(t), netip.IPv4Unspecified(), false)
	o := all4
	o.ProxyPorts = config.PortRange{Base: 30000, Size: 5000}
	g := Render(fes, o).Filter[ChainGuard]
	want := []string{
		"-p tcp -m tcp --dport 31341 -j RETURN",
		"! -i lo -p tcp -m tcp --dport 30000:34999 -m conntrack ! --ctstate DNAT -j DROP",
		"! -i lo -p udp -m udp --dport 30000:34999 -m conntrack ! --ctstate DNAT -j DROP",
	}
	if strings.Join(g, "\n") != strings.Join(want, "\n") {
		t.Fatalf("guard:\n%s\nwant\n%s", strings.Join(g, "\n"), strings.Join(want, "\n"))
	}
}

func TestIsOurs(t *testing.T) {
	for _, c := range []string{"KUBE-PORTALS-CONTAINER", "KUBE-PT-0A60", "KUBE-NP-TCP-7", "KUBE-PORTALS-HOST-1F", "KUBE-PORTALS-PROBE"} {
		if !isOurs("nat", c) {
			t.Errorf("nat %s not recognised", c)
		}
	}
	for _, c := range []string{"KUBE-SERVICES", "KUBE-PORTALS-CONTAINER-XYZ", "KUBE-SVC-00", "DOCKER"} {
		if isOurs("nat", c) {
			t.Errorf("nat %s taken for ours", c)
		}
	}
	if !isOurs("filter", "KUBE-PORTALS-GUARD-0A") || isOurs("filter", "KUBE-PT-0A60") {
		t.Error("filter chains misjudged")
	}
}
