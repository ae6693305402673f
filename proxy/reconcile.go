package proxy

// The reconciler turns one State into frontends and one rule write, forward
// through three files, each once:
//
//	apply            (here)
//	  → plan         (here) decide, changing nothing: the ports to visit
//	                 (the changed ones, or all), what becomes of each live
//	                 frontend of them (kept, retaken, closed now, closed
//	                 after the serve, closed after the rule write), the
//	                 order to serve the ports in (NodePort claims first,
//	                 the oldest Service winning; then new listeners in name
//	                 order, so that a restart opens the same ports), and
//	                 what each frontend takes (its endpoints, settings, a
//	                 predecessor's picks)
//	  → carryOut     (carryout.go) do it: close, retake NodePorts, open what
//	                 is missing, each frontend takes what the plan decided
//	                 (its balancer, its UDP flows, its port refusing where
//	                 none serves); out comes the ruleWrite, which the rule
//	                 writer carries out (rulewriter.go)
//	  → publish      (publish.go) the health checks, the view readers see,
//	                 the log, the metrics
//	written (carryout.go), once the rule writer is done: replaced frontends
//	stop, closed ones give their ports back, a bulk sync's garbage is
//	collected.

import (
	"maps"
	"net/netip"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/clientaddr"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/healthcheck"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/proxyproto"
)

// reconciler owns the frontends. Everything but mu's fields is the sync
// goroutine's alone.
type reconciler struct {
	cfg *Config
	dp  *dataplane.Dataplane

	// failing counts the frontends of the last sync that could not open
	// their listener or NodePort; listenFailures those without a listener.
	// The sync goroutine retries them (Proxier.Run); failingNames are
	// their ports, visited by every sync besides the changed ones.
	failing, listenFailures int
	failingNames            []config.ServicePortName
	// unreleased are closed frontends whose ports the rules may still
	// point at (the rule write after their closing failed); their ports go
	// back to the allocator after the next successful one.
	unreleased []*dataplane.Frontend
	// synced is the State the frontends were last synced to: a State made
	// from it says which ports changed (changedSince).
	synced *config.State
	// zone is the node's zone the balancers' endpoints were chosen for: a
	// new zone chooses again for every port.
	zone string
	// healthChecks is what ServiceHealth was last given (publish.go).
	healthChecks []healthcheck.Service
	// lines are the listeners opened and closed since the last log of them.
	lines listenerLines
	// inheritedPicks is a predecessor's pick state by frontend key, until
	// the first sync gave it to the frontends (keyServe.picks; package balance).
	inheritedPicks map[string]balance.PickState

	mu sync.Mutex // guards the fields below: written by the sync goroutine, read by anyone
	// frontends are the live listeners.
	frontends map[dataplane.Key]*dataplane.Frontend
	view      []config.Frontend // as last synced; also handed to Rules.Sync: never reordered
	sorted    []config.Frontend // a sorted copy of view, made on first read
	// viewNode and viewZone are the node's name and zone the view's
	// endpoints were chosen for (explain).
	viewNode, viewZone string
	// lastListenFailures and nodeDeleting are the last sync's, for health.
	lastListenFailures int
	nodeDeleting       bool
}

func newReconciler(cfg *Config, dp *dataplane.Dataplane) *reconciler {
	return &reconciler{cfg: cfg, dp: dp, frontends: make(map[dataplane.Key]*dataplane.Frontend)}
}

// apply makes the listeners match d.To and returns the rule write that
// makes the rules match them: new listeners are open before the rules point
// at them, removed ones stop now, balancers take their new endpoints now,
// and what was replaced stops once the write is done (written).
//
// A removed frontend stops accepting before the rules change, so its Service
// is refused at once instead of after the rule transaction. The port of a closed frontend goes back to the allocator
// only after a rule write made after its closing succeeded, so no new
// listener can inherit its traffic.
func (r *reconciler) apply(d config.Delta, verify bool) *ruleWrite {
	start := time.Now()
	p := r.plan(d, verify)
	w, kept := r.carryOut(p, start)
	r.publish(p, w, kept)
	return w
}

