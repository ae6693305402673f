package iptables

import "github.com/prometheus/client_golang/prometheus"

// Metrics with kube-proxy's names.
var (
	restoreFailures = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", Help: "iptables-restore runs that failed.",
	})
	ruleCount = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kubeproxy_sync_proxy_rules_iptables_total", Help: "Rules in the proxy's chains, per table and IP family.",
	}, []string{"table", "family"})
	conntrackDeleted = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_conntrack_entries_deleted_total",
		Help: "UDP conntrack entries deleted because the listener behind their service address changed or went.",
	})
)

// RegisterMetrics adds the rule syncer's metrics to reg.
func RegisterMetrics(reg prometheus.Registerer) {
	reg.MustRegister(restoreFailures, ruleCount, conntrackDeleted)
}
