package iptables

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// localPolicyFrontends plans devpaasy with externalTrafficPolicy Local, an
// externalIP, two LoadBalancer IPs (one limited to 10.251.0.0/16) and
// internalTrafficPolicy itp, each frontend on its own port; ports maps a
// kind to its IPv4 frontend's port.
func localPolicyFrontends(t *testing.T, itpLocal bool) ([]config.Frontend, map[config.Kind]string) {
	t.Helper()
	st := devpaasy(t)
	for _, sp := range st.Ports {
		sp.ExternalLocal, sp.InternalLocal = true, itpLocal
		sp.ExternalIPs = []netip.Addr{netip.MustParseAddr("203.0.113.10")}
	}
	limited := *st.Ports[firstName(st)]
	limited.Name.Port = "limited"
	limited.Port = 9090
	limited.NodePort = 31342
	limited.ExternalIPs = nil
	limited.LoadBalancerIPs = []netip.Addr{netip.MustParseAddr("203.0.113.11")}
	limited.SourceRanges = []netip.Prefix{netip.MustParsePrefix("10.251.0.0/16")}
	st.Ports[limited.Name] = &limited
	fes := proxy.Plan(st, netip.IPv4Unspecified(), true)
	ports := map[config.Kind]string{}
	for i := range fes {
		fes[i].Listen = netip.AddrPortFrom(fes[i].Listen.Addr(), uint16(40000+i))
		if fes[i].Family == 4 && fes[i].Service.Name.Port != "limited" {
			ports[fes[i].Kind] = fmt.Sprint(40000 + i)
		}
	}
	return fes, ports
}

func firstName(st *config.State) config.ServicePortName {
	for name := range st.Ports {
		return name
	}
	panic("no port")
}

