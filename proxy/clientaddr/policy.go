// Package clientaddr decides whose address a backend sees. Where kube-proxy would not masquerade, the
// client's own: a pod of this node (the local-traffic detection) or the
// node itself calling a ClusterIP, and any client of an
// externalTrafficPolicy: Local Service (its endpoints are on this node, so
// their replies come back here). Everywhere else — an external client of an
// externalTrafficPolicy: Cluster Service, whose endpoint may be on another
// node and answer by its own route — the node's, as kube-proxy's masquerade.
// A pod reaching itself through its Service (hairpin) also gets the node's,
// as kube-proxy masquerades it, and so does any client whose endpoint would
// answer it on a shared link past this node's netfilter (repliesComeBack).
// The client's address is set by a conntrack source NAT (sock.ClientNAT),
// for TCP connections and UDP flows, IPv4 and IPv6; the node itself is
// bound.
//
// It owns the dataplane's source NAT, the node's links, routes and
// addresses as last read, and each frontend's Policy; the dataplane asks
// it for the Source of every dial. It imports config's plain data and the
// kernel owners (package kernel, proxy/internal/sock).
package clientaddr

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// Mode is --backend-source-address.
type Mode string

const (
	// Auto: the client's address where kube-proxy would keep it, the
	// node's elsewhere.
	Auto Mode = "auto"
	// Node: always the node's (the classic userspace proxy's).
	Node Mode = "node"
)

// ParseMode reads a --backend-source-address value ("" is auto).
func ParseMode(s string) (Mode, error) {
	switch v := Mode(strings.ToLower(s)); v {
	case "", Auto:
		return Auto, nil
	case Node:
		return v, nil
	}
	return "", fmt.Errorf("%q is not auto or node", s)
}

// Policy is what a frontend's connections need to choose the address
// their backend sees; made by the sync goroutine, read by the
// connections'.
type Policy struct {
	// off: the node's address for every client (the flag, the Service's
	// annotation).
	off bool
	// clusterIPs are the Service's ClusterIPs: a connection to one is
	// internal traffic.
	clusterIPs []netip.Addr
	// internalOnly: every connection is internal traffic (the frontend
	// answers on ClusterIPs only, or serves this node's clients of an
	// externalTrafficPolicy: Local Service, which kube-proxy treats as
	// internal).
	internalOnly bool
	// externalLocal: external traffic keeps its client's address
	// (externalTrafficPolicy: Local; its endpoints are all on this node).
	externalLocal bool
}

// NewPolicy is the policy of a frontend of kind serving sp, under mode.
func NewPolicy(mode Mode, kind config.Kind, sp *config.ServicePort) *Policy {
	return &Policy{
		off:           mode == Node || sp.BackendSource == string(Node),
		clusterIPs:    sp.ClusterIPs,
		internalOnly:  kind == config.KindInternal || kind == config.KindLocalClients,
		externalLocal: sp.ExternalLocal,
	}
}

// choice is whose address a connection's backend is meant to see.
type choice int

const (
	choiceNode        choice = iota // the node's, as kube-proxy's masquerade
	choiceOff                       // the node's: --backend-source-address or the annotation
	choiceBindIfLocal               // the client's when it is one of this node's addresses, else the node's
	choiceClientNAT                 // the client's, by the conntrack source NAT
)

// Options are what New needs to know of the daemon.
type Options struct {
	Mode         Mode
	LocalTraffic config.LocalTraffic
	// Serves says whether frontends of a family (4, 6) open.
	Serves func(family int) bool
	// PortRange is the proxy port range: a dial with the client's port
	// binds a port of it (sock.NewClientNAT).
	PortRange config.PortRange
	// OpenNAT: conntrack netlink answers, so the source NAT may open;
	// Sockets is how many netlink sockets it opens.
	OpenNAT bool
	Sockets int
	// Kernel is told of each piece the source NAT needs, found or not.
	Kernel *config.KernelReport
	Log    logrus.FieldLogger
}

// Chooser decides whose address the backends of every frontend see.
type Chooser struct {
	local config.LocalTraffic
	// nat is nil when off or unavailable, and after Close.
	nat   atomic.Pointer[clientNAT]
	links nodeLinks
	addrs nodeAddrs
}