// syncPlan is what one sync does to the frontends, decided before any of it
// is done (plan) and then carried out (carryOut, carryout.go). Nothing in it is
// changed on the way: it is the sync's record.
type syncPlan struct {
	st     *config.State
	verify bool
	// changed are the ports visited; nil: every port.
	changed []config.ServicePortName
	// rezone: the node's zone changed, every balancer chooses again.
	rezone bool

	// What becomes of the live frontends visited. retake: their NodePort
	// was held elsewhere, a new frontend tries it again (kept only if it
	// gets it). closeNow: they hold a NodePort their successor may need
	// (the one replacement that is break-before-make). gone: removed,
	// they stop once the rest is served. stale: replaced, they stop once
	// the rules point at their successors.
	retake                []dataplane.Key
	closeNow, gone, stale []*dataplane.Frontend
	closed                []config.ServicePortName // the ports of every frontend closed
	unserved              []config.ServicePortName // those of closed that no frontend serves any more
	closing               map[dataplane.Key]bool   // the keys of closeNow, gone and stale
	view                  []config.Frontend        // the view of the ports not visited
	unchanged             int                      // len(view) before carryOut appends to it
	serve                 []portServe              // in the order they are served (serveOrder)
	keysScratch           []dataplane.Key
}

// portServe is what serving one port does: a frontend per key.
type portServe struct {
	sp   *config.ServicePort
	keys []keyServe
}

// keyServe is what becomes of the frontend of one key. update: its
// frontend takes sp's settings and endpoints (a listener just opened always
// does), as Serve says: the endpoints its balancer gets, its Local
// policies that find no endpoint on this node (noLocalPolicies), whose
// address its backends see, its outlier detection, the endpoints a UDP
// frontend that stays keeps its flows to (nil: a new frontend, no flows
// yet), and a predecessor's picks at the first sync after a handover.
type keyServe struct {
	key    dataplane.Key
	update bool
	dataplane.Serve
}

// plan decides the sync of d: which ports it visits (the changed ones, or
// all), what becomes of each live frontend of them, and in which order the
// ports are served. It changes nothing.
func (r *reconciler) plan(d config.Delta, verify bool) *syncPlan {
	p := &syncPlan{st: d.To, verify: verify, changed: r.changedSince(d, verify), rezone: d.To.Zone != r.zone}
	p.closing = map[dataplane.Key]bool{}
	if p.changed == nil {
		for key, fe := range r.frontends {
			p.visit(r.cfg, key, fe)
		}
	} else {
		for _, name := range p.changed {
			for _, key := range allFrontendKeys(name) {
				if fe := r.frontends[key]; fe != nil {
					p.visit(r.cfg, key, fe)
				}
			}
		}
	}
	for _, name := range p.closed {
		if sp := p.st.Ports[name]; sp == nil || len(frontendKeys(nil, name, sp, r.cfg.serves)) == 0 {
			p.unserved = append(p.unserved, name)
		}
	}
	ports := p.startView(r)
	p.serve = p.decide(r, p.serveOrder(r, ports))
	return p
}

// changedSince returns the names of the ports d may change, when d starts
// at the State synced last and says, and those of the frontends that
// failed, to be tried again (nil: visit every port). A full visit is kept
// for what only it does: verify the rules and choose endpoints again for a
// new zone; a frontend that failed (a NodePort held by another process) is
// retried without it.
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

// visit decides about the live frontend fe of key: kept, retaken, closed
// now, or closed later (gone or stale).
func (p *syncPlan) visit(cfg *Config, key dataplane.Key, fe *dataplane.Frontend) {
	sp := p.st.Ports[key.Name]
	change := config.ComparePorts(fe.Spec(), sp)
	removed := sp == nil
	if !removed && change != config.PortSame { // a policy may have changed the port's keys
		p.keysScratch = frontendKeys(p.keysScratch[:0], key.Name, sp, cfg.serves)
		removed = !slices.Contains(p.keysScratch, key)
	}
	if fe.NodePortErr() != nil && change < config.PortFrontend && !removed {
		// Every full sync tries again to take the NodePort another
		// process (or Service) held.
		p.retake = append(p.retake, key)
		return
	}
	if change < config.PortFrontend && !removed {
		// The listener serves sp as it is, or with other endpoints and
		// rules (a traffic policy changed): no connection is refused
		// while its successor would open.
		return
	}
	p.closing[key] = true
	p.closed = append(p.closed, key.Name)
	switch {
	case fe.HoldsNodePort():
		// It holds the NodePort (as its listener or as a socket that
		// only keeps others off it), which its successor may need.
		p.closeNow = append(p.closeNow, fe)
	case removed:
		p.gone = append(p.gone, fe)
	default:
		p.stale = append(p.stale, fe)
	}
}

