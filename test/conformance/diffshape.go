package main

import (
	"fmt"
	"math/rand"
	"sort"
	"strings"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

// A shape is one Service with its EndpointSlices, as the differential run
// draws it: everything a proxy reads, and nothing the lab decides (the
// cluster IP and node ports are allocated by the API server). Endpoints
// are pods of a fixed pool (diffPool), so that a shape costs API objects
// only, never a pod start. A shape may carry an edit: the second state
// the same Service is moved to, observed again.
type shape struct {
	Seed int64 `json:"seed"`
	Case int   `json:"case"`

	Type        v1.ServiceType `json:"type"`
	Headless    bool           `json:"headless,omitempty"`
	OtherProxy  bool           `json:"otherProxy,omitempty"` // service.kubernetes.io/service-proxy-name: another proxy's
	ExternalIP  bool           `json:"externalIP,omitempty"`
	LBIP        bool           `json:"lbIP,omitempty"`        // LoadBalancer only: an ingress IP the test writes in the status
	SourceRange string         `json:"sourceRange,omitempty"` // LoadBalancer only: "", "allow" (the outside client) or "deny" (another range)
	ETPLocal    bool           `json:"etpLocal,omitempty"`
	ITPLocal    bool           `json:"itpLocal,omitempty"`
	Affinity    int32          `json:"affinity,omitempty"`  // ClientIP affinity's timeout in seconds; 0: none
	DualStack   bool           `json:"dualStack,omitempty"` // ipFamilyPolicy PreferDualStack (the lab is IPv4: one family results)
	PreferClose bool           `json:"preferClose,omitempty"`
	Ports       []shapePort    `json:"ports"`
	Endpoints   []shapeEP      `json:"endpoints"`
	Edit        *shapeEdit     `json:"edit,omitempty"`
}

// shapePort is one Service port. Its endpoints listen on 8080 (TCP) or
// 8081 (UDP), or 9080/9081 on the pods whose endpoint is Alt: a named
// target port resolved to a different number per pod.
type shapePort struct {
	Name  string      `json:"name"`
	Slice string      `json:"slice,omitempty"` // the name its EndpointSlices give it, when an edit renamed it
	Proto v1.Protocol `json:"proto"`
	Port  int32       `json:"port"`
	Named bool        `json:"named,omitempty"`
}

// shapeEP is one endpoint: a pool pod and its conditions.
type shapeEP struct {
	Pod         int    `json:"pod"` // index into diffPool
	Alt         bool   `json:"alt,omitempty"`
	Ready       bool   `json:"ready"`
	Serving     bool   `json:"serving"`
	Terminating bool   `json:"terminating,omitempty"`
	Hint        string `json:"hint,omitempty"` // a zone, or none
}

// shapeEdit is what happens to the Service between its two observations.
type shapeEdit struct {
	Kind string `json:"kind"` // scale-up, scale-down, rename-port, flip-policy, terminate
	EP   int    `json:"ep,omitempty"`
}

// The pool: two pods on each of the three nodes, each running agnhost
// netexec twice (HTTP 8080 and UDP 8081; HTTP 9080 and UDP 9081).
var diffPool = []struct {
	name string
	node int
}{
	{"pool-1a", 1}, {"pool-1b", 1}, {"pool-2a", 2}, {"pool-2b", 2}, {"pool-3a", 3}, {"pool-3b", 3},
}

// The nodes' zones (topology.kubernetes.io/zone): two share one.
var diffZones = []string{"", "zone-a", "zone-b", "zone-a"}

const (
	diffNamespace   = "diff"
	diffExternalNet = "203.0.113."   // externalIPs, routed by the lab's network to node 1
	diffLBNet       = "198.51.100."  // load-balancer IPs, routed to node 2
	diffDenyRange   = "192.0.2.0/24" // a source range the outside client is not in
	diffManagedBy   = "differential.kube-userspace-proxy"
)

// generate draws the case-th shape of seed. Same seed and case, same shape.
func generate(seed int64, c int) shape {
	r := rand.New(rand.NewSource(seed*1_000_003 + int64(c)))
	s := shape{Seed: seed, Case: c}
	switch r.Intn(10) {
	case 0, 1, 2:
		s.Type = v1.ServiceTypeClusterIP
	case 3, 4, 5:
		s.Type = v1.ServiceTypeNodePort
	default:
		s.Type = v1.ServiceTypeLoadBalancer
	}
	switch r.Intn(20) {
	case 0:
		s.Headless, s.Type = true, v1.ServiceTypeClusterIP
	case 1:
		s.OtherProxy = true
	}
	s.ExternalIP = !s.Headless && r.Intn(4) == 0
	if s.Type == v1.ServiceTypeLoadBalancer {
		s.LBIP = r.Intn(5) > 0
		if s.LBIP {
			s.SourceRange = []string{"", "", "allow", "deny"}[r.Intn(4)]
		}
	}
	external := s.Type != v1.ServiceTypeClusterIP || s.ExternalIP
	s.ETPLocal = external && r.Intn(3) == 0
	s.ITPLocal = !s.Headless && r.Intn(5) == 0
	if !s.Headless && r.Intn(4) == 0 {
		s.Affinity = []int32{10800, 60, 5}[r.Intn(3)]
	}
	s.DualStack = r.Intn(6) == 0
	s.PreferClose = r.Intn(5) == 0
	nports := 1 + r.Intn(3)
	used := map[int32]bool{}
	for i := 0; i < nports; i++ {
		p := shapePort{Name: fmt.Sprintf("p%d", i), Proto: v1.ProtocolTCP, Named: r.Intn(2) == 0}
		if r.Intn(3) == 0 {
			p.Proto = v1.ProtocolUDP
		}
		for p.Port == 0 || used[p.Port] {
			p.Port = []int32{80, 53, 443, 8080, 5000, 7}[r.Intn(6)]
		}
		used[p.Port] = true
		s.Ports = append(s.Ports, p)
	}
	alt := r.Intn(3) == 0 // some pods resolve the named port to 9080
	for _, pod := range r.Perm(len(diffPool))[:r.Intn(5)] {
		ep := shapeEP{Pod: pod, Alt: alt && r.Intn(2) == 0, Ready: true, Serving: true}
		switch r.Intn(8) {
		case 0: // terminating but still serving
			ep.Ready, ep.Terminating = false, true
		case 1: // terminating, no longer serving
			ep.Ready, ep.Serving, ep.Terminating = false, false, true
		case 2: // not ready (starting)
			ep.Ready, ep.Serving = false, false
		}
		s.Endpoints = append(s.Endpoints, ep)
	}
	if s.PreferClose {
		all := r.Intn(3) > 0 // a slice with hints on some endpoints only is ignored by kube-proxy
		for i := range s.Endpoints {
			if all || r.Intn(2) == 0 {
				s.Endpoints[i].Hint = diffZones[diffPool[s.Endpoints[i].Pod].node]
			}
		}
	}
	if r.Intn(3) == 0 {
		kinds := []string{"scale-up", "scale-down", "rename-port", "flip-policy", "terminate"}
		e := &shapeEdit{Kind: kinds[r.Intn(len(kinds))]}
		if len(s.Endpoints) > 0 {
			e.EP = r.Intn(len(s.Endpoints))
		}
		if (e.Kind == "scale-down" || e.Kind == "terminate") && len(s.Endpoints) == 0 {
			e.Kind = "scale-up"
		}
		s.Edit = e
	}
	return s
}

// edited is the shape after its edit.
func (s shape) edited() shape {
	n := s.clone()
	n.Edit = nil
	switch s.Edit.Kind {
	case "scale-up":
		inUse := map[int]bool{}
		for _, ep := range n.Endpoints {
			inUse[ep.Pod] = true
		}
		for i := range diffPool {
			if !inUse[i] {
				n.Endpoints = append(n.Endpoints, shapeEP{Pod: i, Ready: true, Serving: true})
				break
			}
		}
	case "scale-down":
		n.Endpoints = append(n.Endpoints[:s.Edit.EP:s.Edit.EP], n.Endpoints[s.Edit.EP+1:]...)
	case "rename-port": // the Service's port only: its endpoints no longer match it
		n.Ports[0].Slice = n.Ports[0].Name
		n.Ports[0].Name += "x"
	case "flip-policy":
		n.ETPLocal = !n.ETPLocal && (n.Type != v1.ServiceTypeClusterIP || n.ExternalIP)
		n.ITPLocal = !n.ITPLocal && !n.Headless
	case "terminate":
		ep := &n.Endpoints[s.Edit.EP]
		ep.Ready, ep.Terminating = false, true
	}
	return n
}

func (s shape) clone() shape {
	n := s
	n.Ports = append([]shapePort(nil), s.Ports...)
	n.Endpoints = append([]shapeEP(nil), s.Endpoints...)
	if s.Edit != nil {
		e := *s.Edit
		n.Edit = &e
	}
	return n
}

// name is the Service's name: unique per case within a run.
func (s shape) name() string { return fmt.Sprintf("s%d", s.Case) }

// size orders shapes for shrinking: fewer is smaller.
func (s shape) size() int {
	n := len(s.Ports)*4 + len(s.Endpoints)*3
	for _, b := range []bool{s.ExternalIP, s.LBIP, s.SourceRange != "", s.ETPLocal, s.ITPLocal, s.Affinity != 0,
		s.DualStack, s.PreferClose, s.Edit != nil, s.Headless, s.OtherProxy} {
		if b {
			n++
		}
	}
	switch s.Type {
	case v1.ServiceTypeNodePort:
		n++
	case v1.ServiceTypeLoadBalancer:
		n += 2
	}
	return n
}

// smaller lists the shapes one step smaller than s: a port, an endpoint or
// a feature fewer.
func (s shape) smaller() []shape {
	var out []shape
	add := func(f func(n *shape)) {
		n := s.clone()
		f(&n)
		if n.size() < s.size() && n.valid() {
			out = append(out, n)
		}
	}
	for i := range s.Ports {
		add(func(n *shape) { n.Ports = append(n.Ports[:i:i], n.Ports[i+1:]...) })
	}
	for i := range s.Endpoints {
		add(func(n *shape) {
			n.Endpoints = append(n.Endpoints[:i:i], n.Endpoints[i+1:]...)
			if n.Edit != nil && n.Edit.EP >= len(n.Endpoints) {
				n.Edit = nil
			}
		})
	}
	add(func(n *shape) { n.Edit = nil })
	add(func(n *shape) { n.ExternalIP = false })
	add(func(n *shape) { n.LBIP, n.SourceRange = false, "" })
	add(func(n *shape) { n.SourceRange = "" })
	add(func(n *shape) { n.ETPLocal = false })
	add(func(n *shape) { n.ITPLocal = false })
	add(func(n *shape) { n.Affinity = 0 })
	add(func(n *shape) { n.DualStack = false })
	add(func(n *shape) {
		n.PreferClose = false
		for i := range n.Endpoints {
			n.Endpoints[i].Hint = ""
		}
	})
	add(func(n *shape) { n.Headless = false })
	add(func(n *shape) { n.OtherProxy = false })
	add(func(n *shape) {
		switch n.Type {
		case v1.ServiceTypeLoadBalancer:
			n.Type, n.LBIP, n.SourceRange = v1.ServiceTypeNodePort, false, ""
		case v1.ServiceTypeNodePort:
			n.Type = v1.ServiceTypeClusterIP
		}
		n.ETPLocal = n.ETPLocal && n.ExternalIP
	})
	return out
}

// valid says whether the API server would take the shape.
func (s shape) valid() bool {
	if len(s.Ports) == 0 {
		return false
	}
	external := s.Type != v1.ServiceTypeClusterIP || s.ExternalIP
	if s.ETPLocal && !external {
		return false
	}
	if s.Headless && (s.Type != v1.ServiceTypeClusterIP || s.Affinity != 0 || s.ITPLocal) {
		return false
	}
	if (s.LBIP || s.SourceRange != "") && s.Type != v1.ServiceTypeLoadBalancer {
		return false
	}
	if s.SourceRange != "" && !s.LBIP {
		return false
	}
	if s.Edit != nil && (s.Edit.Kind == "scale-down" || s.Edit.Kind == "terminate") && s.Edit.EP >= len(s.Endpoints) {
		return false
	}
	return true
}

// externalIP and lbIP are the shape's addresses outside the Service CIDR.
func (s shape) externalIP() string { return fmt.Sprintf("%s%d", diffExternalNet, 10+s.Case%200) }
func (s shape) lbIP() string       { return fmt.Sprintf("%s%d", diffLBNet, 10+s.Case%200) }

// service is the shape's Service object.
func (s shape) service() *v1.Service {
	svc := &v1.Service{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Service"},
		ObjectMeta: metav1.ObjectMeta{Name: s.name(), Namespace: diffNamespace, Labels: map[string]string{"differential": "yes"}},
		Spec:       v1.ServiceSpec{Type: s.Type},
	}
	if s.OtherProxy {
		svc.Labels["service.kubernetes.io/service-proxy-name"] = "another-proxy"
	}
	if s.Headless {
		svc.Spec.ClusterIP = v1.ClusterIPNone
	}
	if s.ExternalIP {
		svc.Spec.ExternalIPs = []string{s.externalIP()}
	}
	switch s.SourceRange {
	case "allow":
		svc.Spec.LoadBalancerSourceRanges = []string{bridgeAddr + "/32"}
	case "deny":
		svc.Spec.LoadBalancerSourceRanges = []string{diffDenyRange}
	}
	if s.ETPLocal {
		svc.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
	}
	if s.ITPLocal {
		l := v1.ServiceInternalTrafficPolicyLocal
		svc.Spec.InternalTrafficPolicy = &l
	}
	if s.Affinity != 0 {
		svc.Spec.SessionAffinity = v1.ServiceAffinityClientIP
		t := s.Affinity
		svc.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: &t}}
	}
	if s.DualStack {
		p := v1.IPFamilyPolicyPreferDualStack
		svc.Spec.IPFamilyPolicy = &p
	}
	if s.PreferClose {
		d := v1.ServiceTrafficDistributionPreferSameZone
		svc.Spec.TrafficDistribution = &d
	}
	for _, p := range s.Ports {
		target := intstr.FromInt32(targetPort(p.Proto, false))
		if p.Named {
			target = intstr.FromString("t-" + p.Name)
		}
		svc.Spec.Ports = append(svc.Spec.Ports, v1.ServicePort{Name: p.Name, Protocol: p.Proto, Port: p.Port, TargetPort: target})
	}
	return svc
}

