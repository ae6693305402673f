package proxy

// Whose address a backend sees. Where kube-proxy would not masquerade, the
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

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// BackendSource is --backend-source-address.
type BackendSource string

const (
	// BackendSourceAuto: the client's address where kube-proxy would keep
	// it, the node's elsewhere.
	BackendSourceAuto BackendSource = "auto"
	// BackendSourceNode: always the node's (the classic userspace proxy's).
	BackendSourceNode BackendSource = "node"
)

// ParseBackendSource reads a --backend-source-address value ("" is auto).
func ParseBackendSource(s string) (BackendSource, error) {
	switch v := BackendSource(strings.ToLower(s)); v {
	case "", BackendSourceAuto:
		return BackendSourceAuto, nil
	case BackendSourceNode:
		return v, nil
	}
	return "", fmt.Errorf("%q is not auto or node", s)
}

// sourcePolicy is what a frontend's connections need to choose the
// address their backend sees; made by the sync goroutine, read by the
// connections' (frontend.source).
type sourcePolicy struct {
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

// newSourcePolicy is the policy of key's frontend serving sp.
func newSourcePolicy(cfg *Config, key frontendKey, sp *config.ServicePort) *sourcePolicy {
	return &sourcePolicy{
		off:           cfg.BackendSource == BackendSourceNode || sp.BackendSource == string(BackendSourceNode),
		clusterIPs:    sp.ClusterIPs,
		internalOnly:  key.Kind == config.KindInternal || key.Kind == config.KindLocalClients,
		externalLocal: sp.ExternalLocal,
	}
}

// sourceChoice is whose address a connection's backend is meant to see.
type sourceChoice int

const (
	sourceNode        sourceChoice = iota // the node's, as kube-proxy's masquerade
	sourceOff                             // the node's: --backend-source-address or the annotation
	sourceBindIfLocal                     // the client's when it is one of this node's addresses, else the node's
	sourceClientNAT                       // the client's, by the conntrack source NAT
)

// choose is the choice for a connection from client, internal traffic or
// not.
func (p *sourcePolicy) choose(cfg *Config, nat *clientNAT, client netip.Addr, internal bool) sourceChoice {
	switch {
	case p == nil:
		return sourceNode
	case p.off:
		return sourceOff
	case internal && nat.localPod(cfg, client):
		return sourceClientNAT
	case internal:
		return sourceBindIfLocal
	case p.externalLocal:
		return sourceClientNAT
	}
	return sourceNode
}

// source is the Source of a dial to ep for a connection from client to
// dst (invalid: not known, a UDP flow's), and whether the client's address
// is wanted (a Source that cannot give it is a fallback).
func (f *frontend) source(client, dst, ep netip.AddrPort) (sock.Source, bool) {
	p := f.sourcePolicy.Load()
	addr := client.Addr().Unmap()
	if addr == ep.Addr().Unmap() {
		// Hairpin: a pod reaching itself through its Service. A packet
		// from its own address would be a martian to it; kube-proxy
		// masquerades this case too.
		return sock.Source{}, false
	}
	nat := f.dp.clientNAT.Load()
	internal := p != nil && (p.internalOnly || slices.Contains(p.clusterIPs, dst.Addr().Unmap()))
	if p != nil && !dst.IsValid() {
		internal = p.udpInternal(f.dp.cfg, nat, addr)
	}
	switch p.choose(f.dp.cfg, nat, addr, internal) {
	case sourceBindIfLocal:
		if !f.dp.nodeAddrs.has(addr) {
			return sock.Source{}, false
		}
		return sock.Source{Client: addr}, false
	case sourceClientNAT:
		if !nat.repliesComeBack(addr, ep.Addr().Unmap()) {
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
func (p *sourcePolicy) udpInternal(cfg *Config, nat *clientNAT, client netip.Addr) bool {
	return p.internalOnly || nat.localPod(cfg, client) || !p.externalLocal
}

// backendSees says in words whose address a backend of fe sees for a
// connection from client to the Service's address of kind as (explain).
func (p *Proxier) backendSees(fe config.Frontend, as string, client netip.Addr) string {
	key := keyOf(fe)
	pol := newSourcePolicy(&p.cfg, key, fe.Service)
	nat := p.dp.clientNAT.Load()
	internal := pol.internalOnly || as == AsClusterIP
	if fe.Protocol == config.UDP {
		internal = pol.udpInternal(&p.cfg, nat, client.Unmap())
	}
	switch pol.choose(&p.cfg, nat, client.Unmap(), internal) { // ep not known here: the bridge case is not told
	case sourceOff:
		return "the node's address (--backend-source-address node, or the Service's annotation " + config.AnnotationBackendSource + ")"
	case sourceBindIfLocal:
		return "the client's own address if it is one of this node's, else the node's (a client that is not a pod of this node by --detect-local-mode)"
	case sourceClientNAT:
		if nat.forFamily(client.Unmap()) == nil {
			return "the node's address: the client's cannot be set on this node (see the start log and kube_userspace_proxy_client_address_available)"
		}
		return "the client's own address (" + client.Unmap().String() + "), by a conntrack source NAT"
	}
	return "the node's address, as kube-proxy's masquerade (an external client of an externalTrafficPolicy: Cluster Service)"
}

// localPod says whether addr is a pod of this node by the local-traffic
// detection: in one of its CIDRs (ClusterCIDR, NodeCIDR), or routed by
// the pods' bridge or an interface of the pods' name prefix
// (BridgeInterface, InterfaceNamePrefix: the route the node's replies to
// addr take names the interface its packets come in by).
func (c *clientNAT) localPod(cfg *Config, addr netip.Addr) bool {
	lt := cfg.LocalTraffic
	switch lt.Mode {
	case config.LocalModeClusterCIDR, config.LocalModeNodeCIDR:
		return slices.ContainsFunc(lt.CIDRs, func(p netip.Prefix) bool { return p.Contains(addr) })
	case config.LocalModeBridgeInterface, config.LocalModeInterfaceNamePrefix:
		if c == nil || lt.Interface == "" {
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

// clientNAT is the dataplane's source NAT, for the families where the
// kernel has what it needs.
type clientNAT struct {
	nat      *sock.ClientNAT
	families [2]bool // [0]: IPv4, [1]: IPv6
	// bridged: bridged packets go through netfilter (br_netfilter's
	// bridge-nf-call-iptables, -ip6tables), so a pod's reply to a pod on
	// its own bridge meets conntrack.
	bridged [2]bool
	links   nodeLinks
}

// repliesComeBack says whether the endpoint's replies to client pass
// through this node's netfilter, where the source NAT's entry turns them
// back to the dial's socket: always when the two are on different links
// of the node (the endpoint's reply is routed through it), and on one
// link only when that link is a bridge of this node whose packets go
// through netfilter (br_netfilter). Two addresses on one link that is not
// such a bridge (a flat network, another host's bridge) talk directly.
func (c *clientNAT) repliesComeBack(client, ep netip.Addr) bool {
	if c == nil {
		return false
	}
	_, bridge, ok := c.links.sameLink(client, ep)
	if !ok {
		return true
	}
	return bridge && c.bridged[familyIndex(config.Family(client))]
}

// forFamily is the source NAT for addr's family, or nil.
func (c *clientNAT) forFamily(addr netip.Addr) *sock.ClientNAT {
	if c == nil || !c.families[familyIndex(config.Family(addr))] {
		return nil
	}
	return c.nat
}

func familyIndex(family int) int { return family / 6 } // 4 → 0, 6 → 1

// openClientNAT opens the dataplane's source NAT (where conntrack netlink
// answers: newDataplane asks first) and probes it per family;
// a family the kernel cannot NAT this way keeps the node's address, told
// to the kernel report (the start line; clientAddressAvailable tells the
// metrics).
func openClientNAT(cfg *Config, sockets int) *clientNAT {
	if cfg.BackendSource == BackendSourceNode {
		return nil
	}
	nat, err := sock.NewClientNAT(sockets, cfg.PortRange.Base, cfg.PortRange.Size)
	if err != nil {
		cfg.log().WithError(err).Warn("Backends see the node's address, not their clients': the source NAT's netlink sockets could not be opened")
		return nil
	}
	c := &clientNAT{nat: nat}
	for _, fam := range []int{4, 6} {
		if !cfg.serves(fam) {
			continue
		}
		piece := map[int]config.KernelPiece{4: config.PieceSourceNAT4, 6: config.PieceSourceNAT6}[fam]
		if err := nat.Probe(fam); err != nil {
			cfg.Kernel.Lacks(piece, fmt.Sprintf("backends of IPv%d Services see the node's address, not their clients' (nf_nat for this family)", fam), err)
			continue
		}
		cfg.Kernel.Present(piece)
		c.families[familyIndex(fam)] = true
		clientAddressAvailable.WithLabelValues(familyNames([]int{fam})...).Set(1)
		sysctl := "bridge-nf-call-iptables"
		if fam == 6 {
			sysctl = "bridge-nf-call-ip6tables"
		}
		v, err := kernel.ProcSys.Read("net.bridge." + sysctl)
		if err == nil && v == "1" {
			c.bridged[familyIndex(fam)] = true
			cfg.Kernel.Present(config.PieceBridgeNetfilter)
			continue
		}
		if err == nil {
			err = fmt.Errorf("net.bridge.%s is %s", sysctl, v)
		}
		cfg.Kernel.Lacks(config.PieceBridgeNetfilter, fmt.Sprintf("IPv%d pods calling a pod on this node's bridge show it the node's address: "+
			"net.bridge.%s is not 1 (br_netfilter), so its reply would bypass conntrack; other clients keep theirs", fam, sysctl), err)
	}
	return c
}

// ProbeConntrackNetlink asks conntrack netlink for an entry that does not
// exist: nil where the kernel answers (nf_conntrack_netlink), else why not.
func ProbeConntrackNetlink() error {
	ct, err := kernel.OpenConntrack(1)
	if err != nil {
		return err
	}
	defer ct.Close()
	return ct.Probe()
}

// countSource counts whose address the backend of client's connection saw, and says at debug
// level why it was not the client's when it should have been.
func (f *frontend) countSource(client, ep netip.AddrPort, dialed sock.Dialed, wanted bool) {
	switch {
	case wanted && !dialed.Sees.IsValid():
		backendSources.WithLabelValues("fallback").Inc()
		err := dialed.SourceErr
		if err == nil {
			err = errors.New("the source NAT is not available for this client and endpoint (see the start log)")
		}
		f.debug(logrus.Fields{"client": client, "endpoint": ep}, err, "Backend sees the node's address, not the client's")
	case dialed.Sees.IsValid():
		backendSources.WithLabelValues("client").Inc()
	default:
		backendSources.WithLabelValues("node").Inc()
	}
}
