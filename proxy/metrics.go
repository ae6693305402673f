package proxy

import (
	"fmt"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// Sync metrics keep kube-proxy's names and labels, so existing dashboards
// work. kube-proxy runs one proxier per IP family; one sync here serves
// both, so each is observed under every family served (ip_family: IPv4,
// IPv6). Full syncs visit every service port, partial ones the changed only.
var (
	familyLabel  = []string{"ip_family"}
	syncDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "kubeproxy_sync_proxy_rules_duration_seconds", Help: "How long one sync of listeners and rules took.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 15),
	}, familyLabel)
	syncFullDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "kubeproxy_sync_full_proxy_rules_duration_seconds", Help: "How long one sync that visited every service port took.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 15),
	}, familyLabel)
	syncPartialDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "kubeproxy_sync_partial_proxy_rules_duration_seconds", Help: "How long one sync of the changed service ports took.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 15),
	}, familyLabel)
	syncLast = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kubeproxy_sync_proxy_rules_last_timestamp_seconds", Help: "When the last successful sync ended.",
	}, familyLabel)
	syncLastQueued = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", Help: "When the last change was queued for a sync.",
	}, familyLabel)
	programmingDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "kubeproxy_network_programming_duration_seconds", Help: "From a change reaching the proxy to it being served.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 18),
	}, familyLabel)
	serviceChangesPending = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kubeproxy_sync_proxy_rules_service_changes_pending", Help: "Service ports changed but not yet synced.",
	})
	serviceChangesTotal = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kubeproxy_sync_proxy_rules_service_changes_total", Help: "Service ports added, removed or changed.",
	})
	endpointChangesPending = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kubeproxy_sync_proxy_rules_endpoint_changes_pending", Help: "Service ports whose endpoints changed but are not yet synced.",
	})
	endpointChangesTotal = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kubeproxy_sync_proxy_rules_endpoint_changes_total", Help: "Service ports whose endpoints changed.",
	})
)

// familyNames are the ip_family label values of the families served.
func familyNames(families []int) []string {
	if families == nil {
		families = []int{4, 6}
	}
	out := make([]string, 0, len(families))
	for _, f := range families {
		out = append(out, fmt.Sprintf("IPv%d", f))
	}
	return out
}

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
		running.each(func(p *Proxier) { n += p.dp.budget.udpFlows.Load() })
		return float64(n)
	})
	parkedSockets = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kube_userspace_proxy_tcp_parked_sockets",
		Help: "Sockets of TCP connections idle for longer than --park-idle-after, waiting in the parker's epoll set without a goroutine (two per fully idle connection).",
	}, func() float64 {
		var n int64
		running.each(func(p *Proxier) { n += p.dp.parker.Load().Parked() })
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
	listenerFailures = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kube_userspace_proxy_listener_failures",
		Help: "Listeners the last sync could not open (port range exhausted, out of descriptors, bind address): /healthz is 503 while any.",
	})
	nodePortConflicts = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kube_userspace_proxy_nodeport_conflicts",
		Help: "Listeners whose NodePort another process or an older Service holds; retried every sync.",
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
	}, familyLabel)
	backendSources = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_backend_source_total",
		Help: "TCP connections dialled, by the address their backend saw: client (the client's own), node (the node's, as kube-proxy's masquerade), fallback (the node's because the client's could not be set up).",
	}, []string{"source"})
	connDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "kube_userspace_proxy_connection_duration_seconds", Help: "How long proxied TCP connections lasted.",
		Buckets: prometheus.ExponentialBuckets(0.001, 4, 12),
	}, []string{"service"})
)

// RegisterMetrics adds the proxier's metrics to reg.
func RegisterMetrics(reg prometheus.Registerer) {
	reg.MustRegister(syncDuration, syncFullDuration, syncPartialDuration, syncLast, syncLastQueued, programmingDuration, noLocal,
		serviceChangesPending, serviceChangesTotal, endpointChangesPending, endpointChangesTotal,
		connsAccepted, connsActive, dialAttempts, dialFailures, retries, noEndpointResets,
		bytesTotal, udpFlowsActive, udpFlowsEvicted, udpFlowsMoved, connDuration,
		endpointEjections, udpEndpointErrors, ejected, listenerFailures, nodePortConflicts,
		descriptorBudgetGauge, udpFlowsTotal, parkedSockets, budgetRefusals, unredirectedResets, unredirectedDatagrams, clientAddressAvailable, backendSources)
	for _, fam := range familyNames(nil) {
		clientAddressAvailable.WithLabelValues(fam)
	}
}