func targetPort(proto v1.Protocol, alt bool) int32 {
	p := int32(8080)
	if proto == v1.ProtocolUDP {
		p = 8081
	}
	if alt {
		p += 1000
	}
	return p
}

// slices are the shape's EndpointSlices: one for the endpoints on the
// usual ports, one for those on the alternative ones. ips maps a pool
// pod's name to its address.
func (s shape) slices(ips map[string]string) []*discovery.EndpointSlice {
	var out []*discovery.EndpointSlice
	for _, alt := range []bool{false, true} {
		sl := &discovery.EndpointSlice{
			TypeMeta: metav1.TypeMeta{APIVersion: "discovery.k8s.io/v1", Kind: "EndpointSlice"},
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%t", s.name(), alt), Namespace: diffNamespace, Labels: map[string]string{
				discovery.LabelServiceName: s.name(), discovery.LabelManagedBy: diffManagedBy,
			}},
			AddressType: discovery.AddressTypeIPv4,
		}
		for _, p := range s.Ports {
			name, proto, port := p.Name, p.Proto, targetPort(p.Proto, alt)
			if p.Slice != "" {
				name = p.Slice
			}
			sl.Ports = append(sl.Ports, discovery.EndpointPort{Name: &name, Protocol: &proto, Port: &port})
		}
		for _, ep := range s.Endpoints {
			if ep.Alt != alt {
				continue
			}
			pod := diffPool[ep.Pod]
			ready, serving, terminating := ep.Ready, ep.Serving, ep.Terminating
			e := discovery.Endpoint{
				Addresses:  []string{ips[pod.name]},
				Conditions: discovery.EndpointConditions{Ready: &ready, Serving: &serving, Terminating: &terminating},
				NodeName:   ptr(nodeName(pod.node)),
				Zone:       ptr(diffZones[pod.node]),
				TargetRef:  &v1.ObjectReference{Kind: "Pod", Namespace: diffNamespace, Name: pod.name},
			}
			if ep.Hint != "" {
				e.Hints = &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: ep.Hint}}}
			}
			sl.Endpoints = append(sl.Endpoints, e)
		}
		out = append(out, sl)
	}
	return out
}

