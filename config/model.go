// Package config turns Kubernetes objects into the service model the proxier consumes.
//
// Typical use: a source (the manifests file watcher in this package, or the cluster
// watcher) builds a *State from v1 Services and discovery/v1 EndpointSlices with
// a Builder (AddService, AddSlice, State) and hands it to a Sink; the proxier is the only Sink and never sees a
// Kubernetes object.
//
//	st, skipped, err := config.LoadManifests("docs/examples/devpaasy.yaml", "node-a")
//	proxier.Update(st)
//
// It owns the model (State, ServicePort, Frontend — the plain data between
// the proxier and the rules) and the two sources; it imports nothing of
// this project, and every other package may import it.
package config

import (
	"cmp"
	"fmt"
	"net/netip"
	"sort"
	"strings"
	"time"
)

// Protocol is the L4 protocol of a service port. Only TCP and UDP are proxied;
// SCTP ports are skipped by the converters.
type Protocol string

const (
	TCP Protocol = "TCP"
	UDP Protocol = "UDP"
)

// DefaultAffinityTimeout is the Service API default for
// sessionAffinityConfig.clientIP.timeoutSeconds.
const DefaultAffinityTimeout = 10800 * time.Second

// ServicePortName identifies one port of one Service: namespace/name:port.
type ServicePortName struct {
	Namespace string
	Name      string
	Port      string // the Service port's name; empty for single-port Services
}

func (n ServicePortName) String() string {
	if n.Port == "" {
		return n.Namespace + "/" + n.Name
	}
	return n.Namespace + "/" + n.Name + ":" + n.Port
}

// Compare orders names for stable output (rules, debug views): namespace,
// name, port.
func (n ServicePortName) Compare(o ServicePortName) int {
	return cmp.Or(cmp.Compare(n.Namespace, o.Namespace), cmp.Compare(n.Name, o.Name), cmp.Compare(n.Port, o.Port))
}

// Less reports whether n sorts before o (Compare).
func (n ServicePortName) Less(o ServicePortName) bool { return n.Compare(o) < 0 }

// Service names the Service the port belongs to.
func (n ServicePortName) Service() ServiceName { return ServiceName{n.Namespace, n.Name} }

// ServiceName identifies one Service: namespace/name.
type ServiceName struct {
	Namespace string
	Name      string
}

func (n ServiceName) String() string { return n.Namespace + "/" + n.Name }

// ServicePort is everything the proxier needs to serve one Service port: the
// addresses it answers on, how clients stick to endpoints, and the endpoints.
type ServicePort struct {
	Name     ServicePortName
	Protocol Protocol
	Port     int // the Service port (what clients dial on ClusterIPs, externalIPs, LB IPs)
	NodePort int // 0 when the Service has none

	ClusterIPs      []netip.Addr // one per IP family, primary first
	ExternalIPs     []netip.Addr
	LoadBalancerIPs []netip.Addr // status.loadBalancer.ingress IPs, ipMode Proxy excluded

	// AffinityTimeout > 0 means ClientIP session affinity with that timeout.
	AffinityTimeout time.Duration

	// InternalLocal and ExternalLocal are internalTrafficPolicy: Local and
	// externalTrafficPolicy: Local: such traffic goes only to endpoints on this node.
	InternalLocal bool
	ExternalLocal bool

	// Scheduler is the annotation kube-userspace-proxy.io/scheduler: rr
	// (also ""), lc, sh or random; an unknown value is warned about when the
	// listener opens, and rr is used.
	Scheduler string

	// ProxyProtocol is the annotation kube-userspace-proxy.io/proxy-protocol:
	// "v1" or "v2" sends a PROXY protocol header to TCP backends; another
	// value is warned about when the listener opens, and sends none.
	ProxyProtocol string

	// BackendSource is the annotation
	// kube-userspace-proxy.io/backend-source-address: "node" has the
	// backends see the node's address, never their clients'; "" and
	// "auto" follow --backend-source-address; another value is warned
	// about when the listener opens, and is auto.
	BackendSource string

	// Created is the Service's creationTimestamp (zero when a manifest has
	// none): of two Services that claim the same NodePort, the older keeps
	// it, then the first by namespace/name.
	Created time.Time

	// OutlierDetection is the annotation
	// kube-userspace-proxy.io/outlier-detection: "off" means the proxy never
	// ejects this Service's endpoints after failed dials; "", "on" and any
	// other value (warned about when the listener opens) leave it on.
	OutlierDetection string

	// HealthCheckNodePort is the Service's spec.healthCheckNodePort (0: none):
	// with externalTrafficPolicy Local, load balancers ask it whether this
	// node has a local endpoint.
	HealthCheckNodePort int
	// SourceRanges are spec.loadBalancerSourceRanges: only these clients
	// reach the LoadBalancer IPs (empty: everyone). ClusterIPs, NodePorts
	// and externalIPs are not affected, as in kube-proxy.
	SourceRanges []netip.Prefix
	// TrafficDistribution is spec.trafficDistribution, for the debug
	// views: what the endpoint hints say is what decides (UsableEndpoints).
	TrafficDistribution string

	Endpoints []Endpoint // sorted by address
}

