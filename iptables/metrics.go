package iptables

import (
	"fmt"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics with kube-proxy's names and labels (ip_family: IPv4, IPv6), and
// ours beside them.
var (
	restoreFailures = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", Help: "iptables-restore runs that failed.",
	}, []string{"ip_family"})
	partialRestoreFailures = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
		Help: "Writes of the changed chains only that failed (all rules are then rewritten).",
	}, []string{"ip_family"})
	ruleCount = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kubeproxy_sync_proxy_rules_iptables_total", Help: "Rules in the proxy's chains, per table and IP family.",
	}, []string{"table", "ip_family"})
	rulesWritten = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kubeproxy_sync_proxy_rules_iptables_last", Help: "Rules written by the last write, per table and IP family.",
	}, []string{"table", "ip_family"})
	conntrackReconcilerDeleted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kubeproxy_conntrack_reconciler_deleted_entries_total", Help: "Stale UDP conntrack entries deleted.",
	}, []string{"ip_family"})
	conntrackDeleted = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kube_userspace_proxy_conntrack_entries_deleted_total",
		Help: "UDP conntrack entries deleted because the listener behind their service address changed or went.",
	})
)

// RegisterMetrics adds the rule syncer's metrics to reg.
func RegisterMetrics(reg prometheus.Registerer) {
	reg.MustRegister(restoreFailures, partialRestoreFailures, ruleCount, rulesWritten, conntrackReconcilerDeleted, conntrackDeleted)
}

func familyName(fam int) string { return fmt.Sprintf("IPv%d", fam) }

// countWritten sets the rules written per table from an iptables-restore
// input.
func countWritten(fam int, input string) {
	counts := map[string]int{"nat": 0, "filter": 0}
	table := ""
	for line := range strings.Lines(input) {
		switch {
		case strings.HasPrefix(line, "*"):
			table = strings.TrimSpace(line[1:])
		case strings.HasPrefix(line, "-A "):
			counts[table]++
		}
	}
	for t, n := range counts {
		rulesWritten.WithLabelValues(t, familyName(fam)).Set(float64(n))
	}
}
