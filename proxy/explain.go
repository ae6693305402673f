package proxy

// Explain: the service side of "where does this connection go, and why".
// The rule side (which chain catches the packet) is the iptables package's
// Trace; the command glues the two.

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/clientaddr"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
)

// Address kinds a destination can be of a Service port.
const (
	AsClusterIP      = "clusterIP"
	AsExternalIP     = "externalIP"
	AsLoadBalancerIP = "loadBalancerIP"
	AsNodePort       = "nodePort"
)

// Match finds the frontend of frontends that serves a connection to dst of
// protocol (TCP or UDP), and what dst is to its Service. dstLocal says
// whether dst is an address of this node, for NodePorts. Service addresses
// win over NodePorts, as the rules order them.
func Match(frontends []config.Frontend, dst netip.AddrPort, protocol config.Protocol, dstLocal bool) (config.Frontend, string, bool) {
	addr, port := dst.Addr().Unmap(), int(dst.Port())
	fam := config.Family(addr)
	for _, fe := range frontends {
		sp := fe.Service
		if fe.Family != fam || fe.Protocol != protocol || sp.Port != port {
			continue
		}
		if fe.Kind.ClusterIPs() && slices.Contains(sp.ClusterIPs, addr) {
			return fe, AsClusterIP, true
		}
		if fe.Kind.External() {
			if slices.Contains(sp.ExternalIPs, addr) {
				return fe, AsExternalIP, true
			}
			if slices.Contains(sp.LoadBalancerIPs, addr) {
				return fe, AsLoadBalancerIP, true
			}
		}
	}
	if dstLocal {
		for _, fe := range frontends {
			if fe.Family == fam && fe.Protocol == protocol && fe.Kind.External() && fe.Service.NodePort == port {
				return fe, AsNodePort, true
			}
		}
	}
	return config.Frontend{}, "", false
}

// MatchLocalClient says what dst is to fe's Service when fe is the listener
// clients on this node reach its external addresses with
// (config.Frontend.ServesLocalClients), as the short-circuit's rules send
// them there.
func MatchLocalClient(fe config.Frontend, dst netip.AddrPort, protocol config.Protocol) (string, bool) {
	if !fe.ServesLocalClients() {
		return "", false
	}
	external := fe
	external.Kind = config.KindExternal
	_, as, ok := Match([]config.Frontend{external}, dst, protocol, true)
	return as, ok
}

// ExplainedEndpoint is one endpoint of the Service port, with whether this
// listener may pick it and why.
type ExplainedEndpoint struct {
	Address     netip.AddrPort `json:"address"`
	Ready       bool           `json:"ready"`
	Serving     bool           `json:"serving"`
	Terminating bool           `json:"terminating,omitempty"`
	Node        string         `json:"node,omitempty"`
	// Selected: the listener picks among it (traffic policy, readiness).
	Selected bool `json:"selected"`
	// Why says why it is or is not selected.
	Why string `json:"why"`
	// Health is its outlier, drain and connection state (selected only).
	Health *balance.EndpointHealth `json:"health,omitempty"`
}

// Explanation is what a listener does with a new connection from a client.
type Explanation struct {
	Service  string          `json:"service"`
	Protocol config.Protocol `json:"protocol"`
	Family   int             `json:"family"`
	Kind     config.Kind     `json:"kind"`
	// As is what the destination is to the Service: clusterIP,
	// externalIP, loadBalancerIP or nodePort.
	As string `json:"as"`
	// Listen is the listener's address ("" before it exists, offline).
	Listen string `json:"listen,omitempty"`
	Port   int    `json:"port"`
	// NodePort, and whether the listener sits on it (no rule needed).
	NodePort   int  `json:"nodePort,omitempty"`
	OnNodePort bool `json:"onNodePort,omitempty"`
	// TrafficPolicy is the policy that applies to this kind of address:
	// Cluster, or Local (only endpoints on this node).
	TrafficPolicy string `json:"trafficPolicy"`
	// LocalClient: an external address of an externalTrafficPolicy: Local
	// Service reached by a client on this node, which kube-proxy's
	// short-circuit sends to every endpoint (policy Cluster here).
	LocalClient bool   `json:"localClient,omitempty"`
	Node        string `json:"node,omitempty"`
	Zone        string `json:"zone,omitempty"`
	// Topology is the hints that narrow the endpoints: PreferSameNode
	// (hints.forNodes), PreferSameZone (hints.forZones) or "" (none used:
	// traffic policy Local, no trafficDistribution, or hints that do not
	// cover every endpoint or name no endpoint for this node).
	Topology            string `json:"topology,omitempty"`
	TrafficDistribution string `json:"trafficDistribution,omitempty"`
	Scheduler           string `json:"scheduler"`
	// AffinityTimeout is ClientIP affinity's timeout ("" without).
	AffinityTimeout string              `json:"affinityTimeout,omitempty"`
	Endpoints       []ExplainedEndpoint `json:"endpoints"`
	// BackendSees is whose address the backend sees for this client (a
	// live listener's; "" offline).
	BackendSees string `json:"backendSees,omitempty"`
	// Next is what the balancer will pick for the client's next connection.
	Next balance.Prediction `json:"next"`
	// Live is false when the explanation comes from manifests, with no
	// listener: the round-robin position is then unknown.
	Live bool `json:"live"`
}