func ptr[T any](v T) *T { return &v }

// yaml is the shape as the objects a user would apply, for a reproduction.
func (s shape) yaml(ips map[string]string) string {
	var b strings.Builder
	for _, o := range append([]any{s.service()}, toAny(s.slices(ips))...) {
		data, err := yaml.Marshal(o)
		if err != nil {
			return err.Error()
		}
		b.WriteString("---\n")
		b.Write(data)
	}
	return b.String()
}

func toAny[T any](v []T) []any {
	out := make([]any, len(v))
	for i := range v {
		out[i] = v[i]
	}
	return out
}

// describe is the shape on one line: what known differences match.
func (s shape) describe() string {
	var f []string
	f = append(f, "type="+string(s.Type))
	flag := func(b bool, name string) {
		if b {
			f = append(f, name)
		}
	}
	flag(s.Headless, "headless")
	flag(s.OtherProxy, "other-proxy")
	flag(s.ExternalIP, "external-ip")
	flag(s.LBIP, "lb-ip")
	if s.SourceRange != "" {
		f = append(f, "source-range="+s.SourceRange)
	}
	flag(s.ETPLocal, "etp=Local")
	flag(s.ITPLocal, "itp=Local")
	if s.Affinity != 0 {
		f = append(f, fmt.Sprintf("affinity=%ds", s.Affinity))
	}
	flag(s.DualStack, "prefer-dual-stack")
	flag(s.PreferClose, "prefer-close")
	var eps []string
	for _, ep := range s.Endpoints {
		st := "ready"
		switch {
		case ep.Terminating && ep.Serving:
			st = "terminating-serving"
		case ep.Terminating:
			st = "terminating"
		case !ep.Ready:
			st = "not-ready"
		}
		if ep.Hint != "" {
			st += "/hint=" + ep.Hint
		}
		eps = append(eps, diffPool[ep.Pod].name+":"+st)
	}
	sort.Strings(eps)
	f = append(f, "endpoints=["+strings.Join(eps, ",")+"]")
	if s.Edit != nil {
		f = append(f, "edit="+s.Edit.Kind)
	}
	return strings.Join(f, " ")
}