// clientNAT is the source NAT, for the families where the kernel has what
// it needs.
type clientNAT struct {
	nat      *sock.ClientNAT
	families [2]bool // [0]: IPv4, [1]: IPv6
	// bridged: bridged packets go through netfilter (br_netfilter's
	// bridge-nf-call-iptables, -ip6tables), so a pod's reply to a pod on
	// its own bridge meets conntrack.
	bridged [2]bool
}

// New returns the chooser of o, its source NAT opened where o allows and
// probed per family: a family the kernel cannot NAT this way keeps the
// node's address, told to o.Kernel (the start line).
func New(o Options) *Chooser {
	c := &Chooser{local: o.LocalTraffic}
	if o.Mode == Node || !o.OpenNAT {
		return c
	}
	nat, err := sock.NewClientNAT(o.Sockets, o.PortRange.Base, o.PortRange.Size)
	if err != nil {
		o.Log.WithError(err).Warn("Backends see the node's address, not their clients': the source NAT's netlink sockets could not be opened")
		return c
	}
	cn := &clientNAT{nat: nat}
	for _, fam := range []int{4, 6} {
		if o.Serves != nil && !o.Serves(fam) {
			continue
		}
		piece := map[int]config.KernelPiece{4: config.PieceSourceNAT4, 6: config.PieceSourceNAT6}[fam]
		if err := nat.Probe(fam); err != nil {
			o.Kernel.Lacks(piece, fmt.Sprintf("backends of IPv%d Services see the node's address, not their clients' (nf_nat for this family)", fam), err)
			continue
		}
		o.Kernel.Present(piece)
		cn.families[familyIndex(fam)] = true
		sysctl := "bridge-nf-call-iptables"
		if fam == 6 {
			sysctl = "bridge-nf-call-ip6tables"
		}
		v, err := kernel.ProcSys.Read("net.bridge." + sysctl)
		if err == nil && v == "1" {
			cn.bridged[familyIndex(fam)] = true
			o.Kernel.Present(config.PieceBridgeNetfilter)
			continue
		}
		if err == nil {
			err = fmt.Errorf("net.bridge.%s is %s", sysctl, v)
		}
		o.Kernel.Lacks(config.PieceBridgeNetfilter, fmt.Sprintf("IPv%d pods calling a pod on this node's bridge show it the node's address: "+
			"net.bridge.%s is not 1 (br_netfilter), so its reply would bypass conntrack; other clients keep theirs", fam, sysctl), err)
	}
	c.nat.Store(cn)
	return c
}

// Available says whether backends of family fam can see their clients'
// own address.
func (c *Chooser) Available(fam int) bool {
	n := c.nat.Load()
	return n != nil && n.families[familyIndex(fam)]
}

// Close closes the source NAT, once no dial uses it; every Source after it
// is the node's.
func (c *Chooser) Close() {
	if n := c.nat.Swap(nil); n != nil {
		n.nat.Close()
	}
}

// NATFor is the source NAT for addr's family, or nil.
func (c *Chooser) NATFor(addr netip.Addr) *sock.ClientNAT {
	return c.nat.Load().forFamily(addr)
}

func (n *clientNAT) forFamily(addr netip.Addr) *sock.ClientNAT {
	if n == nil || !n.families[familyIndex(config.Family(addr))] {
		return nil
	}
	return n.nat
}

func familyIndex(family int) int { return family / 6 } // 4 → 0, 6 → 1

// choose is the choice of p for a connection from client, internal
// traffic or not.
func (c *Chooser) choose(p *Policy, nat *clientNAT, client netip.Addr, internal bool) choice {
	switch {
	case p == nil:
		return choiceNode
	case p.off:
		return choiceOff
	case internal && c.localPod(nat, client):
		return choiceClientNAT
	case internal:
		return choiceBindIfLocal
	case p.externalLocal:
		return choiceClientNAT
	}
	return choiceNode
}

