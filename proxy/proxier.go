// Package proxy serves Kubernetes service ports from userspace: one local
// listener per service port, a balancer choosing endpoints, TCP spliced and
// UDP relayed to them, and (through a Rules implementation) kernel rules that
// redirect service addresses into the listeners.
//
// Typical use:
//
//	p := proxy.New(proxy.Config{Rules: rules, PortRange: proxy.DefaultPortRange})
//	go p.Run(ctx, grace) // the one goroutine that opens listeners and writes rules
//	p.Update(state)      // from a config source (a config.Sink), any number of times
package proxy

import (
	"context"
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"
	"golang.org/x/time/rate"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/healthcheck"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
)

// Config holds the Proxier's settings; the zero value of every field is a
// working default.
type Config struct {
	// BindAddress is where listeners bind. Unspecified (the default) binds
	// 0.0.0.0 for IPv4 frontends and :: for IPv6 ones; a specific address is
	// used for frontends of its family.
	BindAddress netip.Addr
	PortRange   PortRange

	DialTimeouts   []time.Duration // per attempt; DefaultDialTimeouts when nil
	TCPIdleTimeout time.Duration   // 0: no idle timeout
	// ParkIdleAfter is how long a direction of a TCP connection has
	// nothing to read before its goroutine is given up and the socket
	// waits in the proxier's Parker (tcp.go); DefaultParkIdleAfter when 0,
	// never when negative.
	ParkIdleAfter time.Duration
	// Events, when set, records a Service's own trouble as an Event on it
	// (the cluster source): reason "NodePortConflict".
	Events func(sp *config.ServicePort, reason, message string)
	// FileLimit is the descriptor limit the budget is derived from (budget.go);
	// 0: the process's RLIMIT_NOFILE when New is called.
	FileLimit int
	// Outlier is passive outlier detection (outlier.go); the zero value
	// turns it off. A Service turns it off for itself with the annotation
	// kube-userspace-proxy.io/outlier-detection: "off".
	Outlier     OutlierConfig
	UDPTimeout  time.Duration // DefaultUDPTimeout when 0
	UDPMaxFlows int           // per frontend; DefaultUDPMaxFlows when 0

	// NodePortsRestricted is set when NodePorts are served on some node
	// addresses only (--nodeport-addresses). A listener then cannot sit on
	// 0.0.0.0:NodePort (it would answer on every address); a bound,
	// non-listening socket holds the port instead.
	NodePortsRestricted bool

	MinSyncPeriod time.Duration // at most one sync per period (bursts are merged); 0: no limit
	SyncPeriod    time.Duration // rules are re-checked this often; 30 s when 0

	// Rules programs the kernel redirects; nil means none (listeners only).
	Rules Rules
	// ServiceHealth serves the Services' health check node ports
	// (healthcheck.Server); nil serves none.
	ServiceHealth interface{ Sync([]healthcheck.Service) }

	Log     logrus.FieldLogger // logrus.StandardLogger() when nil
	ConnLog logrus.FieldLogger // per-connection lines; Log when nil
	// ConnLogMode says which connections get their line (at info level):
	// ConnLogErrors (the zero value), ConnLogAll or ConnLogNone.
	ConnLogMode ConnLogMode
}

// ConnLogMode selects the per-connection log lines.
type ConnLogMode string

const (
	// ConnLogErrors logs connections that did not end by a normal close:
	// resets, no endpoints, failed dials, idle timeouts, shutdown. It does
	// not flood under normal traffic.
	ConnLogErrors ConnLogMode = "errors"
	ConnLogAll    ConnLogMode = "all"
	ConnLogNone   ConnLogMode = "none"
)

func (c *Config) logConn(protocol config.Protocol, cause Cause) bool {
	switch c.ConnLogMode {
	case ConnLogAll:
		return true
	case ConnLogNone:
		return false
	}
	return !cause.Normal(protocol)
}

// DefaultParkIdleAfter: an idle connection costs no goroutine after this.
// A pause of one costs an epoll_ctl and a goroutine hand-off (~2 µs more
// than a wake-up in Go's poller, BenchmarkParkedWake), small beside a
// pause this long. Shorter is less memory in a burst of new connections:
// every copy holds its goroutine's stack until it parks, and the Go heap
// keeps the high-water mark (100 ms: 6-7 KiB a connection at 1 000 opened
// at once, 25 ms: 3 KiB).
const DefaultParkIdleAfter = 25 * time.Millisecond

func (c *Config) parkIdleAfter() time.Duration {
	switch {
	case c.ParkIdleAfter < 0:
		return 0
	case c.ParkIdleAfter == 0:
		return DefaultParkIdleAfter
	}
	return c.ParkIdleAfter
}

func (c *Config) dialTimeouts() []time.Duration {
	if len(c.DialTimeouts) == 0 {
		return DefaultDialTimeouts
	}
	return c.DialTimeouts
}

func (c *Config) udpTimeout() time.Duration {
	if c.UDPTimeout <= 0 {
		return DefaultUDPTimeout
	}
	return c.UDPTimeout
}

func (c *Config) udpMaxFlows() int {
	if c.UDPMaxFlows <= 0 {
		return DefaultUDPMaxFlows
	}
	return c.UDPMaxFlows
}