// startView returns the ports to serve, and starts the view with the last
// view's frontends of the ports not visited: every port of the State, or
// the changed ports and the last view without them.
func (p *syncPlan) startView(r *reconciler) []*config.ServicePort {
	if p.changed == nil {
		p.view = make([]config.Frontend, 0, max(len(r.frontends), len(p.st.Ports))+8)
		return slices.Collect(maps.Values(p.st.Ports))
	}
	var ports []*config.ServicePort
	set := make(map[config.ServicePortName]bool, len(p.changed))
	for _, name := range p.changed {
		set[name] = true
		if sp := p.st.Ports[name]; sp != nil {
			ports = append(ports, sp)
		}
	}
	r.mu.Lock()
	last := r.view
	r.mu.Unlock()
	p.view = make([]config.Frontend, 0, len(last)+2*len(p.changed)+8)
	for _, f := range last {
		if !set[f.Service.Name] {
			p.view = append(p.view, f)
		}
	}
	p.unchanged = len(p.view)
	return ports
}

// serveOrder orders the ports to serve. Ports with a NodePort first, the
// oldest Service first: of two that claim the same NodePort, the same one
// wins at every start. Then the ports that need a listener, in the order of
// their names: with ports chosen from each one's preferred port upwards, a
// restart opens the same Services on the same ports (and finds its rules).
// The rest (their listeners stay) first of all, in any order.
func (p *syncPlan) serveOrder(r *reconciler, ports []*config.ServicePort) []*config.ServicePort {
	var kept, claims, opening []*config.ServicePort
	for _, sp := range ports {
		if sp.NodePort != 0 {
			claims = append(claims, sp)
			continue
		}
		p.keysScratch = frontendKeys(p.keysScratch[:0], sp.Name, sp, r.cfg.serves)
		if p.needsListener(r, p.keysScratch) {
			opening = append(opening, sp)
			continue
		}
		kept = append(kept, sp)
	}
	sort.Slice(claims, func(i, j int) bool { return claimsFirst(claims[i], claims[j]) })
	slices.SortFunc(opening, func(a, b *config.ServicePort) int { return a.Name.Compare(b.Name) })
	return slices.Concat(kept, claims, opening)
}

// needsListener says whether a frontend of keys has no listener yet, or
// loses it in this sync.
func (p *syncPlan) needsListener(r *reconciler, keys []dataplane.Key) bool {
	for _, key := range keys {
		if r.frontends[key] == nil || p.closing[key] {
			return true
		}
	}
	return false
}

// decide says, for every key of every port of ports, what serving it
// does: whether its frontend takes sp's settings (new, replaced, retaken,
// of a port that changed, or of a new zone) and what they are. The keys of all ports
// share one backing array.
func (p *syncPlan) decide(r *reconciler, ports []*config.ServicePort) []portServe {
	out := make([]portServe, len(ports))
	all := make([]dataplane.Key, 0, len(ports)+len(ports)/4)
	for i, sp := range ports {
		from := len(all)
		all = frontendKeys(all, sp.Name, sp, r.cfg.serves)
		out[i] = portServe{sp: sp}
		for _, key := range all[from:len(all):len(all)] {
			fe := r.frontends[key]
			ks := keyServe{key: key, update: fe == nil || p.closing[key] || p.rezone || slices.Contains(p.retake, key) ||
				config.ComparePorts(fe.Spec(), sp) != config.PortSame}
			if ks.update {
				ks.Endpoints = config.UsableEndpoints(sp.Endpoints, key.Family, localOnly(key, sp), p.st.Node, p.st.Zone)
				ks.NoLocal = noLocalPolicies(key, sp, len(ks.Endpoints), p.st.Node, p.st.Zone)
				ks.Source = clientaddr.NewPolicy(r.cfg.BackendSource, key.Kind, sp)
				ks.Outlier = r.cfg.outlierFor(sp)
				var prev *config.ServicePort // nil: a new listener
				if fe != nil && !p.closing[key] && !slices.Contains(p.retake, key) {
					prev = fe.Spec()
				}
				warnAnnotations(r.cfg.log().WithFields(logrus.Fields{"service": key.Name.String(), "family": key.Family, "kind": key.Kind}), prev, sp)
				if prev != nil && sp.Protocol == config.UDP {
					ks.Serving = servingEndpoints(sp)
				}
				if r.inheritedPicks != nil {
					if st, ok := r.inheritedPicks[key.String()]; ok {
						ks.Picks = &st
					}
				}
			}
			out[i].keys = append(out[i].keys, ks)
		}
	}
	return out
}

// localOnly says whether the frontend of k serves sp's endpoints on this
// node alone.
func localOnly(k dataplane.Key, sp *config.ServicePort) bool {
	switch k.Kind {
	case config.KindInternal:
		return sp.InternalLocal
	case config.KindExternal:
		return sp.ExternalLocal
	case config.KindLocalClients:
		return false // kube-proxy's short-circuit: every endpoint
	}
	return sp.InternalLocal // KindAll: both policies agree
}

