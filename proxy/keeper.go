package proxy

// Keeping the frontends' sockets in a supervising process (package
// handover's keeper), so that they outlive a crash of this one: after each
// sync's apply, as its rules go to the rule writer, the sockets opened
// since and the names of those closed since are queued for the keeper and
// sent, in order, by a goroutine of their own (a keeper that is slow never
// holds a sync up). The pick states go with the worker's heartbeat
// (KeptPicks).
//
// Who owns what: the sync goroutine owns kept and picks (what the keeper
// was told); the sender goroutine owns the link's sends of sockets until
// Run ends.

import (
	"context"
	"encoding/json"
	"sync/atomic"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
)

// SocketKeeper is a supervising process's side for the frontends'
// sockets (handover.KeeperLink).
type SocketKeeper interface {
	Keep(socks []handover.Socket) error
	Drop(names []string) error
}

// keeping is the sync goroutine's record of what the keeper was told, and
// the queue to the sender.
type keeping struct {
	kept   map[dataplane.SocketKey]keptSocket
	picks  map[string]string // each frontend's pick state as last given (KeptPicks)
	gen    uint64            // the keepDiff that saw a kept socket last
	queue  chan keepChange
	failed atomic.Bool // the keeper stopped reading: keeping ends
}

// keptSocket is the socket object kept for a name (*sock.Listener or a UDP
// conn) and the keepDiff that last saw its frontend.
type keptSocket struct {
	obj any
	gen uint64
}

// keepChange is one sync's news for the keeper.
type keepChange struct {
	opened []handover.Socket
	closed []string
}

// keeperLetGoWait bounds how long a sync waits for the keeper to close its
// duplicate of a socket whose port it binds anew: past it the bind fails
// (and is retried later) as it would have without the wait.
const keeperLetGoWait = 2 * time.Second

// letGo has the keeper close its duplicates of the sockets of keys, before
// their ports are bound anew (a port turning to refuse, the next listener
// on a NodePort): a duplicate keeps the socket listening, and the bind
// would find the port in use. It returns at once; the binds that follow
// retry while the port is in use, until keeperLetGoWait has passed
// (dataplane.bindAnew). On the sync goroutine.
func (p *Proxier) letGo(keys []dataplane.SocketKey) {
	k := p.keeping
	if k == nil || k.failed.Load() {
		return
	}
	var names []string
	for _, kk := range keys {
		if _, ok := k.kept[kk]; ok {
			delete(k.kept, kk)
			names = append(names, kk.Name())
		}
	}
	if len(names) == 0 {
		return
	}
	select {
	case k.queue <- keepChange{closed: names}:
		p.dp.LetGoUntil(time.Now().Add(keeperLetGoWait))
	default:
		k.fail(p, "its queue is full")
	}
}

func newKeeping() *keeping {
	return &keeping{kept: map[dataplane.SocketKey]keptSocket{}, picks: map[string]string{}, queue: make(chan keepChange, 64)}
}

// keepSockets tells the keeper what this sync opened and closed. On the
// sync goroutine.
func (p *Proxier) keepSockets() {
	k := p.keeping
	if k == nil || k.failed.Load() {
		return
	}
	k.gen++
	ch := p.rec.keepDiff(k.kept, k.gen)
	if len(ch.opened) == 0 && len(ch.closed) == 0 {
		return
	}
	select {
	case k.queue <- ch:
	default:
		// The sender is that far behind: the keeper does not read.
		k.fail(p, "its queue is full")
	}
}

func (k *keeping) fail(p *Proxier, why string) {
	if !k.failed.Swap(true) {
		p.cfg.log().WithField("reason", why).Warn("The keeper no longer takes this daemon's sockets: a crash from now on refuses connections until the next start")
	}
}

// sendKept is the sender goroutine: it passes the queue's changes to the
// keeper until ctx ends.
func (p *Proxier) sendKept(ctx context.Context) {
	k := p.keeping
	for {
		select {
		case <-ctx.Done():
			return
		case ch := <-k.queue:
			if k.failed.Load() {
				continue
			}
			err := p.cfg.Keeper.Keep(ch.opened)
			if err == nil && len(ch.closed) > 0 {
				err = p.cfg.Keeper.Drop(ch.closed)
			}
			if err != nil {
				k.fail(p, err.Error())
			}
		}
	}
}

// keepDiff compares the frontends' sockets with kept, which it brings up
// to date (gen marks what this call saw): the sockets opened since (to be
// duplicated as sent) and the names of those closed since. A frontend
// whose port refuses holds no socket the keeper could serve on.
func (r *reconciler) keepDiff(kept map[dataplane.SocketKey]keptSocket, gen uint64) keepChange {
	r.mu.Lock()
	defer r.mu.Unlock()
	var ch keepChange
	for _, fe := range r.frontends {
		s, obj, ok := fe.ListeningSocket()
		if !ok {
			continue
		}
		kk := fe.SocketKey()
		was, seen := kept[kk]
		kept[kk] = keptSocket{obj, gen}
		if seen && was.obj == obj {
			continue
		}
		ch.opened = append(ch.opened, s)
	}
	for kk, ks := range kept {
		if ks.gen != gen {
			delete(kept, kk)
			ch.closed = append(ch.closed, kk.Name())
		}
	}
	return ch
}

// KeptPicks returns the frontends' pick states (package balance) that changed
// since its last call, by frontend, a frontend gone as JSON null: what a
// keeper holds for the next worker after a crash. It runs on the sync
// goroutine, so it is also the sign of life a keeper watches for.
func (p *Proxier) KeptPicks(ctx context.Context) (map[string]json.RawMessage, error) {
	var out map[string]json.RawMessage
	err := p.call(ctx, func() error {
		if p.released.Load() {
			return ErrReleased
		}
		if p.keeping == nil {
			return nil
		}
		out = map[string]json.RawMessage{}
		now := p.rec.pickStates()
		for key, st := range now {
			b, err := json.Marshal(st)
			if err != nil {
				return err
			}
			if p.keeping.picks[key] != string(b) {
				p.keeping.picks[key] = string(b)
				out[key] = b
			}
		}
		for key := range p.keeping.picks {
			if _, ok := now[key]; !ok {
				delete(p.keeping.picks, key)
				out[key] = json.RawMessage("null")
			}
		}
		return nil
	})
	return out, err
}
