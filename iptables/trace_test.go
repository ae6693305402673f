package iptables

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// The devpaasy Service (ClusterIP 10.0.0.41:8080, NodePort 31341), its
// listener on port 40000, traced the ways a packet can come.
func TestTraceDevpaasy(t *testing.T) {
	fes := withPorts(proxy.Plan(devpaasy(t), netip.IPv4Unspecified(), true), 40000)
	nodeAddrs := []netip.Addr{netip.MustParseAddr("192.168.50.1"), netip.MustParseAddr("127.0.0.1")}
	restricted := RenderOptions{Family: 4, Features: allFeatures, NodePortAddresses: nodeAddrs, ProxyPorts: config.DefaultPortRange}
	in := TraceInput{Rules: Render(fes, restricted), Features: allFeatures}
	pod, ext, node := netip.MustParseAddr("10.251.19.20"), netip.MustParseAddr("192.168.50.2"), netip.MustParseAddr("192.168.50.1")
	for _, tc := range []struct {
		name       string
		p          Packet
		hook       string
		target     string
		chain      string // the chain of the catching rule
		filter     string
		guardSteps bool
	}{
		{"ClusterIP from a pod", Packet{Src: pod, Dst: netip.MustParseAddr("10.0.0.41"), Port: 8080, Protocol: "tcp"},
			"PREROUTING", "REDIRECT", ChainPortalsContainer, "", true},
		{"ClusterIP from the node", Packet{Src: node, Dst: netip.MustParseAddr("10.0.0.41"), Port: 8080, Protocol: "tcp", FromNode: true},
			"OUTPUT", "REDIRECT", ChainPortalsHost, "", true},
		{"NodePort from outside", Packet{Src: ext, Dst: node, Port: 31341, Protocol: "tcp", DstLocal: true},
			"PREROUTING", "REDIRECT", ChainNodePortContainer, "", true},
		{"NodePort over UDP: no such Service", Packet{Src: ext, Dst: node, Port: 31341, Protocol: "udp", DstLocal: true},
			"PREROUTING", "", "", "", true},
		{"the ClusterIP's other port", Packet{Src: pod, Dst: netip.MustParseAddr("10.0.0.41"), Port: 8081, Protocol: "tcp"},
			"PREROUTING", "", "", "", true},
		{"a proxy port reached directly from outside", Packet{Src: ext, Dst: node, Port: 45123, Protocol: "tcp", DstLocal: true},
			"PREROUTING", "", "", "DROP", true},
		{"a proxy port from the node itself", Packet{Src: node, Dst: node, Port: 45123, Protocol: "tcp", DstLocal: true, FromNode: true},
			"OUTPUT", "", "", "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := Trace(in, tc.p)
			if res.Hook != tc.hook || res.NAT.Target != tc.target || res.Filter.Target != tc.filter {
				t.Fatalf("hook %s, nat %+v, filter %+v; want %s, %q, %q\n%+v", res.Hook, res.NAT, res.Filter, tc.hook, tc.target, tc.filter, res)
			}
			if tc.target != "" {
				last := res.Nat[len(res.Nat)-1]
				if last.Chain != tc.chain || res.NAT.ToPort != "40000" || !strings.HasSuffix(last.Rule, "--to-ports 40000") {
					t.Fatalf("caught in %s by %q to port %s; want %s to 40000", last.Chain, last.Rule, res.NAT.ToPort, tc.chain)
				}
			}
			if (len(res.Guard) > 0) != tc.guardSteps {
				t.Fatalf("guard steps %+v", res.Guard)
			}
			if res.Walked == 0 {
				t.Fatal("no rule walked")
			}
		})
	}
}

// A rule with a match the tracer does not know is reported, never guessed.
func TestTraceUnsupportedMatch(t *testing.T) {
	rs := &Ruleset{Nat: map[string][]string{
		ChainPortalsContainer: {"-d 10.0.0.1/32 -p tcp -m recent --rcheck -j REDIRECT --to-ports 1", "-d 10.0.0.1/32 -p tcp -j REDIRECT --to-ports 2"},
	}, Filter: map[string][]string{}}
	res := Trace(TraceInput{Rules: rs}, Packet{Dst: netip.MustParseAddr("10.0.0.1"), Port: 80, Protocol: "tcp"})
	if res.NAT.ToPort != "2" || !strings.Contains(res.Nat[1].Note, "unsupported match --rcheck") {
		t.Fatalf("%+v", res)
	}
}

func TestTraceDNATAndCounters(t *testing.T) {
	fes := withPorts(proxy.Plan(devpaasy(t), netip.MustParseAddr("192.168.50.1"), true), 40000)
	rs := Render(fes, RenderOptions{Family: 4, Features: allFeatures, AllLocal: true, ProxyPorts: config.DefaultPortRange})
	counters := map[string]Counter{}
	save := "*nat\n:KUBE-PORTALS-CONTAINER - [0:0]\n[7:420] -A KUBE-PORTALS-CONTAINER " + rs.Nat[ChainPortalsContainer][0] +
		"\n[1:60] -A PREROUTING -j OTHER\nCOMMIT\n"
	parseCounters("nat", save, counters)
	if len(counters) != 1 {
		t.Fatalf("counters %v: want only our rule", counters)
	}
	res := Trace(TraceInput{Rules: rs, Features: allFeatures, Counters: counters},
		Packet{Src: netip.MustParseAddr("10.251.19.20"), Dst: netip.MustParseAddr("10.0.0.41"), Port: 8080, Protocol: "tcp"})
	last := res.Nat[len(res.Nat)-1]
	if res.NAT != (Verdict{Target: "DNAT", ToAddr: "192.168.50.1", ToPort: "40000"}) || last.Counter == nil || *last.Counter != (Counter{7, 420}) {
		t.Fatalf("verdict %+v, step %+v", res.NAT, last)
	}
}