func (c *Config) log() logrus.FieldLogger {
	if c.Log == nil {
		return logrus.StandardLogger()
	}
	return c.Log
}

func (c *Config) connLog() logrus.FieldLogger {
	if c.ConnLog == nil {
		return c.log()
	}
	return c.ConnLog
}

// Rules is the kernel side: make the listed frontends' addresses reach their
// listeners, and nothing else. Sync is called one call at a time, by the
// proxier's rule writer, while its sync goroutine goes on; verify asks it to
// compare the live rules with the desired ones (once per sync period)
// instead of trusting what it wrote last.
type Rules interface {
	Sync(ctx context.Context, frontends []Frontend, verify bool) error
}

// ChangeSyncer is implemented by Rules that can be told what changed since
// their last Sync (iptables.Rules): the frontends of the changed service
// ports are fresh, the tail of frontends; every other frontend is as it was.
// At 10k service ports looking at every frontend cost 5-12 ms per sync.
type ChangeSyncer interface {
	SyncChanged(ctx context.Context, frontends []Frontend, changed []config.ServicePortName, fresh []Frontend) error
}

// RuleChecker is implemented by Rules that can compare the kernel's rules
// with those last written while Syncs go on (iptables.Rules): the proxier
// then checks every sync period beside its syncs instead of verifying inside
// one, and syncs when Check finds a drift (which the next Sync repairs).
type RuleChecker interface {
	Check(ctx context.Context) (drift bool, err error)
}

// Proxier turns States into listeners and rules.
type Proxier struct {
	cfg     Config
	alloc   portAllocator
	conns   connTable
	budget  *descriptorBudget
	workers workers // run the connection handlers: dial, then the upstream copy
	// acc accepts on every TCP listener (one goroutine for all of them);
	// made for the first listener, closed at shutdown, under accMu.
	acc     *sock.Acceptor
	accMu   sync.Mutex
	copiers workers // run the downstream copy of each connection
	// parker holds the sockets of idle connections without a goroutine
	// (tcp.go); set by Run, nil without it (copies then wait on their
	// sockets).
	parker atomic.Pointer[sock.Parker]

	mu       sync.Mutex // guards pending, queuedAt, latest and health
	pending  *config.State
	queuedAt time.Time // the oldest change in pending
	// unwrittenAt is the oldest change a sync took whose rules are not
	// written yet (in the write under way or the one queued behind it).
	unwrittenAt time.Time
	latest      *config.State // the newest State given to Update, for counting changes
	lastUpdated time.Time     // the end of the last successful sync
	lastErr     error         // of the last rule write
	lastWritten *config.State // the State the last rule write was made for
	// healthListenFailures is listenFailures as of the last sync.
	healthListenFailures int
	// nodeDeleting is the State's NodeDeleting as of the last sync.
	nodeDeleting bool
	kick         chan struct{} // capacity 1: merges bursts

	// busy counts the syncs and rule writes under way; idleSince is when
	// the last one ended (unix nanoseconds): Quiet.
	busy      atomic.Int32
	idleSince atomic.Int64

	// Owned by the sync goroutine (Run).
	ctx       context.Context
	frontends map[frontendKey]*frontend
	// failing counts the frontends of the last sync that could not open
	// their listener or NodePort; listenFailures those without a listener.
	// The sync goroutine retries them (Run); failingNames are their ports,
	// visited by every sync besides the changed ones.
	failing, listenFailures int
	failingNames            []config.ServicePortName
	// unreleased are closed frontends whose ports the rules may still
	// point at (the rule sync after their closing failed); their ports go
	// back to the allocator after the next successful one.
	unreleased []*frontend
	// synced is the State the frontends were last synced to: a State made
	// from it says which ports changed (changedSince).
	synced *config.State
	// zone is the node's zone the balancers' endpoints were chosen for: a
	// new zone chooses again for every port.
	zone string
	// healthChecks is what ServiceHealth was last given.
	healthChecks []healthcheck.Service
	// lines are the listeners opened and closed since the last log of them.
	lines listenerLines

	viewMu sync.Mutex // guards view and sorted, the frontends as last synced, for readers
	view   []Frontend // also handed to Rules.Sync: never reordered
	sorted []Frontend // a sorted copy of view, made on first read
	// viewNode and viewZone are the node's name and zone the view's
	// endpoints were chosen for (explain).
	viewNode, viewZone string
	// liveMu orders the sync goroutine's writes to frontends before the
	// reads of other goroutines (debug views of live listeners).
	liveMu sync.RWMutex
}

// Quiet reports whether no sync or rule write has been under way for at
// least d: a moment in which work of the daemon's own choosing (a garbage
// collection) delays no change.
func (p *Proxier) Quiet(d time.Duration) bool {
	return p.busy.Load() == 0 && time.Since(time.Unix(0, p.idleSince.Load())) >= d
}

func (p *Proxier) enter() { p.busy.Add(1) }

func (p *Proxier) leave() {
	p.idleSince.Store(time.Now().UnixNano()) // before busy drops: Quiet sees both
	p.busy.Add(-1)
}

