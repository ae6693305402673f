package proxy

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
)

// Rules is the kernel side: make the listed frontends' addresses reach their
// listeners, and nothing else. Sync is called one call at a time, by the
// rule writer, while the sync goroutine goes on; verify asks it to compare
// the live rules with the desired ones (once per sync period) instead of
// trusting what it wrote last.
type Rules interface {
	Sync(ctx context.Context, frontends []config.Frontend, verify bool) error
}

// ChangeSyncer is implemented by Rules that can be told what changed since
// their last Sync (iptables.Rules): the frontends of the changed service
// ports are fresh, the tail of frontends; every other frontend is as it was,
// so a sync's cost follows its change, not the node's Services.
type ChangeSyncer interface {
	SyncChanged(ctx context.Context, frontends []config.Frontend, changed []config.ServicePortName, fresh []config.Frontend) error
}

// RuleChecker is implemented by Rules that can compare the kernel's rules
// with those last written while Syncs go on (iptables.Rules): the rule
// writer then checks every sync period beside its writes instead of
// verifying inside one, and the sync goroutine syncs when Check finds a
// drift (which the next Sync repairs).
type RuleChecker interface {
	Check(ctx context.Context) (drift bool, err error)
}

// ruleWrite is one write of the rules, made by a sync (reconciler.apply)
// and carried out by the rule writer while the next syncs go on.
type ruleWrite struct {
	view []config.Frontend
	// changed names the service ports served again since the write
	// before (nil: any may have); fresh are their frontends in view.
	changed []config.ServicePortName
	fresh   []config.Frontend
	verify  bool
	// release were closed before this write was made: their ports are
	// free once it succeeds. stale were replaced: they stop accepting once
	// the rules point at their successors.
	release, stale []*dataplane.Frontend
	start          time.Time     // of the first sync in it
	queuedAt       time.Time     // the oldest change in it
	state          *config.State // the State of the last sync in it
	err            error         // the write's outcome, once written
	bulk           bool          // a bulk sync is in it: its garbage is collected once written
}

// merge returns the write that does w and then next: the newer view, the
// changes of both.
func (w *ruleWrite) merge(next *ruleWrite) *ruleWrite {
	if w == nil {
		return next
	}
	m := *next
	m.verify = w.verify || next.verify
	m.bulk = w.bulk || next.bulk
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

// ruleWriter writes the rules on a goroutine of its own, one write at a
// time: a rule write takes tens of milliseconds on a big node (most of it
// iptables-restore exiting after its commit), and the slice that follows
// the Service must not wait for that to reach its balancer. Writes
// submitted while one is under way merge into the one that follows. It also
// runs the periodic check of the installed rules (RuleChecker), one at a
// time: reading them back takes long on a big node.
type ruleWriter struct {
	rules    Rules // nil: nothing to write
	log      logrus.FieldLogger
	activity *activity
	families []string // the ip_family labels of the sync metrics

	kick chan struct{} // capacity 1: a write was submitted
	// written hands each write, done or failed, to the sync goroutine
	// (reconciler.written), in order; the next write starts once it is
	// taken.
	written chan *ruleWrite
	drift   chan bool // a check's answer: the rules drifted
	tasks   sync.WaitGroup

	mu       sync.Mutex // guards the fields below
	queued   *ruleWrite // submitted since the write under way began, merged
	writing  *ruleWrite
	checking bool
	left     []*ruleWrite // not given to the writer goroutine when it stopped
	// The outcome of the last write, for health.
	lastErr     error
	lastUpdated time.Time     // the end of the last successful write
	lastWritten *config.State // the State it was made for
}

func newRuleWriter(rules Rules, log logrus.FieldLogger, a *activity, families []string) *ruleWriter {
	return &ruleWriter{rules: rules, log: log, activity: a, families: families,
		kick: make(chan struct{}, 1), written: make(chan *ruleWrite), drift: make(chan bool, 1)}
}

// submit queues w behind the write under way, merged with what is queued.
func (rw *ruleWriter) submit(w *ruleWrite) {
	rw.mu.Lock()
	rw.queued = rw.queued.merge(w)
	rw.mu.Unlock()
	select {
	case rw.kick <- struct{}{}:
	default:
	}
}

// start runs the writer until ctx ends; stop waits for it.
func (rw *ruleWriter) start(ctx context.Context) {
	rw.tasks.Go(func() { rw.run(ctx) })
}

func (rw *ruleWriter) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-rw.kick:
		}
		rw.mu.Lock()
		w := rw.queued
		rw.queued, rw.writing = nil, w
		rw.mu.Unlock()
		if w == nil {
			continue
		}
		rw.activity.enter()
		w.err = rw.write(ctx, w)
		rw.activity.leave()
		rw.record(w)
		select {
		case rw.written <- w:
		case <-ctx.Done():
			rw.mu.Lock()
			rw.left = append(rw.left, w)
			rw.mu.Unlock()
			return
		}
	}
}

