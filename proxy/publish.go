package proxy

// What a sync tells the world once its frontends are served: the view that
// readers see, the health checks, the log lines, and the metrics.

import (
	"cmp"
	"net/netip"
	"slices"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/healthcheck"
)

// publish makes the sync of p, whose rule write is w, what readers see: the
// health checks, the failures to retry, the view, the listeners' log lines,
// the sync's own line, and the metrics of the ports no longer served (else
// churn would grow /metrics forever).
func (r *reconciler) publish(p *syncPlan, w *ruleWrite, kept int) {
	r.syncHealthChecks(p.st)
	r.countFailures(w.view)
	r.synced = p.st
	r.mu.Lock()
	r.view, r.sorted = w.view, nil // sorted when first read: sorting 10k costs ms
	r.viewNode, r.viewZone = p.st.Node, p.st.Zone
	r.lastListenFailures, r.nodeDeleting = r.listenFailures, p.st.NodeDeleting
	r.mu.Unlock()
	r.lines.flush(r.cfg.log())
	w.bulk = r.logSync(w.start, kept, len(p.closed), p.changed)
	for _, name := range p.unserved {
		dataplane.DeleteServiceMetrics(name.String())
	}
}

// logSync writes the sync's debug line and says whether the sync was bulk
// (its garbage is collected once its rules are written: reconciler.written).
func (r *reconciler) logSync(start time.Time, kept, closed int, changed []config.ServicePortName) (bulk bool) {
	fields := logrus.Fields{"frontends": len(r.frontends), "closed": closed, "took": time.Since(start).String(), "visited": "all"}
	if changed != nil {
		fields["visited"] = len(changed)
	}
	opened := len(r.frontends) - kept
	r.cfg.log().WithFields(fields).Debug("Synced")
	return opened+closed >= bulkSync
}

// bulkSync is how many frontends opened or closed in one sync make it bulk.
const bulkSync = 1000

// listenerLinesMax is how many listeners one sync opens (or closes) with a
// log line each; beyond, one summary line says how many, and the lines of
// each go to debug level: a start at 10k service ports wrote 10k lines.
const listenerLinesMax = 10

// listenerLines collects the listeners a sync opened and closed, for its log.
type listenerLines struct{ opened, closed []*dataplane.Frontend }

func (l *listenerLines) flush(log logrus.FieldLogger) {
	for _, x := range []struct {
		fes []*dataplane.Frontend
		msg string
	}{{l.opened, "Listening"}, {l.closed, "Listener closed"}} {
		if len(x.fes) <= listenerLinesMax {
			for _, fe := range x.fes {
				fe.Log().Info(x.msg)
			}
			continue
		}
		if dataplane.DebugEnabled(log) {
			for _, fe := range x.fes {
				fe.Log().Debug(x.msg)
			}
		}
		log.WithField("listeners", len(x.fes)).Info(x.msg + " (one line per listener at debug level)")
	}
	clear(l.opened)
	clear(l.closed)
	l.opened, l.closed = l.opened[:0], l.closed[:0]
}

// countFailures counts the frontends of view that could not open their
// listener or NodePort: the sync goroutine tries them again.
func (r *reconciler) countFailures(view []config.Frontend) {
	r.failing, r.listenFailures, r.failingNames = 0, 0, r.failingNames[:0]
	for _, fe := range view {
		if fe.Err != nil {
			r.listenFailures++
		}
		if fe.Err != nil || fe.NodePortErr != nil {
			r.failing++
			r.failingNames = append(r.failingNames, fe.Service.Name)
		}
	}
	listenerFailures.Set(float64(r.listenFailures))
	nodePortConflicts.Set(float64(r.failing - r.listenFailures))
}

// syncHealthChecks gives ServiceHealth every Service with a health check
// node port and its ready endpoints on this node (counted once across the
// Service's ports and families), when that changed.
func (r *reconciler) syncHealthChecks(st *config.State) {
	if r.cfg.ServiceHealth == nil {
		return
	}
	byService := map[config.ServiceName]*healthcheck.Service{}
	local := map[config.ServiceName]map[netip.Addr]bool{}
	for _, sp := range st.Ports {
		if sp.HealthCheckNodePort == 0 {
			continue
		}
		k := sp.Name.Service()
		if byService[k] == nil {
			byService[k] = &healthcheck.Service{Namespace: k.Namespace, Name: k.Name, Port: sp.HealthCheckNodePort}
			local[k] = map[netip.Addr]bool{}
		}
		for _, ep := range sp.Endpoints {
			if ep.Ready && ep.NodeName == st.Node {
				local[k][ep.Addr.Addr()] = true
			}
		}
	}
	out := make([]healthcheck.Service, 0, len(byService))
	for k, svc := range byService {
		svc.LocalEndpoints = len(local[k])
		out = append(out, *svc)
	}
	slices.SortFunc(out, func(a, b healthcheck.Service) int { return cmp.Compare(a.Port, b.Port) })
	if r.healthChecks != nil && slices.Equal(out, r.healthChecks) {
		return
	}
	r.healthChecks = out
	r.cfg.ServiceHealth.Sync(out)
}