// HasExternal reports whether the port answers on any address reachable from outside the cluster.
func (sp *ServicePort) HasExternal() bool {
	return sp.NodePort != 0 || len(sp.ExternalIPs) > 0 || len(sp.LoadBalancerIPs) > 0
}

// Families returns the IP families (4 and/or 6) of the port's ClusterIPs,
// primary first. The slice is shared: callers must not modify it (the
// proxier asks for every port on every sync, and allocating cost 10k
// allocations a sync at 10k service ports).
func (sp *ServicePort) Families() []int {
	first, second := 0, 0
	for _, ip := range sp.ClusterIPs {
		switch f := Family(ip); {
		case first == 0:
			first = f
		case f != first:
			second = f
		}
	}
	switch {
	case first == 0:
		return nil
	case second != 0 && first == 4:
		return families46
	case second != 0:
		return families64
	case first == 4:
		return families4
	}
	return families6
}

var (
	families4  = []int{4}
	families6  = []int{6}
	families46 = []int{4, 6}
	families64 = []int{6, 4}
)

// Family returns 4 or 6.
func Family(ip netip.Addr) int {
	if ip.Unmap().Is4() {
		return 4
	}
	return 6
}

// ReuseUnchanged replaces each port of next that equals its port in prev by
// prev's pointer. Sources call it before handing next on, so that consumers
// skip an unchanged port by comparing pointers: at 10k service ports,
// comparing and re-applying every port on every change took longer than the
// change itself. Ports are never modified once built, so sharing is safe.
func ReuseUnchanged(next, prev *State) {
	if prev == nil {
		return
	}
	for name, sp := range next.Ports {
		if old := prev.Ports[name]; old != nil && old.Equal(sp) {
			next.Ports[name] = old
		}
	}
}

// Endpoint is one backend address of a service port with its EndpointSlice conditions.
type Endpoint struct {
	Addr        netip.AddrPort
	Ready       bool
	Serving     bool
	Terminating bool
	NodeName    string
	// ZoneHints and NodeHints are the EndpointSlice's hints.forZones and
	// hints.forNodes, comma-separated (a string keeps Endpoint comparable).
	ZoneHints string
	NodeHints string
}

// hinted reports whether name is in the comma-separated list.
func hinted(list, name string) bool {
	for list != "" {
		var h string
		h, list, _ = strings.Cut(list, ",")
		if h == name {
			return true
		}
	}
	return false
}

func (e Endpoint) String() string {
	var state []string
	if e.Ready {
		state = append(state, "ready")
	}
	if e.Serving {
		state = append(state, "serving")
	}
	if e.Terminating {
		state = append(state, "terminating")
	}
	return fmt.Sprintf("%s(%s)", e.Addr, strings.Join(state, ","))
}