const (
	noLocalInternal = 1 << iota
	noLocalExternal
)

// noLocalPolicies are the Local policies of sp that key's frontend serves
// without a local endpoint (usable: its endpoints) while the cluster has
// some, as kube-proxy counts them.
func noLocalPolicies(key dataplane.Key, sp *config.ServicePort, usable int, node, zone string) uint32 {
	if !localOnly(key, sp) || usable > 0 || len(config.UsableEndpoints(sp.Endpoints, key.Family, false, node, zone)) == 0 {
		return 0
	}
	var m uint32
	if key.Kind.ClusterIPs() && sp.InternalLocal {
		m |= noLocalInternal
	}
	if key.Kind.External() && sp.ExternalLocal && sp.HasExternal() {
		m |= noLocalExternal
	}
	return m
}

// claimsFirst orders the Services that claim NodePorts: the oldest first,
// then by name.
func claimsFirst(a, b *config.ServicePort) bool {
	if !a.Created.Equal(b.Created) {
		return a.Created.Before(b.Created)
	}
	return a.Name.String() < b.Name.String()
}

// frontendKeys appends the keys of the listeners sp needs to keys, without
// allocating when keys has room: one per family, or two when internal and
// external traffic policies differ (they select different endpoints, and a
// UDP datagram cannot tell which address it was sent to once redirected),
// and a third for clients on this node when both policies are Local (the
// short-circuit needs every endpoint; see config.KindLocalClients).
// It is the one enumeration of a Service port's frontends; serves says
// which families may open (nil: every one).
func frontendKeys(keys []dataplane.Key, name config.ServicePortName, sp *config.ServicePort, serves func(int) bool) []dataplane.Key {
	split := sp.HasExternal() && sp.InternalLocal != sp.ExternalLocal
	localClients := sp.HasExternal() && sp.InternalLocal && sp.ExternalLocal
	for _, fam := range sp.Families() {
		if serves != nil && !serves(fam) {
			continue
		}
		if split {
			keys = append(
				keys,
				dataplane.Key{Name: name, Kind: config.KindInternal, Family: fam},
				dataplane.Key{Name: name, Kind: config.KindExternal, Family: fam},
			)
		} else {
			keys = append(keys, dataplane.Key{Name: name, Kind: config.KindAll, Family: fam})
		}
		if localClients {
			keys = append(keys, dataplane.Key{Name: name, Kind: config.KindLocalClients, Family: fam})
		}
	}
	return keys
}

// allFrontendKeys lists every key a frontend of the port name may have.
func allFrontendKeys(name config.ServicePortName) []dataplane.Key {
	keys := make([]dataplane.Key, 0, 6)
	for _, fam := range []int{4, 6} {
		for _, kind := range config.Kinds {
			keys = append(keys, dataplane.Key{Name: name, Kind: kind, Family: fam})
		}
	}
	return keys
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

// warnAnnotations warns once about each of sp's annotations that has a value
// the proxy does not know, when the value is new (prev is nil for a listener
// just opened): a sync that changes nothing else says nothing again.
func warnAnnotations(log logrus.FieldLogger, prev, sp *config.ServicePort) {
	if prev == nil {
		prev = &config.ServicePort{}
	}
	if sp.ProxyProtocol != prev.ProxyProtocol && !proxyproto.Known(sp.ProxyProtocol) {
		log.WithField("annotation", config.AnnotationProxyProtocol).WithField("value", sp.ProxyProtocol).
			Warn("Unknown PROXY protocol version (want v1 or v2); no header is sent")
	}
	if sp.Scheduler != prev.Scheduler && !balance.KnownScheduler(sp.Scheduler) {
		log.WithField("annotation", config.AnnotationScheduler).WithField("value", sp.Scheduler).
			Warn("Unknown scheduler (want rr, lc, sh or random); using rr")
	}
	if v := sp.BackendSource; v != prev.BackendSource && v != "" && v != string(clientaddr.Auto) && v != string(clientaddr.Node) {
		log.WithField("annotation", config.AnnotationBackendSource).WithField("value", v).
			Warn("Unknown value (want \"auto\" or \"node\"); using auto")
	}
	if v := sp.OutlierDetection; v != prev.OutlierDetection && v != "" && v != "on" && v != "off" {
		log.WithField("annotation", config.AnnotationOutlierDetection).WithField("value", v).
			Warn("Unknown value (want \"on\" or \"off\"); outlier detection stays on")
	}
}
