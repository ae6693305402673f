// Package proxy is the orchestration: it turns the States a config source
// gives it into frontends (package dataplane) and one rule write per sync
// (through Rules, package iptables in the daemon), and carries a handover's
// steps out on its sync goroutine.
//
// Typical use:
//
//	p := proxy.New(proxy.Config{Rules: rules})
//	go p.Run(ctx, grace) // the sync goroutine: listeners follow each State
//	p.Update(state)      // from a config source (a config.Sink), any number of times
//
// A Proxier is four owners, each with its own state, lock and goroutines:
//
//	Proxier     the change intake (Update) and the sync goroutine (Run, paced by package syncrunner)
//	reconciler  the frontends: one Delta in, listeners and one rule write out (reconcile.go, carryout.go, publish.go)
//	ruleWriter  the rule writes, one at a time on a goroutine of its own (rulewriter.go)
//	dataplane   what connections share: accept loop, workers, parker,
//	            connection table, descriptor budget, port allocator (package dataplane)
//
// It imports the data path (dataplane), the leaf packages below it and
// config; never iptables (cmd wires the two) or cmd.
package proxy

import (
	"context"
	"encoding/json"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/syncrunner"
)

// Proxier turns States into listeners and rules.
type Proxier struct {
	cfg      Config
	dp       *dataplane.Dataplane
	rec      *reconciler
	writer   *ruleWriter
	activity activity
	keeping  *keeping      // nil without a keeper (keeper.go)
	kick     chan struct{} // capacity 1: merges bursts of Updates
	calls    chan func()   // run on the sync goroutine: a handover's steps (handover.go)
	serving  chan struct{} // closed after the first rule write
	released atomic.Bool   // Release was called

	// The sync goroutine's.
	frozen      bool                            // a handover is under way: no syncs
	freeze      func() (json.RawMessage, error) // called before the first sync (Inherit): the predecessor's pick state
	servingShut bool                            // serving is closed: a rule write succeeded
	stopWriter  context.CancelFunc

	mu         sync.Mutex    // guards the fields below
	pending    *config.Delta // the changes given to Update and not synced yet, merged
	queuedAt   time.Time     // the oldest change in pending
	applyingAt time.Time     // the oldest change of the sync under way, until its write is submitted
	latest     *config.State // the newest State given to Update
}

// New returns a Proxier; nothing happens until Run.
func New(cfg Config) *Proxier {
	p := &Proxier{cfg: cfg, kick: make(chan struct{}, 1), calls: make(chan func()), serving: make(chan struct{})}
	p.dp = dataplane.New(p.cfg.dataplane())
	p.rec = newReconciler(&p.cfg, p.dp)
	p.writer = newRuleWriter(cfg.Rules, p.cfg.log(), &p.activity, familyNames(cfg.Families))
	if cfg.Keeper != nil {
		p.keeping = newKeeping()
		p.dp.SetLetGo(p.letGo)
	}
	return p
}

var _ config.Sink = (*Proxier)(nil)

// Update implements config.Sink: it records st as the state to serve and
// wakes the sync goroutine. It never blocks on kernel work.
func (p *Proxier) Update(st *config.State) {
	p.mu.Lock()
	d := config.Diff(p.latest, st)
	svcChanges, epChanges := d.Counts()
	p.latest = st
	if p.pending == nil {
		p.queuedAt = time.Now()
		for _, fam := range p.writer.families {
			syncLastQueued.WithLabelValues(fam).SetToCurrentTime()
		}
	} else {
		d = p.pending.Merge(d) // still says what changed since the State synced last
	}
	p.pending = &d
	p.mu.Unlock()
	serviceChangesTotal.Add(float64(svcChanges))
	serviceChangesPending.Add(float64(svcChanges))
	endpointChangesTotal.Add(float64(epChanges))
	endpointChangesPending.Add(float64(epChanges))
	p.wake()
}

