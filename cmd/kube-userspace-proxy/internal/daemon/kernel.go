package daemon

// What the daemon found of the kernel at start: every optional piece it
// uses, probed by its owner (iptables: the matches and ip6tables; proxy:
// the source NAT per family and br_netfilter; prepareNode: the reserved
// ports and the conntrack sysctls; here: conntrack netlink, which three
// owners use), gathered in one config.KernelReport and said once, in the
// start line, each missing piece with what it costs.

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/internal/options"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/clientaddr"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

var kernelPieceAvailable = prometheus.NewGaugeVec(prometheus.GaugeOpts{
	Name: "kube_userspace_proxy_kernel_piece_available",
	Help: "1 for each optional kernel piece the daemon found at start, 0 for each it goes on without (the start line says what that costs; docs/iptables.md).",
}, []string{"piece"})

// probeConntrackNetlink tells report whether conntrack netlink answers, and
// what its absence costs with these flags: the UDP entries the rules left
// stale, the client's address on backend connections, the UDP guard.
func probeConntrackNetlink(o *options.Options, ipt *iptables.Rules, guard bool, report *config.KernelReport) {
	if ipt == nil && o.BackendSource == clientaddr.Node {
		return // nothing would use it
	}
	err := kernel.ProbeConntrack()
	if err == nil {
		report.Present(config.PieceConntrackNL)
		return
	}
	if ipt != nil {
		report.Lacks(config.PieceConntrackNL, "a UDP client that keeps one source port reaches the listener a Service had before a change "+
			"until its conntrack entry expires (nf_conntrack_udp_timeout of quiet)", err)
	}
	if o.BackendSource != clientaddr.Node {
		report.Lacks(config.PieceConntrackNL, "backends see the node's address, not their clients'", err)
	}
	if guard {
		report.Lacks(config.PieceConntrackNL, "UDP proxy ports of ClusterIP-only Services answer other hosts at the node's address "+
			"(nothing tells a redirected flow from a direct one)", err)
	}
}

// logStarted is the start line: a warning naming every missing piece and
// its cost when one is missing, else one at info level. The gauge
// kube_userspace_proxy_kernel_piece_available says the same.
func logStarted(entry *logrus.Entry, report *config.KernelReport) {
	for piece, ok := range report.Pieces() {
		v := 0.0
		if ok {
			v = 1
		}
		kernelPieceAvailable.WithLabelValues(string(piece)).Set(v)
	}
	missing := report.MissingPieces()
	if len(missing) == 0 {
		entry.Info("Started")
		return
	}
	for _, piece := range missing {
		if m, _ := report.Missing(piece); m.Err != nil {
			err := m.Err
			if errors.Is(err, iptables.ErrBasicOnly) {
				err = errors.New("off by --iptables-basic-only")
			}
			entry.WithField("piece", piece).WithError(err).Debug("Kernel piece missing")
		}
	}
	// The message stays "Started" (scripts wait for it); the level and the
	// field say what is missing.
	entry.WithField("missing", report.Summary()+" (docs/iptables.md)").Warn("Started")
}

// lacks says whether report names piece missing.
func lacks(report *config.KernelReport, piece config.KernelPiece) bool {
	_, missing := report.Missing(piece)
	return missing
}
