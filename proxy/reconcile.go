package proxy

// The reconciler turns one State into frontends and one rule write:
//
//	apply
//	  → changedSince: the ports to visit (the changed ones, or all)
//	  → closing.visit: frontends no longer wanted stop (or wait for their
//	    successor's rules), NodePorts held elsewhere are tried again
//	  → serveAll: NodePort claims first (the oldest Service wins), then the
//	    ports that need a listener in name order (the same ports after a
//	    restart), each through serve: open what is missing (dataplane.open),
//	    hand the balancers their endpoints
//	  → publish: the view readers see
//	  → a ruleWrite, which the rule writer carries out (rulewriter.go)
//	written, once the rule writer is done: replaced frontends stop, closed
//	ones give their ports back.

import (
	"fmt"
	"maps"
	"net/netip"
	"runtime"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/sirupsen/logrus"

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

// apply makes the listeners match st and returns the rule write that makes
// the rules match them: new listeners are open before the rules point at
// them, removed ones stop now, balancers take their new endpoints now, and
// what was replaced stops once the write is done (written).
//
// A removed frontend stops accepting before the rules change, so its Service
// is refused at once instead of after the rule transaction (30-45 ms at 10k
// service ports). The port of a closed frontend goes back to the allocator
// only after a rule write made after its closing succeeded, so no new
// listener can inherit its traffic.
func (r *reconciler) apply(d config.Delta, verify bool) *ruleWrite {
	start := time.Now()
	st := d.To
	// When the change says which ports changed since the State synced
	// last, only those are visited: at 10k service ports a sync that
	// visits every port costs 20-35 ms, the better part of one change's
	// latency.
	changed := r.changedSince(d, verify)
	c := closing{r: r, st: st}
	if changed == nil {
		for key, fe := range r.frontends {
			c.visit(key, fe)
		}
	} else {
		for _, name := range changed {
			for _, key := range allFrontendKeys(name) {
				if fe := r.frontends[key]; fe != nil {
					c.visit(key, fe)
				}
			}
		}
	}
	kept := len(r.frontends)
	rezone := st.Zone != r.zone
	r.zone = st.Zone
	view, unchanged, ports := r.startView(st, changed)
	view = r.serveAll(view, st, ports, c.retaken, rezone)
	r.syncHealthChecks(st)
	r.countFailures(view)
	// After serving, so that a port freed here cannot go to a new frontend.
	for _, fe := range c.gone {
		r.stop(fe)
	}
	released := append(c.released, c.gone...)
	for _, name := range c.closed {
		if sp := st.Ports[name]; sp == nil || len(frontendKeys(nil, name, sp, r.cfg.serves)) == 0 {
			deleteServiceMetrics(name.String()) // else churn would grow /metrics forever
		}
	}
	r.synced = st
	r.publish(st, view)
	r.lines.flush(r.cfg.log())
	r.logSync(start, kept, len(c.closed), changed)
	w := &ruleWrite{view: view, verify: verify, release: released, stale: c.stale, start: start, state: st}
	if changed != nil {
		w.changed, w.fresh = changed, view[unchanged:]
	}
	return w
}

// closing collects what one sync takes away from the frontends it visits.
type closing struct {
	r    *reconciler
	st   *config.State
	keys []frontendKey // scratch
	// gone are removed; they stop after the sync has served the rest.
	// stale are replaced; they stop once the rules point at their
	// successors. released stopped here, their ports held until a rule
	// write without them.
	gone, stale, released []*frontend
	closed                []config.ServicePortName
	retaken               map[frontendKey]*frontend // frontends that got their NodePort back, for serve
}

// visit decides about the live frontend fe of key: kept, replaced, removed,
// or replaced by one that got its NodePort back.
func (c *closing) visit(key frontendKey, fe *frontend) {
	r, sp := c.r, c.st.Ports[key.Name]
	change := config.ComparePorts(fe.spec, sp)
	if fe.nodePortErr != nil && change < config.PortFrontend {
		// Every full sync tries again to take the NodePort another
		// process (or Service) held: a new frontend, kept only if it got
		// it.
		nf := r.retakeNodePort(key, sp)
		if nf == nil {
			return
		}
		if c.retaken == nil {
			c.retaken = map[frontendKey]*frontend{}
		}
		c.retaken[key] = nf
		r.forget(key)
		c.stale = append(c.stale, fe)
		return
	}
	if change < config.PortFrontend {
		return // the listener serves sp as it is
	}
	removed := sp == nil
	if !removed {
		c.keys = frontendKeys(c.keys[:0], key.Name, sp, r.cfg.serves)
		removed = !slices.Contains(c.keys, key)
	}
	r.forget(key)
	c.closed = append(c.closed, key.Name)
	switch {
	case fe.holdsNodePort():
		// Its successor may need the same NodePort: stop it now (the one
		// case of a replacement that is break-before-make).
		r.stop(fe)
		c.released = append(c.released, fe)
	case removed:
		c.gone = append(c.gone, fe)
	default:
		c.stale = append(c.stale, fe)
	}
}

// forget takes key's frontend out of the live set.
func (r *reconciler) forget(key frontendKey) {
	r.mu.Lock()
	delete(r.frontends, key)
	r.mu.Unlock()
}

// stop stops fe accepting, for the log of closed listeners.
func (r *reconciler) stop(fe *frontend) {
	fe.stop()
	r.lines.closed = append(r.lines.closed, fe)
}

// startView returns the start of the sync's view and the ports to serve
// into it: every port of st, or, when only the changed ports are visited,
// the last view without them (view[:unchanged]) and the changed ports.
func (r *reconciler) startView(st *config.State, changed []config.ServicePortName) (view []config.Frontend, unchanged int, ports []*config.ServicePort) {
	if changed == nil {
		return make([]config.Frontend, 0, max(len(r.frontends), len(st.Ports))+8), 0, slices.Collect(maps.Values(st.Ports))
	}
	set := make(map[config.ServicePortName]bool, len(changed))
	for _, name := range changed {
		set[name] = true
		if sp := st.Ports[name]; sp != nil {
			ports = append(ports, sp)
		}
	}
	r.mu.Lock()
	last := r.view
	r.mu.Unlock()
	view = make([]config.Frontend, 0, len(last)+2*len(changed)+8)
	for _, f := range last {
		if !set[f.Service.Name] {
			view = append(view, f)
		}
	}
	return view, len(view), ports
}

// serveAll serves ports into view. Ports with a NodePort first, the oldest
// Service first: of two that claim the same NodePort, the same one wins at
// every start. Then the ports that need a listener, in the order of their
// names: with ports chosen from each one's preferred port upwards, a restart
// opens the same Services on the same ports (and finds its rules).
func (r *reconciler) serveAll(view []config.Frontend, st *config.State, ports []*config.ServicePort, retaken map[frontendKey]*frontend, rezone bool) []config.Frontend {
	var keys []frontendKey
	var claims, opening []*config.ServicePort
	for _, sp := range ports {
		if sp.NodePort != 0 {
			claims = append(claims, sp)
			continue
		}
		keys = frontendKeys(keys[:0], sp.Name, sp, r.cfg.serves)
		if r.needsListener(keys) {
			opening = append(opening, sp)
			continue
		}
		view = r.serve(view, st, sp, keys, retaken, rezone)
	}
	sort.Slice(claims, func(i, j int) bool { return claimsFirst(claims[i], claims[j]) })
	slices.SortFunc(opening, func(a, b *config.ServicePort) int { return a.Name.Compare(b.Name) })
	for _, sp := range slices.Concat(claims, opening) {
		keys = frontendKeys(keys[:0], sp.Name, sp, r.cfg.serves)
		view = r.serve(view, st, sp, keys, retaken, rezone)
	}
	return view
}

// serve makes sure a frontend serves sp for each of keys (opening the ones
// missing) and appends them to view.
func (r *reconciler) serve(view []config.Frontend, st *config.State, sp *config.ServicePort, keys []frontendKey, retaken map[frontendKey]*frontend, rezone bool) []config.Frontend {
	for _, key := range keys {
		fe := r.frontends[key]
		opened := fe == nil
		if opened {
			if fe = retaken[key]; fe == nil {
				var err error
				if fe, err = r.open(key, sp, st.Node); err != nil {
					view = append(view, config.Frontend{Service: sp, Kind: key.Kind, Family: key.Family, Protocol: sp.Protocol, Err: err})
					continue
				}
			}
			r.lines.opened = append(r.lines.opened, fe)
			r.mu.Lock()
			r.frontends[key] = fe
			r.mu.Unlock()
		}
		if opened || rezone || config.ComparePorts(fe.spec, sp) != config.PortSame {
			prev := fe.spec
			if opened {
				prev = nil
			}
			warnAnnotations(fe.log(), prev, sp)
			fe.proxyProto.Store(sp.ProxyProtocol)
			fe.sourcePolicy.Store(newSourcePolicy(r.cfg, key, sp))
			eps := config.UsableEndpoints(sp.Endpoints, key.Family, key.localOnly(sp), st.Node, st.Zone)
			fe.bal.Update(eps, sp.AffinityTimeout, r.cfg.outlierFor(sp), sp.Scheduler)
			fe.noLocal.Store(noLocalPolicies(key, sp, len(eps), st.Node, st.Zone))
			if fe.udp != nil && !opened {
				fe.udp.endFlowsOff(servingEndpoints(sp))
			}
			if err := r.refuseUnless(fe, len(eps) > 0); err != nil {
				view = append(view, config.Frontend{Service: sp, Kind: key.Kind, Family: key.Family, Protocol: sp.Protocol, Err: err})
				continue
			}
		}
		fe.spec = sp
		view = append(view, config.Frontend{Service: sp, Kind: key.Kind, Family: key.Family, Protocol: sp.Protocol, Listen: fe.listen,
			NodePortErr: fe.nodePortErr})
	}
	return view
}

// refuseUnless has fe refuse connections while no endpoint can serve it,
// and serve again once one can. A listener that cannot be opened again
// (another process took its port meanwhile) leaves the live set: the sync
// goroutine opens a new one later, and its port goes back once the rules no
// longer point at it.
func (r *reconciler) refuseUnless(fe *frontend, serving bool) error {
	var err error
	if serving {
		err = fe.serveAgain()
	} else {
		err = fe.refuse()
	}
	if err == nil {
		return nil
	}
	fe.log().WithError(err).Error("Cannot open listener; service port not served, retrying")
	r.forget(fe.key)
	r.stop(fe)
	r.unreleased = append(r.unreleased, fe)
	return err
}

// servingEndpoints are the addresses of sp's endpoints that serve, ready or
// terminating.
func servingEndpoints(sp *config.ServicePort) map[netip.AddrPort]bool {
	set := make(map[netip.AddrPort]bool, len(sp.Endpoints))
	for _, ep := range sp.Endpoints {
		if ep.Ready || ep.Serving {
			set[ep.Addr] = true
		}
	}
	return set
}

// open opens key's listener and says what went wrong: the listener (the
// sync goroutine retries) or its NodePort (also an Event on the Service).
func (r *reconciler) open(key frontendKey, sp *config.ServicePort, node string) (*frontend, error) {
	fe, err := r.dp.open(key, sp)
	if err != nil {
		r.cfg.log().WithField("service", key.Name.String()).WithError(err).Error("Cannot open listener; service port not served, retrying")
		return nil, err
	}
	if fe.nodePortErr != nil {
		fe.log().Error(fe.nodePortErr)
		if r.cfg.Events != nil {
			r.cfg.Events(sp, "NodePortConflict", fmt.Sprintf("%s (node %s)", fe.nodePortErr, node))
		}
	}
	return fe, nil
}

// retakeNodePort opens a new frontend for key that holds sp's NodePort, or
// returns nil (quietly: it is tried again every sync) while the port is
// still taken.
func (r *reconciler) retakeNodePort(key frontendKey, sp *config.ServicePort) *frontend {
	nf, err := r.dp.open(key, sp)
	if err != nil {
		return nil
	}
	if nf.nodePortErr != nil {
		nf.discard()
		return nil
	}
	nf.log().WithField("nodePort", sp.NodePort).Info("NodePort taken back")
	return nf
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

// publish makes view what readers see.
func (r *reconciler) publish(st *config.State, view []config.Frontend) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.view, r.sorted = view, nil // sorted when first read: sorting 10k costs ms
	r.viewNode, r.viewZone = st.Node, st.Zone
	r.lastListenFailures, r.nodeDeleting = r.listenFailures, st.NodeDeleting
}

// logSync writes the sync's debug line; after a bulk sync it collects the
// garbage the sync left.
func (r *reconciler) logSync(start time.Time, kept, closed int, changed []config.ServicePortName) {
	fields := logrus.Fields{"frontends": len(r.frontends), "closed": closed, "took": time.Since(start).String(), "visited": "all"}
	if changed != nil {
		fields["visited"] = len(changed)
	}
	if opened := len(r.frontends) - kept; opened+closed >= bulkSync {
		// A bulk sync (a start, a restore of many Services) leaves tens of
		// MB of garbage; collected later, it would land on the next small
		// change, whose sync then shares the CPU with the mark phase (at
		// 10k: +15-25 ms, in ~40 % of the changes measured right after a
		// load). Collect it now.
		gcStart := time.Now()
		runtime.GC()
		fields["gcAfterBulk"] = time.Since(gcStart).String()
	}
	r.cfg.log().WithFields(fields).Debug("Synced")
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

// changedSince returns the names of the ports d may change, when d starts
// at the State synced last and says, and those of the frontends that
// failed, to be tried again (nil: visit every port). A full visit is kept
// for what only it does: verify the rules and choose endpoints again for a
// new zone. One NodePort held by another process used to make every sync a
// full one: at 10k service ports 30-60 ms instead of 1.
func (r *reconciler) changedSince(d config.Delta, verify bool) []config.ServicePortName {
	last, st := r.synced, d.To
	if verify || last == nil || d.From != last || d.All() || st.Zone != r.zone || st.Node != last.Node {
		return nil
	}
	names := make([]config.ServicePortName, 0, len(d.Changed)+len(r.failingNames))
	seen := make(map[config.ServicePortName]bool, cap(names))
	for _, name := range slices.Concat(d.Changed, r.failingNames) {
		if !seen[name] {
			seen[name] = true
			names = append(names, name)
		}
	}
	return names
}

// needsListener says whether a frontend of keys has no listener yet.
func (r *reconciler) needsListener(keys []frontendKey) bool {
	for _, key := range keys {
		if r.frontends[key] == nil {
			return true
		}
	}
	return false
}

// bulkSync is how many frontends opened or closed in one sync make it bulk.
const bulkSync = 1000