// write carries out w.
func (rw *ruleWriter) write(ctx context.Context, w *ruleWrite) error {
	if rw.rules == nil {
		return nil
	}
	var err error
	cs, ok := rw.rules.(ChangeSyncer)
	if w.changed != nil && ok {
		err = cs.SyncChanged(ctx, w.view, w.changed, w.fresh)
	} else {
		err = rw.rules.Sync(ctx, w.view, w.verify)
	}
	if err != nil && ctx.Err() == nil {
		rw.log.WithError(err).Error("Rule sync failed; will retry")
	}
	return err
}

// record keeps w's outcome for health and metrics.
func (rw *ruleWriter) record(w *ruleWrite) {
	end := time.Now()
	took := end.Sub(w.start).Seconds()
	kind := syncFullDuration
	if w.changed != nil {
		kind = syncPartialDuration
	}
	for _, fam := range rw.families {
		syncDuration.WithLabelValues(fam).Observe(took)
		kind.WithLabelValues(fam).Observe(took)
		if w.err == nil {
			syncLast.WithLabelValues(fam).Set(float64(end.UnixNano()) / 1e9)
			if !w.queuedAt.IsZero() {
				programmingDuration.WithLabelValues(fam).Observe(end.Sub(w.queuedAt).Seconds())
			}
		}
	}
	rw.mu.Lock()
	defer rw.mu.Unlock()
	rw.writing = nil
	rw.lastErr, rw.lastWritten = w.err, w.state
	if w.err == nil {
		rw.lastUpdated = end
	}
}

// check starts a comparison of the installed rules with those written,
// unless one is under way; its answer comes on drift. false: the Rules
// cannot check (a sync that verifies does it instead).
func (rw *ruleWriter) check(ctx context.Context) bool {
	checker, ok := rw.rules.(RuleChecker)
	if !ok {
		return false
	}
	rw.mu.Lock()
	defer rw.mu.Unlock()
	if rw.checking {
		return true
	}
	rw.checking = true
	rw.tasks.Go(func() {
		drift, err := checker.Check(ctx)
		if err != nil && ctx.Err() == nil {
			rw.log.WithError(err).Warn("Checking the installed rules failed")
		}
		rw.mu.Lock()
		rw.checking = false
		rw.mu.Unlock()
		if drift {
			select {
			case rw.drift <- true:
			default: // one is pending already
			}
		}
	})
	return true
}

// stop waits for the writer's goroutines (ctx has ended) and returns the
// writes it did not hand over: the last one written, and the one queued,
// which failed with err.
func (rw *ruleWriter) stop(err error) []*ruleWrite {
	rw.tasks.Wait()
	rw.mu.Lock()
	defer rw.mu.Unlock()
	left := rw.left
	if rw.queued != nil {
		rw.queued.err = err
		left = append(left, rw.queued)
	}
	rw.left, rw.queued = nil, nil
	return left
}

// status is the rule writer's part of Health: the last write's outcome and
// the oldest change whose write is under way or queued.
func (rw *ruleWriter) status() (lastUpdated, unwrittenAt time.Time, lastErr error) {
	rw.mu.Lock()
	defer rw.mu.Unlock()
	for _, w := range []*ruleWrite{rw.writing, rw.queued} {
		if w != nil {
			unwrittenAt = earliest(unwrittenAt, w.queuedAt)
		}
	}
	return rw.lastUpdated, unwrittenAt, rw.lastErr
}

// activity counts the syncs and rule writes under way, for Proxier.Quiet.
type activity struct {
	busy      atomic.Int32
	idleSince atomic.Int64 // unix nanoseconds: when the last one ended
}

func (a *activity) enter() { a.busy.Add(1) }

func (a *activity) leave() {
	a.idleSince.Store(time.Now().UnixNano()) // before busy drops: quiet sees both
	a.busy.Add(-1)
}

// quiet reports whether nothing has been under way for at least d.
func (a *activity) quiet(d time.Duration) bool {
	return a.busy.Load() == 0 && time.Since(time.Unix(0, a.idleSince.Load())) >= d
}

// earliest is the earlier of two change times, the zero time meaning none.
func earliest(a, b time.Time) time.Time {
	if a.IsZero() || (!b.IsZero() && b.Before(a)) {
		return b
	}
	return a
}