// New returns a Proxier; nothing happens until Run.
func New(cfg Config) *Proxier {
	return &Proxier{
		cfg: cfg,
		alloc: portAllocator{r: cfg.PortRange, warn: func(err error) {
			cfg.log().WithError(err).Warn("Cannot read the kernel's local port range; listeners take a port from bind(0), slow beyond ~7000 listeners")
		}},
		kick:      make(chan struct{}, 1),
		budget:    newDescriptorBudget(cfg.FileLimit),
		frontends: make(map[frontendKey]*frontend),
		workers:   workers{maxIdle: 10 * time.Second, maxParked: 1024},
		copiers:   workers{maxIdle: 10 * time.Second, maxParked: 1024},
	}
}

var _ config.Sink = (*Proxier)(nil)

// Update implements config.Sink: it records st as the state to serve and
// wakes the sync goroutine. It never blocks on kernel work.
func (p *Proxier) Update(st *config.State) {
	p.mu.Lock()
	svcChanges, epChanges := countChanges(p.latest, st)
	p.latest = st
	if p.pending == nil {
		p.queuedAt = time.Now()
		syncLastQueued.SetToCurrentTime()
	}
	if prev := p.pending; prev != nil && prev.Seq != 0 && st.Since == prev.Seq {
		// Merged with the State not synced yet, st still says what changed
		// since the one synced last.
		merged := *st
		merged.Since = prev.Since
		merged.Changed = append(slices.Clip(prev.Changed), st.Changed...)
		st = &merged
	}
	p.pending = st
	p.mu.Unlock()
	serviceChangesTotal.Add(float64(svcChanges))
	serviceChangesPending.Add(float64(svcChanges))
	endpointChangesTotal.Add(float64(epChanges))
	endpointChangesPending.Add(float64(epChanges))
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// Run is the sync goroutine: it applies updates (at most one sync per
// MinSyncPeriod) and re-syncs rules every SyncPeriod until ctx ends, then
// closes every listener, waits up to grace for open connections and returns.
func (p *Proxier) Run(ctx context.Context, grace time.Duration) {
	p.ctx = ctx
	running.add(p)
	defer running.remove(p)
	stopWorkers, workersDone := make(chan struct{}), make(chan struct{})
	go func() { p.workers.Run(stopWorkers); close(workersDone) }()
	copiersDone := make(chan struct{})
	go func() { p.copiers.Run(stopWorkers); close(copiersDone) }()
	defer func() { close(stopWorkers); <-workersDone; <-copiersDone }() // after shutdown: no handler left
	if p.cfg.parkIdleAfter() > 0 {
		if parker, err := sock.NewParker(); err != nil {
			p.cfg.log().WithError(err).Warn("Idle connections keep their goroutines: no epoll set for parking them")
		} else {
			// Stopped after shutdown, before the copiers: whatever is still
			// parked then is handed back to them.
			p.parker.Store(parker)
			stopParker, parkerDone := make(chan struct{}), make(chan struct{})
			go func() { parker.Run(stopParker); close(parkerDone) }()
			defer func() {
				close(stopParker)
				<-parkerDone
				_ = parker.Close()
			}()
		}
	}
	if idle := p.cfg.TCPIdleTimeout; idle > 0 {
		swept := make(chan struct{})
		go func() { p.conns.sweepIdle(ctx, idle); close(swept) }()
		defer func() { <-swept }()
	}
	minPeriod, period := p.cfg.MinSyncPeriod, p.cfg.SyncPeriod
	if period <= 0 {
		period = 30 * time.Second
	}
	ticker := time.NewTicker(period)
	defer ticker.Stop()
	retry := time.NewTimer(time.Hour)
	retry.Stop()
	defer retry.Stop()
	reopen := time.NewTimer(time.Hour)
	reopen.Stop()
	defer reopen.Stop()
	reopenIn := max(minPeriod, time.Second)
	var current *config.State
	limit := rate.Inf
	if minPeriod > 0 {
		limit = rate.Every(minPeriod)
	}
	limiter := rate.NewLimiter(limit, syncBurst)
	// The periodic check of the installed rules runs beside the syncs
	// (RuleChecker): at 10k service ports reading them back takes a second,
	// which must not hold up changes. It is the sync goroutine's: one at a
	// time, waited for at shutdown.
	checker, _ := p.cfg.Rules.(RuleChecker)
	checking := false
	checked := make(chan bool, 1)
	defer func() {
		if checking {
			<-checked
		}
	}()
	// The rules are written on a goroutine of their own, one write at a
	// time (ruleWrite): syncs go on meanwhile, and their writes merge into
	// the one that follows.
	var writing, queued *ruleWrite
	written := make(chan error, 1)
	write := func(w *ruleWrite) {
		writing = w
		p.enter()
		go func() { written <- p.writeRules(w) }()
	}
	// unwritten tells Health the oldest change of the writes under way or
	// queued: a change is in force once its rules are.
	unwritten := func() {
		var oldest time.Time
		for _, w := range []*ruleWrite{writing, queued} {
			if w != nil {
				oldest = earliest(oldest, w.queuedAt)
			}
		}
		p.mu.Lock()
		p.unwrittenAt = oldest
		p.mu.Unlock()
	}
	stop := func() {
		if writing != nil {
			err := <-written
			p.leave()
			p.written(writing, err)
		}
		if queued != nil {
			p.written(queued, ctx.Err()) // stops what it replaced
		}
		p.shutdown(grace)
	}
	for {
		verify := false
		select {
		case <-ctx.Done():
			stop()
			return
		case <-p.kick:
		case <-ticker.C:
			if checker == nil {
				verify = true
				break
			}
			if !checking {
				checking = true
				go func() {
					drift, err := checker.Check(ctx)
					if err != nil && ctx.Err() == nil {
						p.cfg.log().WithError(err).Warn("Checking the installed rules failed")
					}
					checked <- drift
				}()
			}
			continue
		case drift := <-checked:
			checking = false
			if !drift {
				continue
			}
			// The rules drifted: the next sync rewrites them.
		case err := <-written:
			w := writing
			writing = nil
			p.leave()
			p.written(w, err)
			end := time.Now()
			syncDuration.Observe(end.Sub(w.start).Seconds())
			p.mu.Lock()
			p.lastErr, p.lastWritten = err, w.state
			if err == nil {
				p.lastUpdated = end
			}
			p.mu.Unlock()
			if err != nil {
				retry.Reset(max(minPeriod, time.Second))
			} else {
				syncLast.Set(float64(end.UnixNano()) / 1e9)
				if !w.queuedAt.IsZero() {
					programmingDuration.Observe(end.Sub(w.queuedAt).Seconds())
				}
			}
			if queued != nil {
				write(queued)
				queued = nil
			}
			unwritten()
			continue
		case <-retry.C:
			verify = true
		case <-reopen.C:
		}
		// A token bucket, as kube-proxy's BoundedFrequencyRunner: a lone
		// change, or a Service and then its slice, syncs at once; under
		// churn syncs come at most once per --min-sync-period on average,
		// and the changes that arrive meanwhile merge into the next one.
		if err := limiter.Wait(ctx); err != nil {
			stop()
			return
		}
		p.mu.Lock()
		queuedAt := p.queuedAt
		if p.pending != nil {
			current, p.pending = p.pending, nil
			p.queuedAt = time.Time{}
			p.unwrittenAt = earliest(p.unwrittenAt, queuedAt) // until the write is made (unwritten)
		}
		p.mu.Unlock()
		if current == nil {
			continue // nothing to serve yet: program nothing
		}
		serviceChangesPending.Set(0)
		endpointChangesPending.Set(0)
		p.enter()
		w := p.apply(current, verify)
		p.leave()
		w.queuedAt = queuedAt
		p.mu.Lock()
		p.healthListenFailures = p.listenFailures
		p.nodeDeleting = current.NodeDeleting
		p.mu.Unlock()
		if writing == nil {
			write(w)
		} else {
			queued = queued.merge(w)
		}
		unwritten()
		if p.failing > 0 {
			// Listeners or NodePorts that could not be opened are
			// tried again soon, then less often while they fail.
			reopen.Reset(reopenIn)
			reopenIn = min(2*reopenIn, period)
		} else {
			reopenIn = max(minPeriod, time.Second)
		}
	}
}

// sync makes listeners and rules match st and waits for the rules: apply,
// then the write it returns.
func (p *Proxier) sync(st *config.State, verify bool) error {
	w := p.apply(st, verify)
	err := p.writeRules(w)
	p.written(w, err)
	return err
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
func (p *Proxier) apply(st *config.State, verify bool) *ruleWrite {
	log := p.cfg.log()
	start := time.Now()
	// No map of the desired frontends is built: at 10k service ports it
	// was most of a sync's allocations.
	var keys []frontendKey
	wanted := func(key frontendKey, sp *config.ServicePort) bool {
		keys = frontendKeys(keys[:0], key.Name, sp)
		return slices.Contains(keys, key)
	}
	var gone, stale []*frontend
	var released []*frontend // stopped here, their ports held until a rule write without them
	var closed []config.ServicePortName
	var retaken map[frontendKey]*frontend // frontends that got their NodePort back, for serve
	visit := func(key frontendKey, fe *frontend) {
		sp := st.Ports[key.Name]
		if fe.nodePortErr != nil && sp != nil && fe.spec.SameFrontend(sp) {
			// Every full sync tries again to take the NodePort another
			// process (or Service) held: a new frontend, kept only if
			// it got it.
			nf := p.retakeNodePort(key, sp)
			if nf == nil {
				return
			}
			if retaken == nil {
				retaken = map[frontendKey]*frontend{}
			}
			retaken[key] = nf
			p.liveMu.Lock()
			delete(p.frontends, key)
			p.liveMu.Unlock()
			stale = append(stale, fe)
			return
		}
		if sp == fe.spec {
			return // sources hand on an unchanged port as the same pointer
		}
		removed := sp == nil || !wanted(key, sp)
		if !removed && fe.spec.SameFrontend(sp) {
			return
		}
		p.liveMu.Lock()
		delete(p.frontends, key)
		p.liveMu.Unlock()
		closed = append(closed, key.Name)
		switch {
		case fe.holdsNodePort():
			// Its successor may need the same NodePort: stop it now
			// (the one case of a replacement that is break-before-make).
			fe.stop()
			released = append(released, fe)
		case removed:
			gone = append(gone, fe)
		default:
			stale = append(stale, fe)
		}
	}
	// When the State says which ports changed since the one synced last,
	// only those are visited: at 10k service ports a sync that visits
	// every port costs 20-35 ms, the better part of one change's latency.
	changed := p.changedSince(st, verify)
	if changed == nil {
		for key, fe := range p.frontends {
			visit(key, fe)
		}
	} else {
		for _, name := range changed {
			for _, key := range allFrontendKeys(name) {
				if fe := p.frontends[key]; fe != nil {
					visit(key, fe)
				}
			}
		}
	}
	kept := len(p.frontends)
	rezone := st.Zone != p.zone
	p.zone = st.Zone
	var view []Frontend
	unchanged := 0 // view[:unchanged] is as the last sync left it
	var ports func(yield func(config.ServicePortName, *config.ServicePort) bool)
	if changed == nil {
		view = make([]Frontend, 0, max(len(p.frontends), len(st.Ports))+8)
		ports = func(yield func(config.ServicePortName, *config.ServicePort) bool) {
			for name, sp := range st.Ports {
				if !yield(name, sp) {
					return
				}
			}
		}
	} else {
		// The last view without the changed ports, which are served
		// again below.
		set := make(map[config.ServicePortName]bool, len(changed))
		for _, name := range changed {
			set[name] = true
		}
		p.viewMu.Lock()
		last := p.view
		p.viewMu.Unlock()
		view = make([]Frontend, 0, len(last)+2*len(changed)+8)
		for _, f := range last {
			if !set[f.Service.Name] {
				view = append(view, f)
			}
		}
		unchanged = len(view)
		ports = func(yield func(config.ServicePortName, *config.ServicePort) bool) {
			for _, name := range changed {
				if sp := st.Ports[name]; sp != nil && !yield(name, sp) {
					return
				}
			}
		}
	}
	// Ports with a NodePort first, the oldest Service first: of two that
	// claim the same NodePort, the same one wins at every start.
	var claims []*config.ServicePort
	for _, sp := range ports {
		if sp.NodePort != 0 {
			claims = append(claims, sp)
		}
	}
	sort.Slice(claims, func(i, j int) bool { return claimsFirst(claims[i], claims[j]) })
	for _, sp := range claims {
		keys = frontendKeys(keys[:0], sp.Name, sp)
		view = p.serve(view, st, sp, keys, retaken, rezone)
	}
	// Ports that need a listener are opened in the order of their names:
	// with ports chosen from each one's preferred port upwards, a restart
	// opens the same Services on the same ports (and finds its rules).
	var opening []*config.ServicePort
	for name, sp := range ports {
		if sp.NodePort != 0 {
			continue
		}
		keys = frontendKeys(keys[:0], name, sp)
		if p.needsListener(keys) {
			opening = append(opening, sp)
			continue
		}
		view = p.serve(view, st, sp, keys, retaken, rezone)
	}
	slices.SortFunc(opening, func(a, b *config.ServicePort) int { return compareNames(a.Name, b.Name) })
	for _, sp := range opening {
		keys = frontendKeys(keys[:0], sp.Name, sp)
		view = p.serve(view, st, sp, keys, retaken, rezone)
	}
	p.syncHealthChecks(st)
	p.failing, p.listenFailures, p.failingNames = 0, 0, p.failingNames[:0]
	for _, fe := range view {
		if fe.Err != nil {
			p.listenFailures++
		}
		if fe.Err != nil || fe.NodePortErr != nil {
			p.failing++
			p.failingNames = append(p.failingNames, fe.Service.Name)
		}
	}
	listenerFailures.Set(float64(p.listenFailures))
	nodePortConflicts.Set(float64(p.failing - p.listenFailures))
	// After serve, so that a port freed here cannot go to a new frontend.
	for _, fe := range gone {
		fe.stop()
	}
	released = append(released, gone...)
	for _, name := range closed {
		if sp := st.Ports[name]; sp == nil || len(frontendKeys(nil, name, sp)) == 0 {
			deleteServiceMetrics(name.String()) // else churn would grow /metrics forever
		}
	}
	p.synced = st
	p.viewMu.Lock()
	p.view, p.sorted = view, nil // sorted when first read: sorting 10k costs ms
	p.viewNode, p.viewZone = st.Node, st.Zone
	p.viewMu.Unlock()

	p.lines.flush(log)
	fields := logrus.Fields{"frontends": len(p.frontends), "closed": len(closed), "took": time.Since(start).String(), "visited": "all"}
	if changed != nil {
		fields["visited"] = len(changed)
	}
	if opened := len(p.frontends) - kept; opened+len(closed) >= bulkSync {
		// A bulk sync (a start, a restore of many Services) leaves tens of
		// MB of garbage; collected later, it would land on the next small
		// change, whose sync then shares the CPU with a mark phase that
		// scans every listener's goroutine (at 10k: +15-25 ms, in ~40 % of
		// the changes measured right after a load). Collect it now.
		gcStart := time.Now()
		runtime.GC()
		fields["gcAfterBulk"] = time.Since(gcStart).String()
	}
	log.WithFields(fields).Debug("Synced")
	w := &ruleWrite{view: view, verify: verify, release: released, stale: stale, start: start, state: st}
	if changed != nil {
		w.changed, w.fresh = changed, view[unchanged:]
	}
	return w
}

// ruleWrite is one write of the rules, made by a sync and carried out by the
// rule writer (Run) while the next syncs go on: a Service's rules take
// 15-40 ms to write at 10k service ports (most of it iptables-restore
// exiting after its commit), and the slice that follows the Service must
// not wait for that to reach its balancer.
type ruleWrite struct {
	view []Frontend
	// changed names the service ports served again since the write
	// before (nil: any may have); fresh are their frontends in view.
	changed []config.ServicePortName
	fresh   []Frontend
	verify  bool
	// release were closed before this write was made: their ports are
	// free once it succeeds. stale were replaced: they stop accepting once
	// the rules point at their successors.
	release, stale []*frontend
	start          time.Time     // of the first sync in it
	queuedAt       time.Time     // the oldest change in it
	state          *config.State // the State of the last sync in it
}

// merge returns the write that does w and then next: the newer view, the
// changes of both.
func (w *ruleWrite) merge(next *ruleWrite) *ruleWrite {
	if w == nil {
		return next
	}
	m := *next
	m.verify = w.verify || next.verify
	m.release = append(slices.Clip(w.release), next.release...)
	m.stale = append(slices.Clip(w.stale), next.stale...)
	m.start = w.start
	m.queuedAt = earliest(w.queuedAt, next.queuedAt)
	if w.changed == nil || next.changed == nil {
		m.changed, m.fresh = nil, nil
		return &m
	}
	m.changed = append(slices.Clip(w.changed), next.changed...)
	set := make(map[config.ServicePortName]bool, len(m.changed))
	for _, name := range m.changed {
		set[name] = true
	}
	m.fresh = nil
	for _, f := range m.view {
		if set[f.Service.Name] {
			m.fresh = append(m.fresh, f)
		}
	}
	return &m
}

// writeRules carries out w. It touches nothing of the sync goroutine's, so
// Run calls it on a goroutine of its own; one write at a time.
func (p *Proxier) writeRules(w *ruleWrite) error {
	if p.cfg.Rules == nil {
		return nil
	}
	ctx := p.ctx
	if ctx == nil {
		ctx = context.Background() // a sync without Run (tests)
	}
	var err error
	cs, ok := p.cfg.Rules.(ChangeSyncer)
	if w.changed != nil && ok {
		err = cs.SyncChanged(ctx, w.view, w.changed, w.fresh)
	} else {
		err = p.cfg.Rules.Sync(ctx, w.view, w.verify)
	}
	if err != nil && ctx.Err() == nil {
		p.cfg.log().WithError(err).Error("Rule sync failed; will retry")
	}
	return err
}

// written finishes w on the sync goroutine once its rules are written (err
// nil) or failed: replaced listeners stop, and after a success the ports of
// every frontend closed before it go back to the allocator.
func (p *Proxier) written(w *ruleWrite, err error) {
	for _, fe := range w.stale {
		fe.stop()
	}
	p.unreleased = append(append(p.unreleased, w.release...), w.stale...)
	if err == nil {
		for _, fe := range p.unreleased {
			fe.release()
		}
		clear(p.unreleased)
		p.unreleased = p.unreleased[:0]
	}
	p.lines.flush(p.cfg.log())
}

// retakeNodePort opens a new frontend for key that holds sp's NodePort, or
// returns nil (quietly: it is tried again every sync) while the port is
// still taken.
func (p *Proxier) retakeNodePort(key frontendKey, sp *config.ServicePort) *frontend {
	nf, err := p.open(key, sp)
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

// claimsFirst orders the Services that claim NodePorts: the oldest first,
// then by name.
func claimsFirst(a, b *config.ServicePort) bool {
	if !a.Created.Equal(b.Created) {
		return a.Created.Before(b.Created)
	}
	return a.Name.String() < b.Name.String()
}

// listenerLinesMax is how many listeners one sync opens (or closes) with a
// log line each; beyond, one summary line says how many, and the lines of
// each go to debug level: a start at 10k service ports wrote 10k lines.
const listenerLinesMax = 10

// listenerLines collects the listeners a sync opened and closed, for its log.
type listenerLines struct{ opened, closed []*frontend }

func (l *listenerLines) flush(log logrus.FieldLogger) {
	for _, x := range []struct {
		fes []*frontend
		msg string
	}{{l.opened, "Listening"}, {l.closed, "Listener closed"}} {
		if len(x.fes) <= listenerLinesMax {
			for _, fe := range x.fes {
				fe.log().Info(x.msg)
			}
			continue
		}
		if debugEnabled(log) {
			for _, fe := range x.fes {
				fe.log().Debug(x.msg)
			}
		}
		log.WithField("listeners", len(x.fes)).Info(x.msg + " (one line per listener at debug level)")
	}
	clear(l.opened)
	clear(l.closed)
	l.opened, l.closed = l.opened[:0], l.closed[:0]
}

// debugEnabled says whether log writes debug lines: a line per listener
// is not even made otherwise.
func debugEnabled(log logrus.FieldLogger) bool {
	switch l := log.(type) {
	case *logrus.Entry:
		return l.Logger.IsLevelEnabled(logrus.DebugLevel)
	case *logrus.Logger:
		return l.IsLevelEnabled(logrus.DebugLevel)
	}
	return true
}

// syncBurst is how many syncs may follow each other without waiting for
// --min-sync-period: two, so that a Service and then its EndpointSlice (two
// events, two States) are both served at once.
const syncBurst = 2

// bulkSync is how many frontends opened or closed in one sync make it bulk.
const bulkSync = 1000

// changedSince returns the names of the ports that may differ between st
// and the State synced last, when st says so, and those of the frontends
// that failed, to be tried again (nil: visit every port). A full visit is
// kept for what only it does: verify the rules and choose endpoints again
// for a new zone. One NodePort held by another process used to make every
// sync a full one: at 10k service ports 30-60 ms instead of 1.
func (p *Proxier) changedSince(st *config.State, verify bool) []config.ServicePortName {
	last := p.synced
	if verify || last == nil || st.Zone != p.zone || st.Node != last.Node {
		return nil
	}
	var changed []config.ServicePortName
	switch {
	case st == last: // a retry of what failed
	case st.Since == 0 || st.Since != last.Seq:
		return nil
	default:
		changed = st.Changed
	}
	names := make([]config.ServicePortName, 0, len(changed)+len(p.failingNames))
	seen := make(map[config.ServicePortName]bool, cap(names))
	for _, name := range slices.Concat(changed, p.failingNames) {
		if !seen[name] {
			seen[name] = true
			names = append(names, name)
		}
	}
	return names
}

// allFrontendKeys lists every key a frontend of the port name may have.
func allFrontendKeys(name config.ServicePortName) []frontendKey {
	keys := make([]frontendKey, 0, 6)
	for _, fam := range []int{4, 6} {
		for _, kind := range Kinds {
			keys = append(keys, frontendKey{Name: name, Kind: kind, Family: fam})
		}
	}
	return keys
}

// needsListener says whether a frontend of keys has no listener yet.
func (p *Proxier) needsListener(keys []frontendKey) bool {
	for _, key := range keys {
		if p.frontends[key] == nil {
			return true
		}
	}
	return false
}

// compareNames orders service port names: namespace, name, port.
func compareNames(a, b config.ServicePortName) int {
	if c := strings.Compare(a.Namespace, b.Namespace); c != 0 {
		return c
	}
	if c := strings.Compare(a.Name, b.Name); c != 0 {
		return c
	}
	return strings.Compare(a.Port, b.Port)
}

// serve makes sure a frontend serves sp for each of keys (opening the ones
// missing) and appends them to view.
func (p *Proxier) serve(view []Frontend, st *config.State, sp *config.ServicePort, keys []frontendKey, retaken map[frontendKey]*frontend, rezone bool) []Frontend {
	log := p.cfg.log()
	for _, key := range keys {
		fe := p.frontends[key]
		opened := fe == nil
		if opened {
			if fe = retaken[key]; fe == nil {
				var err error
				fe, err = p.open(key, sp)
				if err != nil {
					log.WithField("service", key.Name.String()).WithError(err).Error("Cannot open listener; service port not served, retrying")
					view = append(view, Frontend{Service: sp, Kind: key.Kind, Family: key.Family, Protocol: sp.Protocol, Err: err})
					continue
				}
				if fe.nodePortErr != nil {
					fe.log().Error(fe.nodePortErr)
					if p.cfg.Events != nil {
						p.cfg.Events(sp, "NodePortConflict", fmt.Sprintf("%s (node %s)", fe.nodePortErr, st.Node))
					}
				}
			}
			p.lines.opened = append(p.lines.opened, fe)
			p.liveMu.Lock()
			p.frontends[key] = fe
			p.liveMu.Unlock()
		}
		if opened || fe.spec != sp || rezone {
			// Sources reuse an unchanged port's pointer: only changed
			// ports cost anything here.
			prev := fe.spec
			if opened {
				prev = nil
			}
			warnAnnotations(fe.log(), prev, sp)
			fe.spec = sp
			fe.proxyProto.Store(sp.ProxyProtocol)
			fe.bal.Update(config.UsableEndpoints(sp.Endpoints, key.Family, key.localOnly(sp), st.Node, st.Zone), sp.AffinityTimeout, p.outlierFor(sp), sp.Scheduler)
		}
		view = append(view, Frontend{Service: sp, Kind: key.Kind, Family: key.Family, Protocol: sp.Protocol, Listen: fe.listen,
			NodePortErr: fe.nodePortErr})
	}
	return view
}

// syncHealthChecks gives ServiceHealth every Service with a health check
// node port and its ready endpoints on this node (counted once across the
// Service's ports and families), when that changed.
func (p *Proxier) syncHealthChecks(st *config.State) {
	if p.cfg.ServiceHealth == nil {
		return
	}
	type svcKey struct{ ns, name string }
	byService := map[svcKey]*healthcheck.Service{}
	local := map[svcKey]map[netip.Addr]bool{}
	for _, sp := range st.Ports {
		if sp.HealthCheckNodePort == 0 {
			continue
		}
		k := svcKey{sp.Name.Namespace, sp.Name.Name}
		if byService[k] == nil {
			byService[k] = &healthcheck.Service{Namespace: k.ns, Name: k.name, Port: sp.HealthCheckNodePort}
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
	sort.Slice(out, func(i, j int) bool { return out[i].Port < out[j].Port })
	if p.healthChecks != nil && slices.Equal(out, p.healthChecks) {
		return
	}
	p.healthChecks = out
	p.cfg.ServiceHealth.Sync(out)
}

// shutdown stops accepting — the rules still point at the closed ports, so a
// new connection is refused at once instead of timing out — lets open
// connections drain for up to grace, and removes the rules last. Removing
// them first would break the draining connections: on Linux 6.18 with
// nf_tables, deleting the last REDIRECT rule stops the NAT of flows already
// redirected (measured in the netns tests).
func (p *Proxier) shutdown(grace time.Duration) {
	for key, fe := range p.frontends {
		fe.close()
		p.liveMu.Lock()
		delete(p.frontends, key)
		p.liveMu.Unlock()
	}
	p.viewMu.Lock()
	p.view, p.sorted = nil, nil
	p.viewMu.Unlock()
	p.lines.flush(p.cfg.log())
	p.accMu.Lock()
	if p.acc != nil {
		p.acc.Close()
		p.acc = nil
	}
	p.accMu.Unlock()
	p.conns.drain(grace)
	if p.cfg.Rules != nil {
		ctx, cancel := context.WithTimeout(context.Background(), removeRulesTimeout)
		defer cancel()
		if err := p.cfg.Rules.Sync(ctx, nil, false); err != nil {
			p.cfg.log().WithError(err).Warn("Removing rules at shutdown failed; the next start (or --cleanup) removes them")
		}
	}
}

// removeRulesTimeout bounds the removal of the rules at shutdown (~1 s at
// 10k service ports): a rule command that hangs must not keep the daemon
// from exiting. Rules left behind redirect to closed ports, which refuse.
const removeRulesTimeout = 10 * time.Second

// acceptor returns the acceptor of the TCP listeners, made at first use.
func (p *Proxier) acceptor() (*sock.Acceptor, error) {
	p.accMu.Lock()
	defer p.accMu.Unlock()
	if p.acc == nil {
		a, err := sock.NewAcceptor()
		if err != nil {
			return nil, err
		}
		p.acc = a
	}
	return p.acc, nil
}

// Health is what /healthz reports.
type Health struct {
	LastUpdated time.Time // end of the last successful sync; zero before the first
	QueuedAt    time.Time // when the oldest change not yet in force (its sync or rule write to come) arrived; zero if none
	LastErr     error     // the last sync's error
	// ListenFailures counts the listeners the last sync could not open:
	// not one Service's conflict (NodePort conflicts do not count) but the
	// daemon's own trouble — the port range exhausted, out of
	// descriptors, a bind address that is not local.
	ListenFailures int
	// OutOfFiles: a system call failed for want of descriptors less than
	// 10 s ago (accept, dial, a flow's socket, a listener).
	OutOfFiles bool
	// NodeDeleting: the node is being deleted or tainted for removal by
	// the cluster autoscaler (config.NodeState): /healthz fails, /livez not.
	NodeDeleting bool
}

// earliest is the earlier of two change times, the zero time meaning none.
func earliest(a, b time.Time) time.Time {
	if a.IsZero() || (!b.IsZero() && b.Before(a)) {
		return b
	}
	return a
}

// Health returns the sync state for health checks.
func (p *Proxier) Health() Health {
	p.mu.Lock()
	defer p.mu.Unlock()
	return Health{LastUpdated: p.lastUpdated, QueuedAt: earliest(p.queuedAt, p.unwrittenAt), LastErr: p.lastErr, ListenFailures: p.healthListenFailures,
		OutOfFiles: p.budget.exhaustedWithin(10 * time.Second), NodeDeleting: p.nodeDeleting}
}

// countChanges counts service ports added, removed or changed in their
// frontend, and service ports whose endpoints changed, from old to new.
func countChanges(old, new *config.State) (services, endpoints int) {
	var oldPorts map[config.ServicePortName]*config.ServicePort
	if old != nil {
		oldPorts = old.Ports
	}
	count := func(name config.ServicePortName) {
		o, sp := oldPorts[name], new.Ports[name]
		switch {
		case o == sp:
		case o == nil || sp == nil || !o.SameFrontend(sp) || o.AffinityTimeout != sp.AffinityTimeout:
			services++
		case !slices.Equal(o.Endpoints, sp.Endpoints):
			endpoints++
		}
	}
	if old != nil && new.Since != 0 && new.Since == old.Seq {
		// The source says which ports may differ: only those.
		seen := make(map[config.ServicePortName]bool, len(new.Changed))
		for _, name := range new.Changed {
			if !seen[name] {
				seen[name] = true
				count(name)
			}
		}
		return services, endpoints
	}
	for name := range new.Ports {
		count(name)
	}
	for name := range oldPorts {
		if new.Ports[name] == nil {
			services++
		}
	}
	return services, endpoints
}
