package dataplane

import (
	"fmt"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// Traffic metrics, per service port ("namespace/name:port"). They are counted
// from the copy results, never by wrapping connections, so splice stays.
var (
	connsAccepted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_connections_accepted_total", Help: "TCP connections accepted.",
	}, []string{"service"})
	connsActive = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kube_userspace_proxy_connections_active", Help: "TCP connections open now.",
	}, []string{"service"})
	dialAttempts = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_dial_attempts_total", Help: "Dials to endpoints.",
	}, []string{"service", "endpoint"})
	dialFailures = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_dial_failures_total",
		Help: "Dials to endpoints that failed, by why: refused, timeout, unreachable, reset, file limit, cancelled, error.",
	}, []string{"service", "endpoint", "reason"})
	endpointEjections = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_endpoint_ejections_total",
		Help: "Times an endpoint was ejected from new picks after failures in a row (passive outlier detection).",
	}, []string{"service", "endpoint"})
	descriptorBudgetGauge = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kube_userspace_proxy_descriptor_budget",
		Help: "The descriptor budget: limit (RLIMIT_NOFILE), reserve (never for flows or connections), udp_flows (the share of all UDP flows together).",
	}, []string{"use"})
	udpFlowsTotal = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kube_userspace_proxy_udp_flows_open",
		Help: "UDP flows open now, all service ports together (each holds a descriptor; see kube_userspace_proxy_descriptor_budget).",
	}, func() float64 {
		var n int64
		running.each(func(d *Dataplane) { n += d.budget.udpFlows.Load() })
		return float64(n)
	})
	parkedSockets = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kube_userspace_proxy_tcp_parked_sockets",
		Help: "Sockets of TCP connections idle for longer than --park-idle-after, waiting in the parker's epoll set without a goroutine (two per fully idle connection).",
	}, func() float64 {
		var n int64
		running.each(func(d *Dataplane) { n += d.parker.Load().Parked() })
		return float64(n)
	})
	unredirectedResets = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_unredirected_connections_reset_total",
		Help: "TCP connections from other hosts that reached a proxy port directly, not through a rule, reset at accept (the guard without the conntrack match).",
	})
	unredirectedDatagrams = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_unredirected_datagrams_dropped_total",
		Help: "UDP datagrams from other hosts dropped because they reached a proxy port directly, not through a rule (the guard where the kernel has no conntrack match; its flows are asked of conntrack netlink).",
	})
	budgetRefusals = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_descriptor_budget_refusals_total",
		Help: "TCP connections reset at accept because they would have eaten into the descriptor reserve.",
	})
	udpEndpointErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_udp_endpoint_errors_total",
		Help: "Errors on UDP flows' endpoint sockets (ICMP port or host unreachable), by why: refused, unreachable, error.",
	}, []string{"service", "endpoint", "reason"})
	retries = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_retries_total", Help: "Dials retried on another endpoint after a failure.",
	}, []string{"service"})
	noEndpointResets = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_no_endpoints_resets_total", Help: "Connections reset (or datagrams dropped) because no endpoint was usable when they came; a port without endpoints refuses at connect, so these are the ones that came just before it did.",
	}, []string{"service", "protocol"})
	bytesTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_bytes_total", Help: "Bytes proxied; direction in = client to endpoint, out = endpoint to client.",
	}, []string{"service", "protocol", "direction"})
	udpFlowsActive = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kube_userspace_proxy_udp_flows_active", Help: "UDP flows open now.",
	}, []string{"service"})
	udpFlowsEvicted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_udp_flows_evicted_total", Help: "UDP flows evicted because the flow table was full.",
	}, []string{"service"})
	udpFlowsMoved = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_udp_flows_moved_total",
		Help: "UDP flows ended because their endpoint left the Service or stopped serving: the client's next datagram goes to another endpoint (kube-proxy's UDP conntrack cleanup).",
	}, []string{"service"})
	clientAddressAvailable = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kube_userspace_proxy_client_address_available",
		Help: "1 when backends can see their clients' own address in this family (the conntrack source NAT works here); 0: they see the node's.",
	}, []string{"ip_family"})
	backendSources = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_backend_source_total",
		Help: "TCP connections dialled, by the address their backend saw: client (the client's own), node (the node's, as kube-proxy's masquerade), fallback (the node's because the client's could not be set up).",
	}, []string{"source"})
	connDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "kube_userspace_proxy_connection_duration_seconds", Help: "How long proxied TCP connections lasted.",
		Buckets: prometheus.ExponentialBuckets(0.001, 4, 12),
	}, []string{"service"})
)

