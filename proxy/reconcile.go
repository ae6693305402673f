package proxy

// The reconciler turns one State into frontends and one rule write, forward
// through three files, each once:
//
//	apply            (here)
//	  → plan         (plan.go) decide, changing nothing: the ports to visit
//	                 (the changed ones, or all), what becomes of each live
//	                 frontend of them (kept, retaken, closed now, closed
//	                 after the serve, closed after the rule write), the
//	                 order to serve the ports in (NodePort claims first,
//	                 the oldest Service winning; then new listeners in name
//	                 order, so that a restart opens the same ports), and
//	                 what each frontend takes (its endpoints, settings)
//	  → carryOut     (serve.go) do it: close, retake NodePorts, open what
//	                 is missing (dataplane.open), hand the balancers their
//	                 endpoints, refuse where none serves; out comes the
//	                 ruleWrite, which the rule writer carries out (rulewriter.go)
//	  → publish      (views.go) the view readers see, the log, the metrics
//	written, once the rule writer is done: replaced frontends stop, closed
//	ones give their ports back, a bulk sync's garbage is collected.

import (
	"runtime"
	"sync"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/healthcheck"
)

// reconciler owns the frontends. Everything but mu's fields is the sync
// goroutine's alone.
type reconciler struct {
	cfg *Config
	dp  *dataplane

	// failing counts the frontends of the last sync that could not open
	// their listener or NodePort; listenFailures those without a listener.
	// The sync goroutine retries them (Proxier.Run); failingNames are
	// their ports, visited by every sync besides the changed ones.
	failing, listenFailures int
	failingNames            []config.ServicePortName
	// unreleased are closed frontends whose ports the rules may still
	// point at (the rule write after their closing failed); their ports go
	// back to the allocator after the next successful one.
	unreleased []*frontend
	// synced is the State the frontends were last synced to: a State made
	// from it says which ports changed (changedSince).
	synced *config.State
	// zone is the node's zone the balancers' endpoints were chosen for: a
	// new zone chooses again for every port.
	zone string
	// healthChecks is what ServiceHealth was last given (health.go).
	healthChecks []healthcheck.Service
	// lines are the listeners opened and closed since the last log of them.
	lines listenerLines
	// inheritedPicks is a predecessor's pick state by frontend key, until
	// the first sync applied it (pickstate.go).
	inheritedPicks map[string]pickState

	mu sync.Mutex // guards the fields below: written by the sync goroutine, read by anyone
	// frontends are the live listeners.
	frontends map[frontendKey]*frontend
	view      []config.Frontend // as last synced; also handed to Rules.Sync: never reordered
	sorted    []config.Frontend // a sorted copy of view, made on first read
	// viewNode and viewZone are the node's name and zone the view's
	// endpoints were chosen for (explain).
	viewNode, viewZone string
	// lastListenFailures and nodeDeleting are the last sync's, for health.
	lastListenFailures int
	nodeDeleting       bool
}

func newReconciler(cfg *Config, dp *dataplane) *reconciler {
	return &reconciler{cfg: cfg, dp: dp, frontends: make(map[frontendKey]*frontend)}
}

// apply makes the listeners match d.To and returns the rule write that
// makes the rules match them: new listeners are open before the rules point
// at them, removed ones stop now, balancers take their new endpoints now,
// and what was replaced stops once the write is done (written).
//
// A removed frontend stops accepting before the rules change, so its Service
// is refused at once instead of after the rule transaction (30-45 ms at 10k
// service ports). The port of a closed frontend goes back to the allocator
// only after a rule write made after its closing succeeded, so no new
// listener can inherit its traffic.
func (r *reconciler) apply(d config.Delta, verify bool) *ruleWrite {
	start := time.Now()
	p := r.plan(d, verify)
	w, kept := r.carryOut(p, start)
	r.syncHealthChecks(p.st)
	r.publish(p, w, kept)
	return w
}

// written finishes w on the sync goroutine once its rules are written (err
// nil) or failed: replaced listeners stop, and after a success the ports of
// every frontend closed before it go back to the allocator.
func (r *reconciler) written(w *ruleWrite) {
	for _, fe := range w.stale {
		r.stop(fe)
	}
	r.unreleased = append(append(r.unreleased, w.release...), w.stale...)
	if w.err == nil {
		for _, fe := range r.unreleased {
			fe.release()
		}
		clear(r.unreleased)
		r.unreleased = r.unreleased[:0]
	}
	r.lines.flush(r.cfg.log())
	if w.bulk {
		// A bulk sync (a start, a restore of many Services) and its rule
		// write leave tens of MB of garbage; collected later, it would land
		// on the next small change, whose sync then shares the CPU with the
		// mark phase (at 10k: +15-25 ms, in ~40 % of the changes measured
		// right after a load; at 1k, +5 ms in every one). Collect it now.
		start := time.Now()
		runtime.GC()
		r.cfg.log().WithField("took", time.Since(start).String()).Debug("Collected a bulk sync's garbage")
	}
}

// closeAll stops every frontend and gives its port back (at shutdown: the
// rules still point at the closed ports, so a new connection is refused at
// once instead of timing out).
func (r *reconciler) closeAll() {
	r.mu.Lock()
	all := r.frontends
	r.frontends = make(map[frontendKey]*frontend)
	r.view, r.sorted = nil, nil
	r.mu.Unlock()
	for _, fe := range all {
		r.stop(fe)
		fe.release()
	}
	r.lines.flush(r.cfg.log())
}