// UsableEndpoints applies kube-proxy's endpoint selection: ready endpoints; when
// none is ready, the serving and terminating ones (KEP-1669). When localOnly is
// set only endpoints whose NodeName is node count; otherwise topology hints
// narrow them (see TopologyMode). family (4 or 6) keeps only endpoints of that
// family; 0 keeps all.
func UsableEndpoints(eps []Endpoint, family int, localOnly bool, node, zone string) []netip.AddrPort {
	mode := ""
	if !localOnly {
		mode = TopologyMode(eps, family, node, zone)
	}
	var ready, fallback []netip.AddrPort
	for _, ep := range eps {
		if family != 0 && Family(ep.Addr.Addr()) != family {
			continue
		}
		if localOnly && ep.NodeName != node {
			continue
		}
		if !InTopology(ep, mode, node, zone) {
			continue
		}
		switch {
		case ep.Ready:
			ready = append(ready, ep.Addr)
		case ep.Serving && ep.Terminating:
			fallback = append(fallback, ep.Addr)
		}
	}
	if len(ready) > 0 {
		return ready
	}
	return fallback
}

// Topology modes: which hints narrow the endpoints.
const (
	TopologyNone = ""
	TopologyNode = "PreferSameNode" // hints.forNodes
	TopologyZone = "PreferSameZone" // hints.forZones
)

// TopologyMode is kube-proxy's choice of hints for a Service port's
// endpoints (of family, 0 for all): node hints when every ready endpoint has
// them and one is for this node; else zone hints when every ready endpoint
// has them and one is for this node's zone; else none, and every endpoint
// counts. Hints are what the EndpointSlice controller writes for
// spec.trafficDistribution (PreferSameZone, PreferClose, PreferSameNode).
func TopologyMode(eps []Endpoint, family int, node, zone string) string {
	allNode, allZone, forNode, forZone, any := true, true, false, false, false
	for _, ep := range eps {
		if !ep.Ready || (family != 0 && Family(ep.Addr.Addr()) != family) {
			continue
		}
		any = true
		if ep.NodeHints == "" {
			allNode = false
		} else if hinted(ep.NodeHints, node) {
			forNode = true
		}
		if ep.ZoneHints == "" {
			allZone = false
		} else if zone != "" && hinted(ep.ZoneHints, zone) {
			forZone = true
		}
	}
	switch {
	case !any:
		return TopologyNone
	case allNode && forNode:
		return TopologyNode
	case allZone && forZone:
		return TopologyZone
	}
	return TopologyNone
}

// InTopology reports whether ep is hinted for this node or zone under mode.
func InTopology(ep Endpoint, mode, node, zone string) bool {
	switch mode {
	case TopologyNode:
		return hinted(ep.NodeHints, node)
	case TopologyZone:
		return hinted(ep.ZoneHints, zone)
	}
	return true
}

// State is one complete, immutable view of every service port to proxy on this
// node. Sources build a new State for every change; nobody mutates one after
// it is handed over.
type State struct {
	Ports map[ServicePortName]*ServicePort
	// Node is the name this node is known by (endpoint nodeName), for traffic policies.
	Node string
	// Zone is this node's topology.kubernetes.io/zone label, for topology
	// hints ("" when unknown: zone hints are then not used).
	Zone string
	// NodeDeleting: this node's Node object is being deleted or carries the
	// cluster autoscaler's ToBeDeletedByClusterAutoscaler taint. /healthz
	// then fails, so that load balancers move traffic away first (/livez
	// does not).
	NodeDeleting bool
	// PodCIDRs are this node's Node's spec.podCIDRs (--detect-local-mode
	// NodeCIDR reads them at start).
	PodCIDRs []netip.Prefix

	// Seq numbers the States a source hands on (0: not numbered). When
	// Since is the Seq of the State this one was made from, Changed lists
	// the only ports that may differ from it (added, removed or changed): a
	// source that knows says so, and consumers need not compare every port
	// (at 10k service ports and 50 events a second, that comparison was most
	// of the daemon's CPU).
	Seq, Since uint64
	Changed    []ServicePortName
}

// Sorted returns the ports ordered by name.
func (s *State) Sorted() []*ServicePort {
	out := make([]*ServicePort, 0, len(s.Ports))
	for _, sp := range s.Ports {
		out = append(out, sp)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name.Less(out[j].Name) })
	return out
}

// Sink receives every new State. The proxier implements it; Update must not block
// on kernel work (it records the state and schedules a sync).
type Sink interface {
	Update(*State)
}
