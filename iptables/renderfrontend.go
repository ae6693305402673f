package iptables

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// renderFrontend returns the rules that lead one frontend's addresses to its
// listener (none for a frontend of another family or without listener).
func renderFrontend(fe config.Frontend, o RenderOptions) []leafRule {
	if fe.Family != o.Family || fe.Err != nil {
		return nil
	}
	sp := fe.Service
	proto := strings.ToLower(string(fe.Protocol))
	target := redirectTarget(fe, o.Placeholders)
	var out []leafRule
	ruleTo := func(src netip.Prefix, dst netip.Addr, port int, target string) string {
		var b strings.Builder
		if src.IsValid() {
			fmt.Fprintf(&b, "-s %s ", src)
		}
		if dst.IsValid() {
			fmt.Fprintf(&b, "-d %s/%d ", dst, dst.BitLen())
		}
		fmt.Fprintf(&b, "-p %s ", proto)
		if o.Features.Comment {
			fmt.Fprintf(&b, "-m comment --comment %q ", sp.Name.String())
		}
		fmt.Fprintf(&b, "-m %s --dport %d %s", proto, port, target)
		return b.String()
	}
	rule := func(dst netip.Addr, port int) string { return ruleTo(netip.Prefix{}, dst, port, target) }
	portal := func(ip netip.Addr) {
		out = append(out, leafRule{treePortals, addrKey(ip), rule(ip, sp.Port)})
	}
	// A LoadBalancer IP with source ranges is redirected only for clients
	// inside them (no range of this family: for none); the filter drops the
	// rest, which keep the LoadBalancer IP as their destination.
	limitedPortal := func(ip netip.Addr) {
		for _, r := range sp.SourceRanges {
			if r.Addr().Is4() == (o.Family == 4) {
				out = append(out, leafRule{treePortals, addrKey(ip), ruleTo(r, ip, sp.Port, target)})
			}
		}
		out = append(out, leafRule{treeSourceRanges, addrKey(ip), ruleTo(netip.Prefix{}, ip, sp.Port, "-j DROP")})
	}
	if fe.Kind.ClusterIPs() {
		for _, ip := range sp.ClusterIPs {
			if config.Family(ip) == o.Family {
				portal(ip)
			}
		}
	}
	if fe.Kind.External() {
		for _, ip := range sp.ExternalIPs {
			if config.Family(ip) == o.Family {
				portal(ip)
			}
		}
		for _, ip := range sp.LoadBalancerIPs {
			switch {
			case config.Family(ip) != o.Family:
			case len(sp.SourceRanges) > 0:
				limitedPortal(ip)
			default:
				portal(ip)
			}
		}
		if sp.NodePort != 0 && fe.NodePortErr == nil && !fe.OnNodePort() {
			tree, key := treeNodePorts+proto, portKey(sp.NodePort)
			if o.AllLocal {
				out = append(out, leafRule{tree, key, rule(netip.Addr{}, sp.NodePort)})
			} else {
				for _, ip := range o.NodePortAddresses {
					out = append(out, leafRule{tree, key, rule(ip, sp.NodePort)})
				}
			}
		}
	}
	if fe.ServesLocalClients() {
		out = append(out, localClientRules(fe, o, ruleTo, target)...)
	}
	// A listener on its NodePort is meant to be reachable from anywhere:
	// where the NodePort falls inside the guarded range it is let through.
	if o.Features.Conntrack && fe.OnNodePort() && o.ProxyPorts.Contains(int(fe.Listen.Port())) {
		out = append(out, leafRule{treeGuard, portKey(int(fe.Listen.Port())),
			fmt.Sprintf("-p %s -m %s --dport %d -j RETURN", proto, proto, fe.Listen.Port())})
	}
	return out
}

// localClientRules are the short-circuit's rules of fe, the frontend with
// every endpoint of an externalTrafficPolicy: Local Service: its external
// addresses and NodePort lead there for clients on this node. A
// LoadBalancer IP with source ranges does so only for clients inside them,
// as for everyone else.
func localClientRules(fe config.Frontend, o RenderOptions, ruleTo func(netip.Prefix, netip.Addr, int, string) string, target string) []leafRule {
	sp := fe.Service
	var out []leafRule
	for _, ip := range sp.ExternalIPs {
		if config.Family(ip) == o.Family {
			out = append(out, leafRule{treeLocalPortals, addrKey(ip), ruleTo(netip.Prefix{}, ip, sp.Port, target)})
		}
	}
	for _, ip := range sp.LoadBalancerIPs {
		if config.Family(ip) != o.Family {
			continue
		}
		if len(sp.SourceRanges) == 0 {
			out = append(out, leafRule{treeLocalPortals, addrKey(ip), ruleTo(netip.Prefix{}, ip, sp.Port, target)})
		}
		for _, r := range sp.SourceRanges {
			if r.Addr().Is4() == (o.Family == 4) {
				out = append(out, leafRule{treeLocalPortals, addrKey(ip), ruleTo(r, ip, sp.Port, target)})
			}
		}
	}
	if sp.NodePort != 0 {
		tree, key := treeLocalNodePorts+strings.ToLower(string(fe.Protocol)), portKey(sp.NodePort)
		if o.AllLocal {
			out = append(out, leafRule{tree, key, ruleTo(netip.Prefix{}, netip.Addr{}, sp.NodePort, target)})
		} else {
			for _, ip := range o.NodePortAddresses {
				out = append(out, leafRule{tree, key, ruleTo(netip.Prefix{}, ip, sp.NodePort, target)})
			}
		}
	}
	return out
}

func placeholder(fe config.Frontend) string {
	if fe.OnNodePort() {
		return fmt.Sprint(fe.Listen.Port())
	}
	return fmt.Sprintf("PROXY_PORT(%s/%s/IPv%d)", fe.Service.Name, fe.Kind, fe.Family)
}

// TargetPort is the port the rules of fe redirect to, as Render writes it
// (a placeholder with placeholders): explain finds a listener by it.
func TargetPort(fe config.Frontend, placeholders bool) string {
	if placeholders {
		return placeholder(fe)
	}
	return fmt.Sprint(fe.Listen.Port())
}

// redirectTarget sends matching packets to the frontend's listener. With
// listeners on the unspecified address it is REDIRECT in every chain: in
// PREROUTING the packet goes to the address it arrived on, in OUTPUT to
// 127.0.0.1 (::1), which always exists — and the UDP listener answers from
// the address each datagram arrived on (IP_PKTINFO), so conntrack maps the
// reply back to the Service address. A specific --bind-address needs DNAT.
func redirectTarget(fe config.Frontend, placeholders bool) string {
	port := TargetPort(fe, placeholders)
	if fe.Listen.Addr().IsUnspecified() || !fe.Listen.Addr().IsValid() {
		return "-j REDIRECT --to-ports " + port
	}
	if fe.Family == 6 {
		return fmt.Sprintf("-j DNAT --to-destination [%s]:%s", fe.Listen.Addr(), port)
	}
	return fmt.Sprintf("-j DNAT --to-destination %s:%s", fe.Listen.Addr(), port)
}
