package proxy

import (
	"fmt"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
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

// What the last sync could not open.
var (
	listenerFailures = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kube_userspace_proxy_listener_failures",
		Help: "Listeners the last sync could not open (port range exhausted, out of descriptors, bind address): /healthz is 503 while any.",
	})
	nodePortConflicts = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kube_userspace_proxy_nodeport_conflicts",
		Help: "Listeners whose NodePort another process or an older Service holds; retried every sync.",
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

// RegisterMetrics adds the proxier's metrics to reg.
func RegisterMetrics(reg prometheus.Registerer) {
	reg.MustRegister(syncDuration, syncFullDuration, syncPartialDuration, syncLast, syncLastQueued, programmingDuration, noLocal,
		serviceChangesPending, serviceChangesTotal, endpointChangesPending, endpointChangesTotal,
		ejected, listenerFailures, nodePortConflicts)
	reg.MustRegister(dataplane.Collectors()...)
	dataplane.ExposeFamilies([]int{4, 6})
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
		p.rec.eachLive(func(fe *dataplane.Frontend) {
			for _, h := range fe.Balancer().Health() {
				s := series{fe.Service(), h.Endpoint.String()}
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
		p.rec.eachLive(func(fe *dataplane.Frontend) {
			m := fe.NoLocal()
			if m&noLocalInternal != 0 {
				counts[series{"internal", fe.Key().Family}]++
			}
			if m&noLocalExternal != 0 {
				counts[series{"external", fe.Key().Family}]++
			}
		})
	})
	for s, n := range counts {
		ch <- prometheus.MustNewConstMetric(noLocalDesc, prometheus.GaugeValue, float64(n), s.policy, fmt.Sprintf("IPv%d", s.family))
	}
}