// wake has the sync goroutine look at the pending changes.
func (p *Proxier) wake() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// Run is the sync goroutine: it applies updates (at most one sync per
// MinSyncPeriod) and re-syncs rules every SyncPeriod until ctx ends, then
// closes every listener, waits up to grace for open connections and returns.
func (p *Proxier) Run(ctx context.Context, grace time.Duration) {
	p.dp.Start(ctx)
	running.add(p)
	defer running.remove(p)
	writerCtx, stopWriter := context.WithCancel(ctx)
	defer stopWriter()
	p.stopWriter = stopWriter
	p.writer.start(writerCtx)
	if p.keeping != nil {
		var sender sync.WaitGroup
		defer sender.Wait()
		sender.Go(func() { p.sendKept(writerCtx) })
	}
	t := syncrunner.New(p.cfg.MinSyncPeriod, p.cfg.SyncPeriod)
	defer t.Stop()
	for {
		verify := false
		select {
		case <-ctx.Done():
			p.shutdown(ctx, grace)
			return
		case fn := <-p.calls:
			fn()
			continue
		case <-p.kick:
		case <-t.Period():
			if p.frozen {
				continue
			}
			if p.writer.check(ctx) {
				continue // a drift found syncs (below)
			}
			verify = true
		case <-p.writer.drift: // the next sync rewrites the rules
		case w := <-p.writer.written:
			p.wroteRules(w)
			if w.err != nil {
				t.RetryWrite()
			}
			continue
		case <-t.Retry():
			verify = true
		case <-t.Reopen():
		}
		if p.frozen {
			continue // a handover is under way: the changes wait (Thaw)
		}
		// The changes that arrive while it waits merge into this sync.
		if err := t.Wait(ctx); err != nil {
			p.shutdown(ctx, grace)
			return
		}
		if p.syncPending(verify) {
			t.Failing(p.rec.failing > 0)
		}
	}
}

// syncPending applies the changes given since the last sync (or the State
// synced last again)
// and submits its rule write; false when there is none yet: nothing is
// programmed before the sources have a State.
func (p *Proxier) syncPending(verify bool) bool {
	p.mu.Lock()
	d, queuedAt := p.pending, p.queuedAt
	if d != nil {
		p.pending, p.queuedAt, p.applyingAt = nil, time.Time{}, queuedAt
	}
	p.mu.Unlock()
	if d == nil {
		if p.rec.synced == nil {
			return false
		}
		again := config.Diff(p.rec.synced, p.rec.synced) // a retry or a periodic sync
		d = &again
	}
	serviceChangesPending.Set(0)
	endpointChangesPending.Set(0)
	if p.freeze != nil {
		// The predecessor stops changing anything: from this sync on,
		// the frontends and the rules are ours.
		freeze := p.freeze
		p.freeze = nil
		picks, err := freeze()
		if err == nil && len(picks) > 0 {
			err = json.Unmarshal(picks, &p.rec.inheritedPicks)
		}
		if err != nil {
			p.cfg.log().WithError(err).Warn("The predecessor did not freeze (or its pick state is unreadable); syncing anyway")
		}
	}
	p.activity.enter()
	w := p.rec.apply(*d, verify)
	p.rec.inheritedPicks = nil // what no frontend took: Services gone meanwhile
	p.keepSockets()            // before the rules point at what it opened
	p.activity.leave()
	w.queuedAt = queuedAt
	p.writer.submit(w)
	p.mu.Lock()
	p.applyingAt = time.Time{} // the writer has it now
	p.mu.Unlock()
	return true
}

// wroteRules takes a finished rule write on the sync goroutine. The first
// that succeeded points the node's rules at this daemon's listeners: from
// then on it serves (Serving is closed), and the inherited sockets no
// Service took are closed.
func (p *Proxier) wroteRules(w *ruleWrite) {
	p.rec.written(w)
	if w.err != nil || p.servingShut {
		return
	}
	p.servingShut = true
	if n := p.dp.CloseInherited(); n > 0 {
		p.cfg.log().WithField("sockets", n).Info("Closed the inherited sockets of Services gone meanwhile")
	}
	close(p.serving)
}

// shutdown stops accepting and lets open connections drain for up to
// grace. The rules stay, as kube-proxy leaves its own: they point at the
// closed ports, so a new connection is refused at once (instead of leaving
// by the default route) until the next start takes the Services back and
// rewrites them; only --cleanup removes them. Removing them would also cut
// the draining connections: on Linux 6.18 with nf_tables, deleting the
// last REDIRECT rule stops the NAT of flows already redirected.
func (p *Proxier) shutdown(ctx context.Context, grace time.Duration) {
	if !p.released.Load() { // else Release did this
		for _, w := range p.writer.stop(ctx.Err()) {
			p.wroteRules(w) // a write done as the stop came counts as any other
		}
		p.rec.closeAll()
		p.dp.CloseListeners()
		if p.servingShut { // it served: the rules point at it
			p.cfg.log().Warn("Stopped serving: the rules stay, so this node refuses every new connection to its Services " +
				"until a daemon starts again (kube-userspace-proxy --cleanup removes them)")
		}
	}
	p.dp.Drain(grace)
	p.dp.Stop()
}

// Quiet reports whether no sync or rule write has been under way for at
// least d: a moment in which work of the daemon's own choosing (a garbage
// collection) delays no change.
func (p *Proxier) Quiet(d time.Duration) bool { return p.activity.quiet(d) }
