package config

import (
	"fmt"
	"net/netip"
	"strings"
)

// LocalMode is kube-proxy's --detect-local-mode: how a packet from one of
// this node's pods is told from one that came from another host.
type LocalMode string

// The modes kube-proxy knows. LocalModeNone detects no pod (only the node's
// own traffic counts as local).
const (
	LocalModeNone                = LocalMode("")
	LocalModeClusterCIDR         = LocalMode("ClusterCIDR")
	LocalModeNodeCIDR            = LocalMode("NodeCIDR")
	LocalModeBridgeInterface     = LocalMode("BridgeInterface")
	LocalModeInterfaceNamePrefix = LocalMode("InterfaceNamePrefix")
)

// LocalTraffic is the local-traffic detection the rules use. Clients on this
// node (the node itself, and the pods it detects) reach the external
// addresses of an externalTrafficPolicy: Local Service with every endpoint
// of the cluster, as kube-proxy's short-circuit: only traffic from outside
// is limited to this node's endpoints.
type LocalTraffic struct {
	Mode LocalMode
	// CIDRs are the pods' ranges: the cluster's (ClusterCIDR) or this
	// node's (NodeCIDR), at most one per family.
	CIDRs []netip.Prefix
	// Interface is the pods' bridge (BridgeInterface) or the name prefix of
	// their interfaces (InterfaceNamePrefix).
	Interface string
}

// ParseLocalMode reads a --detect-local-mode value ("" is ClusterCIDR, as
// kube-proxy defaults it).
func ParseLocalMode(s string) (LocalMode, error) {
	switch m := LocalMode(s); m {
	case "":
		return LocalModeClusterCIDR, nil
	case LocalModeClusterCIDR, LocalModeNodeCIDR, LocalModeBridgeInterface, LocalModeInterfaceNamePrefix:
		return m, nil
	}
	return "", fmt.Errorf("%q is not a mode (ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix)", s)
}

// ParseCIDRs reads a comma-separated list of CIDRs with at most one per
// family, as --cluster-cidr and spec.podCIDRs are.
func ParseCIDRs(s string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		p, err := netip.ParsePrefix(f)
		if err != nil {
			return nil, fmt.Errorf("%q is not a CIDR", f)
		}
		if p != p.Masked() {
			return nil, fmt.Errorf("%q has host bits set (%s?)", f, p.Masked())
		}
		for _, q := range out {
			if q.Addr().Is4() == p.Addr().Is4() {
				return nil, fmt.Errorf("%s and %s: at most one CIDR per IP family", q, p)
			}
		}
		out = append(out, p)
	}
	return out, nil
}

// Matches returns the iptables matches that pick the detected pods'
// packets of family in nat PREROUTING: one per rule, none when this family
// detects no pod.
func (l LocalTraffic) Matches(family int) []string {
	switch l.Mode {
	case LocalModeClusterCIDR, LocalModeNodeCIDR:
		for _, p := range l.CIDRs {
			if Family(p.Addr()) == family {
				return []string{"-s " + p.String()}
			}
		}
	case LocalModeBridgeInterface:
		if l.Interface != "" {
			return []string{"-i " + l.Interface}
		}
	case LocalModeInterfaceNamePrefix:
		if l.Interface != "" {
			return []string{"-i " + l.Interface + "+"}
		}
	}
	return nil
}

// Describe says in words which clients count as this node's, for logs,
// /configz and explain.
func (l LocalTraffic) Describe() string {
	pods := "no pod detected"
	switch {
	case len(l.Matches(4)) > 0 || len(l.Matches(6)) > 0:
		var ms []string
		for _, fam := range []int{4, 6} {
			ms = append(ms, l.Matches(fam)...)
		}
		pods = fmt.Sprintf("pods by %s (%s)", l.Mode, strings.Join(ms, ", "))
	case l.Mode != LocalModeNone:
		pods = fmt.Sprintf("no pod detected (%s without a value)", l.Mode)
	}
	return "the node itself and " + pods
}