// Source is the Source of a dial to ep for a connection of a frontend of
// policy p from client to dst (invalid: not known, a UDP flow's), and
// whether the client's address is wanted (a Source that cannot give it is
// a fallback).
func (c *Chooser) Source(p *Policy, client, dst, ep netip.AddrPort) (sock.Source, bool) {
	addr := client.Addr().Unmap()
	if addr == ep.Addr().Unmap() {
		// Hairpin: a pod reaching itself through its Service. A packet
		// from its own address would be a martian to it; kube-proxy
		// masquerades this case too.
		return sock.Source{}, false
	}
	nat := c.nat.Load()
	internal := p != nil && (p.internalOnly || slices.Contains(p.clusterIPs, dst.Addr().Unmap()))
	if p != nil && !dst.IsValid() {
		internal = c.udpInternal(p, nat, addr)
	}
	switch c.choose(p, nat, addr, internal) {
	case choiceBindIfLocal:
		if !c.addrs.has(addr) {
			return sock.Source{}, false
		}
		return sock.Source{Client: addr}, false
	case choiceClientNAT:
		if !c.repliesComeBack(nat, addr, ep.Addr().Unmap()) {
			// The endpoint reaches the client on their shared link: its
			// reply would bypass conntrack, a stray SYN-ACK to the client.
			return sock.Source{}, true
		}
		// Without the source NAT for this family (the kernel lacks a
		// piece, said at start) the node's address.
		return sock.Source{Client: addr, Port: client.Port(), NAT: nat.forFamily(addr)}, true
	}
	return sock.Source{}, false
}

// udpInternal says whether a UDP flow from client is taken for internal
// traffic. Its datagrams arrive redirected: the address the client sent
// them to is only in conntrack. A pod of this node is taken for a
// ClusterIP client; another client is internal only where the external
// policy would not keep its address anyway (so the node itself binds its
// own, an external client gets the node's).
func (c *Chooser) udpInternal(p *Policy, nat *clientNAT, client netip.Addr) bool {
	return p.internalOnly || c.localPod(nat, client) || !p.externalLocal
}

// Describe says in words whose address a backend of a frontend of policy
// p sees for a connection (a UDP flow when udp) from client, to one of the
// Service's ClusterIPs or not (explain).
func (c *Chooser) Describe(p *Policy, udp, toClusterIP bool, client netip.Addr) string {
	nat := c.nat.Load()
	client = client.Unmap()
	internal := p.internalOnly || toClusterIP
	if udp {
		internal = c.udpInternal(p, nat, client)
	}
	switch c.choose(p, nat, client, internal) { // ep not known here: the bridge case is not told
	case choiceOff:
		return "the node's address (--backend-source-address node, or the Service's annotation " + config.AnnotationBackendSource + ")"
	case choiceBindIfLocal:
		return "the client's own address if it is one of this node's, else the node's (a client that is not a pod of this node by --detect-local-mode)"
	case choiceClientNAT:
		if nat.forFamily(client) == nil {
			return "the node's address: the client's cannot be set on this node (see the start log and kube_userspace_proxy_client_address_available)"
		}
		return "the client's own address (" + client.String() + "), by a conntrack source NAT"
	}
	return "the node's address, as kube-proxy's masquerade (an external client of an externalTrafficPolicy: Cluster Service)"
}

// localPod says whether addr is a pod of this node by the local-traffic
// detection: in one of its CIDRs (ClusterCIDR, NodeCIDR), or routed by
// the pods' bridge or an interface of the pods' name prefix
// (BridgeInterface, InterfaceNamePrefix: the route the node's replies to
// addr take names the interface its packets come in by; only with the
// source NAT, nat, which is what a local pod is asked for).
func (c *Chooser) localPod(nat *clientNAT, addr netip.Addr) bool {
	lt := c.local
	switch lt.Mode {
	case config.LocalModeClusterCIDR, config.LocalModeNodeCIDR:
		return slices.ContainsFunc(lt.CIDRs, func(p netip.Prefix) bool { return p.Contains(addr) })
	case config.LocalModeBridgeInterface, config.LocalModeInterfaceNamePrefix:
		if nat == nil || lt.Interface == "" {
			return false
		}
		dev, ok := c.links.routeDev(addr)
		if lt.Mode == config.LocalModeBridgeInterface {
			return ok && dev == lt.Interface
		}
		return ok && strings.HasPrefix(dev, lt.Interface)
	}
	return false
}

// repliesComeBack says whether the endpoint's replies to client pass
// through this node's netfilter, where the source NAT's entry turns them
// back to the dial's socket: always when the two are on different links
// of the node (the endpoint's reply is routed through it), and on one
// link only when that link is a bridge of this node whose packets go
// through netfilter (br_netfilter). Two addresses on one link that is not
// such a bridge (a flat network, another host's bridge) talk directly.
func (c *Chooser) repliesComeBack(nat *clientNAT, client, ep netip.Addr) bool {
	if nat == nil {
		return false
	}
	_, bridge, ok := c.links.sameLink(client, ep)
	if !ok {
		return true
	}
	return bridge && nat.bridged[familyIndex(config.Family(client))]
}