// Explain explains what the listener behind fe does with a new connection
// from client. as is Match's answer. Without a live listener (offline, or
// one that failed) it explains with a new balancer, as the listener would
// start.
func (p *Proxier) Explain(fe config.Frontend, as string, client netip.Addr) Explanation {
	bal, node, zone := p.rec.balancerOf(fe)
	x := explain(fe, as, client, node, zone, bal, bal != nil)
	if fe.Protocol == config.TCP && client.IsValid() {
		x.BackendSees = p.dp.Source().Describe(
			clientaddr.NewPolicy(p.cfg.BackendSource, dataplane.KeyOf(fe).Kind, fe.Service),
			fe.Protocol == config.UDP,
			as == AsClusterIP,
			client,
		)
	}
	return x
}

// ExplainPlanned explains a frontend of Plan: no listener, a balancer as a
// new listener would start it.
func ExplainPlanned(fe config.Frontend, as string, client netip.Addr, node, zone string) Explanation {
	return explain(fe, as, client, node, zone, nil, false)
}

func explain(fe config.Frontend, as string, client netip.Addr, node, zone string, bal *balance.Balancer, live bool) Explanation {
	sp := fe.Service
	local := localOnly(dataplane.KeyOf(fe), sp)
	localClient := as != "" && as != AsClusterIP && fe.ServesLocalClients()
	if as == AsClusterIP {
		local = sp.InternalLocal
	} else if as != "" {
		local = sp.ExternalLocal && !localClient
	}
	usable := config.UsableEndpoints(sp.Endpoints, fe.Family, local, node, zone)
	mode := config.TopologyNone
	if !local {
		mode = config.TopologyMode(sp.Endpoints, fe.Family, node, zone)
	}
	if bal == nil {
		nb := balance.New(sp.Scheduler)
		nb.Update(usable, sp.AffinityTimeout, balance.OutlierConfig{}, sp.Scheduler)
		bal = nb
	}
	x := Explanation{Service: sp.Name.String(), Protocol: fe.Protocol, Family: fe.Family, Kind: fe.Kind, As: as,
		Port: sp.Port, NodePort: sp.NodePort, OnNodePort: fe.Err == nil && fe.OnNodePort() && live,
		TrafficPolicy: "Cluster", Node: node, Zone: zone, Topology: mode, TrafficDistribution: sp.TrafficDistribution,
		Scheduler: bal.Scheduler(), Live: live, LocalClient: localClient}
	if x.Scheduler == "" {
		x.Scheduler = balance.SchedRoundRobin
	}
	if local {
		x.TrafficPolicy = "Local"
	}
	if live {
		x.Listen = fe.Listen.String()
	} else {
		x.OnNodePort = sp.NodePort != 0 && fe.Listen.Port() != 0 && int(fe.Listen.Port()) == sp.NodePort
	}
	if sp.AffinityTimeout > 0 {
		x.AffinityTimeout = sp.AffinityTimeout.String()
	}
	health := map[netip.AddrPort]balance.EndpointHealth{}
	for _, h := range bal.Health() {
		health[h.Endpoint] = h
	}
	anyReady := false
	for _, ep := range sp.Endpoints {
		anyReady = anyReady || (ep.Ready && config.Family(ep.Addr.Addr()) == fe.Family && (!local || ep.NodeName == node))
	}
	x.Endpoints = []ExplainedEndpoint{}
	for _, ep := range sp.Endpoints {
		if config.Family(ep.Addr.Addr()) != fe.Family {
			continue // the other family's listener serves those
		}
		e := ExplainedEndpoint{Address: ep.Addr, Ready: ep.Ready, Serving: ep.Serving, Terminating: ep.Terminating, Node: ep.NodeName}
		e.Selected = slices.Contains(usable, ep.Addr)
		e.Why = endpointWhy(ep, e.Selected, local, node, anyReady)
		if !config.InTopology(ep, mode, node, zone) {
			e.Why = fmt.Sprintf("topology %s: hinted for zones %q, nodes %q, not this node (%s, zone %q)", mode, ep.ZoneHints, ep.NodeHints, node, zone)
		}
		if h, ok := health[ep.Addr]; ok && e.Selected && live {
			h := h
			e.Health = &h
		}
		x.Endpoints = append(x.Endpoints, e)
	}
	x.Next = bal.Predict(client.Unmap())
	if !live {
		x.Next.Position = nil
		if (x.Scheduler == balance.SchedRoundRobin || x.Scheduler == balance.SchedLeastConn) && x.Next.Reason != balance.ReasonAffinity && len(usable) > 1 {
			// A new listener starts its rotation at a random place:
			// any of them can be first.
			x.Next.Endpoint, x.Next.Candidates = nil, usable
		}
	}
	return x
}

func endpointWhy(ep config.Endpoint, selected bool, local bool, node string, anyReady bool) string {
	switch {
	case local && ep.NodeName != node:
		if ep.NodeName == "" {
			return "traffic policy Local, and the endpoint names no node"
		}
		return "traffic policy Local, and the endpoint is on node " + ep.NodeName
	case selected && ep.Ready:
		return "ready"
	case selected:
		return "no endpoint is ready: serving and terminating endpoints take the traffic"
	case ep.Serving && ep.Terminating && anyReady:
		return "terminating: used only when no endpoint is ready"
	}
	return "not ready"
}