// Clients on this node reach the external addresses of an eTP=Local Service
// with every endpoint (the internal frontend, or the local-clients one when
// iTP is Local too); clients from outside with the local endpoints only, in
// every detection mode. A LoadBalancer IP with source ranges short-circuits
// only clients inside them.
func TestShortCircuitForLocalClients(t *testing.T) {
	pod, ext, node := netip.MustParseAddr("10.251.19.20"), netip.MustParseAddr("192.168.50.2"), netip.MustParseAddr("192.168.50.1")
	otherPod := netip.MustParseAddr("10.99.0.5") // a pod network this node does not detect
	modes := []struct {
		name  string
		local config.LocalTraffic
		podIf string // the interface the pod's packets arrive on
	}{
		{"ClusterCIDR", config.LocalTraffic{Mode: config.LocalModeClusterCIDR, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.251.0.0/16"), netip.MustParsePrefix("fd00:251::/64")}}, "veth1"},
		{"NodeCIDR", config.LocalTraffic{Mode: config.LocalModeNodeCIDR, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.251.19.0/24")}}, "veth1"},
		{"BridgeInterface", config.LocalTraffic{Mode: config.LocalModeBridgeInterface, Interface: "cni0"}, "cni0"},
		{"InterfaceNamePrefix", config.LocalTraffic{Mode: config.LocalModeInterfaceNamePrefix, Interface: "veth"}, "veth1"},
	}
	for _, itpLocal := range []bool{false, true} {
		fes, ports := localPolicyFrontends(t, itpLocal)
		every, localOnly := ports[config.KindInternal], ports[config.KindExternal]
		if itpLocal {
			every, localOnly = ports[config.KindLocalClients], ports[config.KindAll]
		}
		if every == "" || localOnly == "" {
			t.Fatalf("iTP Local %v: frontends %v", itpLocal, ports)
		}
		for _, m := range modes {
			t.Run(fmt.Sprintf("%s/iTP Local %v", m.name, itpLocal), func(t *testing.T) {
				o := all4
				o.LocalTraffic = m.local
				in := TraceInput{Rules: Render(fes, o), Features: allFeatures}
				lb, ip := netip.MustParseAddr("203.0.113.11"), netip.MustParseAddr("203.0.113.10")
				for _, tc := range []struct {
					name string
					p    Packet
					want string
				}{
					{"externalIP from the node", Packet{Src: node, Dst: ip, Port: 8080, Protocol: "tcp", FromNode: true}, every},
					{"externalIP from a local pod", Packet{Src: pod, Dst: ip, Port: 8080, Protocol: "tcp", InInterface: m.podIf}, every},
					{"externalIP from outside", Packet{Src: ext, Dst: ip, Port: 8080, Protocol: "tcp", InInterface: "eth0"}, localOnly},
					{"externalIP from another node's pod", Packet{Src: otherPod, Dst: ip, Port: 8080, Protocol: "tcp", InInterface: "eth0"}, localOnly},
					{"NodePort from the node", Packet{Src: node, Dst: node, Port: 31341, Protocol: "tcp", FromNode: true, DstLocal: true}, every},
					{"NodePort from a local pod", Packet{Src: pod, Dst: node, Port: 31341, Protocol: "tcp", DstLocal: true, InInterface: m.podIf}, every},
					{"NodePort from outside", Packet{Src: ext, Dst: node, Port: 31341, Protocol: "tcp", DstLocal: true, InInterface: "eth0"}, localOnly},
					{"ClusterIP from outside", Packet{Src: ext, Dst: netip.MustParseAddr("10.0.0.41"), Port: 8080, Protocol: "tcp", InInterface: "eth0"},
						ports[config.KindInternal] + ports[config.KindAll]},
				} {
					res := Trace(in, tc.p)
					if res.NAT.Target != "REDIRECT" || res.NAT.ToPort != tc.want {
						t.Errorf("%s: %+v, want REDIRECT to %s\n%+v", tc.name, res.NAT, tc.want, res.Nat)
					}
				}
				// The LoadBalancer IP with source ranges: the node's pods
				// inside them short-circuit; the node's own address is
				// outside and does not.
				res := Trace(in, Packet{Src: pod, Dst: lb, Port: 9090, Protocol: "tcp", InInterface: m.podIf})
				if res.NAT.Target != "REDIRECT" || res.NAT.ToPort == "" {
					t.Errorf("limited LoadBalancer IP from a local pod: %+v", res.NAT)
				}
				if res := Trace(in, Packet{Src: node, Dst: lb, Port: 9090, Protocol: "tcp", FromNode: true}); res.NAT.Target != "" {
					t.Errorf("limited LoadBalancer IP from the node, outside the ranges: %+v", res.NAT)
				}
			})
		}
	}
}

// Without local detection only the node's own traffic short-circuits; and
// without eTP=Local Services the entry chains have no jump at all (nothing
// grows for the common case).
func TestShortCircuitChainsOnlyWhenNeeded(t *testing.T) {
	fes, ports := localPolicyFrontends(t, false)
	in := TraceInput{Rules: Render(fes, all4), Features: allFeatures}
	ip := netip.MustParseAddr("203.0.113.10")
	if res := Trace(
		in,
		Packet{Src: netip.MustParseAddr("10.251.19.20"), Dst: ip, Port: 8080, Protocol: "tcp", InInterface: "veth1"},
	); res.NAT.ToPort != ports[config.KindExternal] {
		t.Errorf("a pod without detection: %+v, want the local-only frontend %s", res.NAT, ports[config.KindExternal])
	}
	if res := Trace(
		in,
		Packet{Src: netip.MustParseAddr("192.168.50.1"), Dst: ip, Port: 8080, Protocol: "tcp", FromNode: true},
	); res.NAT.ToPort != ports[config.KindInternal] {
		t.Errorf("the node: %+v, want every endpoint's frontend %s", res.NAT, ports[config.KindInternal])
	}
	if c := in.Rules.Nat[ChainPortalsContainer]; len(c) == 0 || strings.Contains(strings.Join(c, "\n"), ChainLocalPortals) {
		t.Errorf("without detection the container chain jumps to the local chain: %v", c)
	}

	plain := withPorts(proxy.Plan(devpaasy(t), netip.IPv4Unspecified(), true), 40000)
	o := all4
	o.LocalTraffic = config.LocalTraffic{Mode: config.LocalModeClusterCIDR, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.251.0.0/16")}}
	rs := Render(plain, o)
	for chain, rules := range rs.Nat {
		if strings.Contains(chain, "LOCAL") || strings.Contains(strings.Join(rules, "\n"), "LOCAL") {
			t.Errorf("no eTP=Local Service, yet %s: %v", chain, rules)
		}
	}
}
