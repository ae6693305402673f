package config

import (
	"errors"
	"fmt"
	"net/netip"
	"sort"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apivalidation "k8s.io/apimachinery/pkg/api/validation"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	metav1validation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// Labels kube-proxy uses to decide what it proxies.
const (
	LabelServiceProxyName = "service.kubernetes.io/service-proxy-name"
	LabelHeadless         = "service.kubernetes.io/headless"
	LabelServiceName      = discovery.LabelServiceName // "kubernetes.io/service-name"
)

// SkipReason says why a Service is not proxied, or "" when it is.
func SkipReason(svc *v1.Service) string {
	if _, ok := svc.Labels[LabelServiceProxyName]; ok {
		return "labelled " + LabelServiceProxyName + " (another proxy owns it)"
	}
	if _, ok := svc.Labels[LabelHeadless]; ok {
		return "labelled " + LabelHeadless // as kube-proxy's informers, which never see it
	}
	if svc.Spec.Type == v1.ServiceTypeExternalName {
		return "type ExternalName"
	}
	if svc.Spec.ClusterIP == "" || svc.Spec.ClusterIP == v1.ClusterIPNone {
		return "headless (no clusterIP)"
	}
	return ""
}

// SkipSlice says why an EndpointSlice is ignored, or "" when it is used.
func SkipSlice(es *discovery.EndpointSlice) string {
	if _, ok := es.Labels[LabelHeadless]; ok {
		return "labelled " + LabelHeadless
	}
	if es.Labels[LabelServiceName] == "" {
		return "no " + LabelServiceName + " label"
	}
	if es.AddressType == discovery.AddressTypeFQDN {
		return "addressType FQDN"
	}
	return ""
}

// AnnotationOutlierDetection set to "off" turns passive outlier detection off
// for one Service.
const AnnotationOutlierDetection = "kube-userspace-proxy.io/outlier-detection"

// AnnotationProxyProtocol "v1" or "v2" sends a PROXY protocol header with the
// client's address to the Service's TCP backends.
const AnnotationProxyProtocol = "kube-userspace-proxy.io/proxy-protocol"

// AnnotationScheduler chooses a Service's scheduler: rr, lc, sh or random.
const AnnotationScheduler = "kube-userspace-proxy.io/scheduler"

// AnnotationBackendSource "node" has a Service's backends see the node's
// address, never their clients' ("auto", the default: --backend-source-address).
const AnnotationBackendSource = "kube-userspace-proxy.io/backend-source-address"

// annotationPrefix is the prefix of every annotation this proxy reads.
const annotationPrefix = "kube-userspace-proxy.io/"

// ServicePorts converts one Service to its service ports (without endpoints).
// The caller has already checked SkipReason. An invalid address or port is an
// error naming the field.
func ServicePorts(svc *v1.Service) ([]*ServicePort, error) {
	base, err := serviceFields(svc)
	if err != nil {
		return nil, err
	}
	if len(svc.Spec.Ports) == 0 {
		return nil, errors.New("spec.ports: a Service with a clusterIP needs at least one port")
	}
	var out []*ServicePort
	for i, p := range svc.Spec.Ports {
		field := fmt.Sprintf("spec.ports[%d]", i)
		proto := Protocol(p.Protocol)
		if proto == "" {
			proto = TCP
		}
		switch proto {
		case TCP, UDP:
		case Protocol(v1.ProtocolSCTP):
			continue // not proxied, like the classic userspace mode
		default:
			return nil, fmt.Errorf("%s.protocol: %q is not TCP, UDP or SCTP", field, p.Protocol)
		}
		if p.Port < 1 || p.Port > 65535 {
			return nil, fmt.Errorf("%s.port: %d is outside 1..65535", field, p.Port)
		}
		if p.NodePort < 0 || p.NodePort > 65535 {
			return nil, fmt.Errorf("%s.nodePort: %d is outside 1..65535", field, p.NodePort)
		}
		if p.Name != "" {
			if err := validName(field+".name", p.Name, validation.IsDNS1123Label); err != nil {
				return nil, err
			}
		}
		if len(svc.Spec.Ports) > 1 && p.Name == "" {
			return nil, fmt.Errorf("%s.name: required when a Service has more than one port", field)
		}
		sp := *base
		sp.Name = ServicePortName{Namespace: svc.Namespace, Name: svc.Name, Port: p.Name}
		sp.Protocol, sp.Port = proto, int(p.Port)
		if svc.Spec.Type == v1.ServiceTypeNodePort || svc.Spec.Type == v1.ServiceTypeLoadBalancer {
			sp.NodePort = int(p.NodePort)
		}
		out = append(out, &sp)
	}
	return out, nil
}

// serviceFields returns the fields every port of svc shares.
func serviceFields(svc *v1.Service) (*ServicePort, error) {
	sp := &ServicePort{
		InternalLocal: svc.Spec.InternalTrafficPolicy != nil && *svc.Spec.InternalTrafficPolicy == v1.ServiceInternalTrafficPolicyLocal,
		ExternalLocal: svc.Spec.ExternalTrafficPolicy == v1.ServiceExternalTrafficPolicyLocal,

		OutlierDetection: svc.Annotations[AnnotationOutlierDetection],
		Scheduler:        svc.Annotations[AnnotationScheduler],
		ProxyProtocol:    svc.Annotations[AnnotationProxyProtocol],
		BackendSource:    svc.Annotations[AnnotationBackendSource],
		Created:          svc.CreationTimestamp.Time,

		HealthCheckNodePort: int(svc.Spec.HealthCheckNodePort),
	}
	if h := svc.Spec.HealthCheckNodePort; h < 0 || h > 65535 {
		return nil, fmt.Errorf("spec.healthCheckNodePort: %d is outside 1..65535", h)
	}
	var err error
	if sp.ClusterIPs, sp.ExternalIPs, sp.LoadBalancerIPs, err = serviceAddrs(svc); err != nil {
		return nil, err
	}
	if svc.Spec.SessionAffinity == v1.ServiceAffinityClientIP {
		sp.AffinityTimeout = DefaultAffinityTimeout
		if c := svc.Spec.SessionAffinityConfig; c != nil && c.ClientIP != nil && c.ClientIP.TimeoutSeconds != nil {
			secs := *c.ClientIP.TimeoutSeconds
			if secs <= 0 || secs > 86400 {
				return nil, fmt.Errorf("spec.sessionAffinityConfig.clientIP.timeoutSeconds: %d is outside 1..86400", secs)
			}
			sp.AffinityTimeout = time.Duration(secs) * time.Second
		}
	}
	for i, r := range svc.Spec.LoadBalancerSourceRanges {
		p, err := netip.ParsePrefix(strings.TrimSpace(r))
		if err != nil {
			return nil, fmt.Errorf("spec.loadBalancerSourceRanges[%d]: %q is not a CIDR", i, r)
		}
		sp.SourceRanges = append(sp.SourceRanges, p.Masked())
	}
	if svc.Spec.TrafficDistribution != nil {
		sp.TrafficDistribution = *svc.Spec.TrafficDistribution
	}
	return sp, nil
}

// serviceAddrs returns the addresses svc answers on.
func serviceAddrs(svc *v1.Service) (clusterIPs, externalIPs, lbIPs []netip.Addr, err error) {
	if clusterIPs, err = parseAddrs("spec.clusterIPs", svc.Spec.ClusterIPs); err != nil {
		return nil, nil, nil, err
	}
	if len(clusterIPs) == 0 {
		ip, err := parseAddr("spec.clusterIP", svc.Spec.ClusterIP)
		if err != nil {
			return nil, nil, nil, err
		}
		clusterIPs = []netip.Addr{ip}
	}
	if externalIPs, err = parseAddrs("spec.externalIPs", svc.Spec.ExternalIPs); err != nil {
		return nil, nil, nil, err
	}
	for i, ing := range svc.Status.LoadBalancer.Ingress {
		if ing.IP == "" || (ing.IPMode != nil && *ing.IPMode == v1.LoadBalancerIPModeProxy) {
			continue
		}
		ip, err := parseAddr(fmt.Sprintf("status.loadBalancer.ingress[%d].ip", i), ing.IP)
		if err != nil {
			return nil, nil, nil, err
		}
		lbIPs = append(lbIPs, ip)
	}
	return clusterIPs, externalIPs, lbIPs, nil
}

// SliceEndpoints returns the endpoints an EndpointSlice gives each named port.
func SliceEndpoints(es *discovery.EndpointSlice) (map[string][]Endpoint, error) {
	switch es.AddressType {
	case discovery.AddressTypeIPv4, discovery.AddressTypeIPv6:
	default:
		return nil, fmt.Errorf("addressType: %q is not IPv4 or IPv6", es.AddressType)
	}
	out := make(map[string][]Endpoint)
	for pi, p := range es.Ports {
		if p.Port == nil {
			continue
		}
		if *p.Port < 1 || *p.Port > 65535 {
			return nil, fmt.Errorf("ports[%d].port: %d is outside 1..65535", pi, *p.Port)
		}
		name := ""
		if p.Name != nil {
			name = *p.Name
		}
		if name != "" {
			if err := validName(fmt.Sprintf("ports[%d].name", pi), name, validation.IsDNS1123Label); err != nil {
				return nil, err
			}
		}
		for ei, ep := range es.Endpoints {
			ready := ep.Conditions.Ready == nil || *ep.Conditions.Ready
			serving := ready
			if ep.Conditions.Serving != nil {
				serving = *ep.Conditions.Serving
			}
			terminating := ep.Conditions.Terminating != nil && *ep.Conditions.Terminating
			node := ""
			if ep.NodeName != nil {
				node = *ep.NodeName
			}
			var zoneHints, nodeHints []string
			if h := ep.Hints; h != nil {
				for _, z := range h.ForZones {
					zoneHints = append(zoneHints, z.Name)
				}
				for _, n := range h.ForNodes {
					nodeHints = append(nodeHints, n.Name)
				}
			}
			for ai, a := range ep.Addresses {
				ip, err := netip.ParseAddr(a) // the field's name is formatted only for an error
				if err != nil {
					return nil, fmt.Errorf("endpoints[%d].addresses[%d]: %q is not an IP address", ei, ai, a)
				}
				ip = ip.Unmap()
				if (Family(ip) == 4) != (es.AddressType == discovery.AddressTypeIPv4) {
					return nil, fmt.Errorf("endpoints[%d].addresses[%d]: %s does not match addressType %s", ei, ai, a, es.AddressType)
				}
				out[name] = append(out[name], Endpoint{
					Addr:  netip.AddrPortFrom(ip, uint16(*p.Port)),
					Ready: ready, Serving: serving, Terminating: terminating, NodeName: node,
					ZoneHints: strings.Join(zoneHints, ","), NodeHints: strings.Join(nodeHints, ","),
				})
				break // kube-proxy uses only the first address of an endpoint
			}
		}
	}
	return out, nil
}

// Builder accumulates Services and EndpointSlices and produces a State. Both
// sources use it so that they apply exactly the same rules.
type Builder struct {
	node     string
	ports    map[ServicePortName]*ServicePort
	services map[ServiceName][]*ServicePort
	// endpoints by namespace/service, then by port name
	endpoints map[ServiceName]map[string][]Endpoint
}

// NewBuilder starts an empty State for the named node.
func NewBuilder(node string) *Builder {
	return &Builder{
		node:      node,
		ports:     make(map[ServicePortName]*ServicePort),
		services:  make(map[ServiceName][]*ServicePort),
		endpoints: make(map[ServiceName]map[string][]Endpoint),
	}
}

// AddService adds a Service. It returns skip != "" when the Service is not
// proxied, and an error when it is invalid.
func (b *Builder) AddService(svc *v1.Service) (skip string, err error) {
	key, sps, skip, err := convertService(svc)
	if skip != "" || err != nil {
		return skip, err
	}
	return "", b.addPorts(key, sps)
}

// UnservedPorts names the ports of svc that this proxy does not serve
// (SCTP: the classic userspace mode never proxied it), for the warning
// its owner must see instead of silence.
func UnservedPorts(svc *v1.Service) []string {
	var out []string
	for _, p := range svc.Spec.Ports {
		if p.Protocol == v1.ProtocolSCTP {
			name := p.Name
			if name == "" {
				name = "(unnamed)"
			}
			out = append(out, fmt.Sprintf("%s %d/SCTP", name, p.Port))
		}
	}
	return out
}

// UnservedMessage is the warning for UnservedPorts.
func UnservedMessage(ports []string) string {
	return "SCTP is not proxied by kube-userspace-proxy: no listener or rule for port " + strings.Join(ports, ", ")
}

// convertService is the one conversion of a Service into the model, for
// both sources: its namespace/name and ports, or why it is skipped.
func convertService(svc *v1.Service) (key ServiceName, sps []*ServicePort, skip string, err error) {
	if skip := SkipReason(svc); skip != "" {
		return key, nil, skip, nil
	}
	if svc.Name == "" {
		return key, nil, "", errors.New("metadata.name: required")
	}
	// As the API server validates: a name it would refuse also makes rule
	// comments that iptables-nft rewrites, which would never match ours.
	if err := validName("metadata.name", svc.Name, validation.IsDNS1035Label); err != nil {
		return key, nil, "", err
	}
	if err := validName("metadata.namespace", svc.Namespace, validation.IsDNS1123Label); err != nil {
		return key, nil, "", err
	}
	if err := validMeta(svc.ObjectMeta); err != nil {
		return key, nil, "", err
	}
	sps, err = ServicePorts(svc)
	return ServiceName{svc.Namespace, svc.Name}, sps, "", err
}

func (b *Builder) addPorts(key ServiceName, sps []*ServicePort) error {
	if _, dup := b.services[key]; dup {
		return fmt.Errorf("Service %s is defined twice", key)
	}
	b.services[key] = sps
	for _, sp := range sps {
		b.ports[sp.Name] = sp
	}
	return nil
}

// AddSlice adds an EndpointSlice, joined to its Service by the service-name label.
func (b *Builder) AddSlice(es *discovery.EndpointSlice) (skip string, err error) {
	key, eps, skip, err := convertSlice(es)
	if skip != "" || err != nil {
		return skip, err
	}
	b.addEndpoints(key, eps)
	return "", nil
}

// convertSlice is the one conversion of an EndpointSlice into the model, for
// both sources: its Service's namespace/name and endpoints by port name, or
// why it is skipped.
func convertSlice(es *discovery.EndpointSlice) (key ServiceName, eps map[string][]Endpoint, skip string, err error) {
	if skip := SkipSlice(es); skip != "" {
		return key, nil, skip, nil
	}
	if err := validName("metadata.namespace", es.Namespace, validation.IsDNS1123Label); err != nil {
		return key, nil, "", err
	}
	if err := validName("metadata.labels["+LabelServiceName+"]", es.Labels[LabelServiceName], validation.IsDNS1035Label); err != nil {
		return key, nil, "", err
	}
	if err := validMeta(es.ObjectMeta); err != nil {
		return key, nil, "", err
	}
	eps, err = SliceEndpoints(es)
	return ServiceName{es.Namespace, es.Labels[LabelServiceName]}, eps, "", err
}

func (b *Builder) addEndpoints(key ServiceName, eps map[string][]Endpoint) {
	m := b.endpoints[key]
	if m == nil {
		m = make(map[string][]Endpoint)
		b.endpoints[key] = m
	}
	for port, list := range eps {
		m[port] = append(m[port], list...)
	}
}

// State joins endpoints to service ports and returns the finished State. The
// ports are copies: what was added stays untouched (sources cache it).
func (b *Builder) State() *State {
	ports := make(map[ServicePortName]*ServicePort, len(b.ports))
	for key, sps := range b.services {
		byPort := b.endpoints[key]
		for _, sp := range sps {
			c := *sp
			c.Endpoints = dedupEndpoints(byPort[sp.Name.Port])
			ports[c.Name] = &c
		}
	}
	return &State{Ports: ports, Node: b.node}
}

// dedupEndpoints sorts endpoints by address and keeps one per address,
// preferring the ready one (an endpoint can sit in two slices during a move).
func dedupEndpoints(eps []Endpoint) []Endpoint {
	if len(eps) == 0 {
		return nil
	}
	sorted := append([]Endpoint(nil), eps...)
	sort.SliceStable(sorted, func(i, j int) bool { return sorted[i].Addr.Compare(sorted[j].Addr) < 0 })
	out := sorted[:0]
	for _, ep := range sorted {
		if n := len(out); n > 0 && out[n-1].Addr == ep.Addr {
			if ep.Ready && !out[n-1].Ready {
				out[n-1] = ep
			}
			continue
		}
		out = append(out, ep)
	}
	return out
}

func parseAddr(field, s string) (netip.Addr, error) {
	ip, err := netip.ParseAddr(s)
	if err != nil || ip.Zone() != "" {
		return netip.Addr{}, fmt.Errorf("%s: %q is not an IP address (without a zone)", field, s)
	}
	return ip.Unmap(), nil
}

// validName applies one of apimachinery's name validations.
// validMeta checks an object's labels and annotations as the API server
// does (key syntax, label values, the annotations' total size): the
// manifests get no API server to do it.
func validMeta(m metav1.ObjectMeta) error {
	errs := metav1validation.ValidateLabels(m.Labels, field.NewPath("metadata", "labels"))
	errs = append(errs, apivalidation.ValidateAnnotations(m.Annotations, field.NewPath("metadata", "annotations"))...)
	return errs.ToAggregate()
}

func validName(field, name string, check func(string) []string) error {
	if errs := check(name); len(errs) > 0 {
		shown := name
		if len(shown) > 70 {
			shown = shown[:67] + "..."
		}
		return fmt.Errorf("%s: %q: %s", field, shown, strings.Join(errs, "; "))
	}
	return nil
}

func parseAddrs(field string, ss []string) ([]netip.Addr, error) {
	var out []netip.Addr
	for i, s := range ss {
		ip, err := parseAddr(fmt.Sprintf("%s[%d]", field, i), s)
		if err != nil {
			return nil, err
		}
		out = append(out, ip)
	}
	return out, nil
}
