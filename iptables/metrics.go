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
)

// RegisterMetrics adds the rule syncer's metrics to reg.
func RegisterMetrics(reg prometheus.Registerer) {
	reg.MustRegister(restoreFailures, ruleCount)
}