// feMetrics are one frontend's metrics, resolved once, on first use: looking
// labels up per datagram would cost more than the datagram, and creating them
// up front would cost memory and exposition lines for every service port,
// whether or not it ever saw traffic.
type feMetrics struct {
	service string
	proto   config.Protocol
	once    sync.Once
	series  *feSeries
}

type feSeries struct {
	accepted, retries, noEndpoints, evicted prometheus.Counter
	moved                                   prometheus.Counter
	bytesIn, bytesOut                       prometheus.Counter
	active, udpActive                       prometheus.Gauge
	duration                                prometheus.Observer
}

func newFEMetrics(service string, proto config.Protocol) *feMetrics {
	return &feMetrics{service: service, proto: proto}
}

// get returns the series, creating them the first time.
func (m *feMetrics) get() *feSeries {
	m.once.Do(func() {
		service, p := m.service, string(m.proto)
		// Only the series of the port's protocol: a UDP port has no
		// TCP connections to count, a TCP port no flows.
		fs := &feSeries{
			noEndpoints: noEndpointResets.WithLabelValues(service, p),
			bytesIn:     bytesTotal.WithLabelValues(service, p, "in"),
			bytesOut:    bytesTotal.WithLabelValues(service, p, "out"),
		}
		if m.proto == config.UDP {
			fs.evicted = udpFlowsEvicted.WithLabelValues(service)
			fs.moved = udpFlowsMoved.WithLabelValues(service)
			fs.udpActive = udpFlowsActive.WithLabelValues(service)
		} else {
			fs.accepted = connsAccepted.WithLabelValues(service)
			fs.retries = retries.WithLabelValues(service)
			fs.active = connsActive.WithLabelValues(service)
			fs.duration = connDuration.WithLabelValues(service)
		}
		m.series = fs
	})
	return m.series
}

// Collectors are the data path's metrics, for the daemon's registry.
func Collectors() []prometheus.Collector {
	return []prometheus.Collector{connsAccepted, connsActive, dialAttempts, dialFailures, retries, noEndpointResets,
		bytesTotal, udpFlowsActive, udpFlowsEvicted, udpFlowsMoved, connDuration, endpointEjections, udpEndpointErrors,
		descriptorBudgetGauge, udpFlowsTotal, parkedSockets, budgetRefusals, unredirectedResets, unredirectedDatagrams,
		clientAddressAvailable, backendSources}
}

// familyName is a family's ip_family label value.
func familyName(family int) string { return fmt.Sprintf("IPv%d", family) }

// ExposeFamilies makes the per-family series exist (at 0) for families, so
// that a family without the client's address reads 0, not absent.
func ExposeFamilies(families []int) {
	for _, fam := range families {
		clientAddressAvailable.WithLabelValues(familyName(fam))
	}
}

// DeleteServiceMetrics drops every series of a service port that is no
// longer served. Connections still draining keep counting into their
// detached series; a service that comes back starts from zero, which
// Prometheus reads as a counter reset.
func DeleteServiceMetrics(service string) {
	match := prometheus.Labels{"service": service}
	for _, v := range []interface{ DeletePartialMatch(prometheus.Labels) int }{
		connsAccepted, connsActive, dialAttempts, dialFailures, retries, noEndpointResets,
		bytesTotal, udpFlowsActive, udpFlowsEvicted, udpFlowsMoved, connDuration, endpointEjections, udpEndpointErrors,
	} {
		v.DeletePartialMatch(match)
	}
}

// running is the set of dataplanes between Start and Stop: the metrics
// computed at scrape time read their live state.
var running dataplaneSet

type dataplaneSet struct {
	mu sync.Mutex
	m  map[*Dataplane]bool
}

func (s *dataplaneSet) add(d *Dataplane) {
	s.mu.Lock()
	if s.m == nil {
		s.m = map[*Dataplane]bool{}
	}
	s.m[d] = true
	s.mu.Unlock()
}

func (s *dataplaneSet) remove(d *Dataplane) {
	s.mu.Lock()
	delete(s.m, d)
	s.mu.Unlock()
}

// each calls fn for every running dataplane; fn must not block.
func (s *dataplaneSet) each(fn func(*Dataplane)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for d := range s.m {
		fn(d)
	}
}
