package config

// What the proxier hands the kernel rules: plain data, so that the rules
// package and the proxier stand side by side, neither importing the other.

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// Kind says which addresses a frontend answers on.
type Kind string

const (
	// KindAll: ClusterIPs and the external addresses share one listener
	// (internal and external traffic policies select the same endpoints).
	KindAll Kind = "all"
	// KindInternal: ClusterIPs only.
	KindInternal Kind = "internal"
	// KindExternal: NodePort, externalIPs and LoadBalancer IPs only.
	KindExternal Kind = "external"
	// KindLocalClients: the external addresses of an
	// externalTrafficPolicy: Local Service for clients on this node (the
	// node itself, its pods), with every endpoint of the cluster, as
	// kube-proxy's short-circuit. Only when no other frontend of the
	// Service selects every endpoint (internalTrafficPolicy is Local too);
	// otherwise the internal frontend serves these clients.
	KindLocalClients Kind = "local-clients"
)

// ClusterIPs reports whether a frontend of kind k answers on the ClusterIPs.
func (k Kind) ClusterIPs() bool { return k == KindAll || k == KindInternal }

// External reports whether a frontend of kind k answers on the external
// addresses (NodePort, externalIPs, LoadBalancer IPs) for every client, and
// so holds the NodePort.
func (k Kind) External() bool { return k == KindAll || k == KindExternal }

// Kinds lists every Kind.
var Kinds = [...]Kind{KindAll, KindInternal, KindExternal, KindLocalClients}

// ServesLocalClients reports whether f is the frontend clients on this node
// reach the external addresses of its Service with (kube-proxy's
// short-circuit for externalTrafficPolicy: Local): the one of its frontends
// that selects every endpoint.
func (f Frontend) ServesLocalClients() bool {
	sp := f.Service
	if !sp.ExternalLocal || !sp.HasExternal() {
		return false
	}
	return f.Kind == KindLocalClients || (f.Kind == KindInternal && !sp.InternalLocal)
}

// Frontend is one listener and what it answers on, as plain data: Rules
// receive these. The live listener behind it is the proxier's.
type Frontend struct {
	Service  *ServicePort
	Kind     Kind
	Family   int
	Protocol Protocol
	Listen   netip.AddrPort // where the listener is bound (port is the proxy port)
	// Err is set when the listener could not be opened; Rules skip it.
	Err error
	// NodePortErr is set when the NodePort could not be held (another
	// process has it); Rules skip the NodePort but serve the rest.
	NodePortErr error
}

// OnNodePort reports whether the listener sits on the Service's NodePort:
// traffic to the NodePort then reaches it without any rule, and it is meant
// to be reachable from anywhere.
func (f Frontend) OnNodePort() bool {
	return f.Service.NodePort != 0 && int(f.Listen.Port()) == f.Service.NodePort
}

// PortRange is --proxy-port-range: the local ports listeners may use. The zero
// value means "let the kernel choose".
type PortRange struct {
	Base, Size int
}

// DefaultPortRange is --proxy-port-range when none is given: inside the
// kernel's default ephemeral range (32768-60999), away from the NodePort
// range (30000-32767) and from servers with well-known ports. ReservePorts
// takes it out of the ephemeral range, which keeps 32768-44999 and
// 60000-60999 for the node's outgoing connections. TCP and UDP, IPv4 and
// IPv6 each have the whole range: 15 000 listeners apiece.
var DefaultPortRange = PortRange{Base: 45000, Size: 15000}

// ParsePortRange parses "begin-end", "begin+offset" or a single port; "" and
// "0-0" mean the kernel's own range (see package proxy/ports).
func ParsePortRange(s string) (PortRange, error) {
	s = strings.TrimSpace(s)
	if s == "" || s == "0-0" || s == "0" {
		return PortRange{}, nil
	}
	var lo, hi int
	var err error
	switch {
	case strings.Contains(s, "-"):
		a, b, _ := strings.Cut(s, "-")
		if lo, err = strconv.Atoi(a); err == nil {
			hi, err = strconv.Atoi(b)
		}
	case strings.Contains(s, "+"):
		a, b, _ := strings.Cut(s, "+")
		var off int
		if lo, err = strconv.Atoi(a); err == nil {
			off, err = strconv.Atoi(b)
			hi = lo + off
		}
	default:
		lo, err = strconv.Atoi(s)
		hi = lo
	}
	if err != nil {
		return PortRange{}, fmt.Errorf("port range %q: want begin-end, begin+offset or a port", s)
	}
	if lo < 1 || hi > 65535 || lo > hi {
		return PortRange{}, fmt.Errorf("port range %q: ports must satisfy 1 <= begin <= end <= 65535", s)
	}
	return PortRange{Base: lo, Size: hi - lo + 1}, nil
}

// Contains reports whether port p is in the range.
func (r PortRange) Contains(p int) bool { return p >= r.Base && p < r.Base+r.Size }

func (r PortRange) String() string {
	if r.Size == 0 {
		return ""
	}
	return fmt.Sprintf("%d-%d", r.Base, r.Base+r.Size-1)
}