// feMetrics are one frontend's metrics, resolved once, on first use: looking
// labels up per datagram would cost more than the datagram, and creating them
// up front cost ~6 KiB and 23 exposition lines per service port whether or not
// it ever saw traffic (60 MB and 230 000 lines at 10k service ports).
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

// running is the set of proxiers between the start and the end of Run: the
// metrics computed at scrape time read their live state.
var running proxierSet

type proxierSet struct {
	mu sync.Mutex
	m  map[*Proxier]bool
}

func (s *proxierSet) add(p *Proxier) {
	s.mu.Lock()
	if s.m == nil {
		s.m = map[*Proxier]bool{}
	}
	s.m[p] = true
	s.mu.Unlock()
}

func (s *proxierSet) remove(p *Proxier) {
	s.mu.Lock()
	delete(s.m, p)
	s.mu.Unlock()
}

// each calls fn for every running proxier; fn must not block.
func (s *proxierSet) each(fn func(*Proxier)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for p := range s.m {
		fn(p)
	}
}

// ejectedCollector reports the endpoints ejected now, read from the live
// balancers at scrape time: a gauge series per ejected endpoint only, so its
// size follows failures, not the cluster, and an ejection that ran out
// leaves no stale 1 behind.
type ejectedCollector struct{}

var (
	ejected     ejectedCollector
	ejectedDesc = prometheus.NewDesc("kube_userspace_proxy_endpoints_ejected",
		"1 for each endpoint ejected now from new picks after failures in a row (passive outlier detection).",
		[]string{"service", "endpoint"}, nil)
)

func (ejectedCollector) Describe(ch chan<- *prometheus.Desc) { ch <- ejectedDesc }

func (ejectedCollector) Collect(ch chan<- prometheus.Metric) {
	type series struct{ service, endpoint string }
	seen := map[series]bool{} // two listeners of a port (traffic policies differ) may eject the same endpoint
	running.each(func(p *Proxier) {
		p.rec.eachLive(func(fe *frontend) {
			for _, h := range fe.bal.Health() {
				s := series{fe.m.service, h.Endpoint.String()}
				if h.EjectedUntil != nil && !seen[s] {
					seen[s] = true
					ch <- prometheus.MustNewConstMetric(ejectedDesc, prometheus.GaugeValue, 1, s.service, s.endpoint)
				}
			}
		})
	})
}

// noLocalCollector is kube-proxy's count of service ports with a Local
// traffic policy and no endpoint on this node (while the cluster has some),
// per policy and family, read from the live frontends at scrape time.
type noLocalCollector struct{}

var (
	noLocal     noLocalCollector
	noLocalDesc = prometheus.NewDesc("kubeproxy_sync_proxy_rules_no_local_endpoints_total",
		"Service ports with a Local traffic policy and no endpoints on this node.", []string{"traffic_policy", "ip_family"}, nil)
)

func (noLocalCollector) Describe(ch chan<- *prometheus.Desc) { ch <- noLocalDesc }

func (noLocalCollector) Collect(ch chan<- prometheus.Metric) {
	type series struct {
		policy string
		family int
	}
	counts := map[series]int{}
	running.each(func(p *Proxier) {
		for _, fam := range []int{4, 6} {
			if p.cfg.serves(fam) {
				counts[series{"internal", fam}] += 0
				counts[series{"external", fam}] += 0
			}
		}
		p.rec.eachLive(func(fe *frontend) {
			m := fe.noLocal.Load()
			if m&noLocalInternal != 0 {
				counts[series{"internal", fe.key.Family}]++
			}
			if m&noLocalExternal != 0 {
				counts[series{"external", fe.key.Family}]++
			}
		})
	})
	for s, n := range counts {
		ch <- prometheus.MustNewConstMetric(noLocalDesc, prometheus.GaugeValue, float64(n), s.policy, fmt.Sprintf("IPv%d", s.family))
	}
}
