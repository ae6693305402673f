package proxy

// The Proxier's side of a handover (package handover): a running daemon
// lends its frontends' sockets, freezes and then releases them; its
// successor inherits them, so that each frontend serves on the very socket,
// and port, the rules already redirect to.
//
// Who owns what: the sync goroutine runs every step (Lend, Freeze, Thaw,
// Release arrive as calls on it), so that frontends are never changed by
// two goroutines; the inherited sockets are the dataplane's until a
// frontend takes one, and those no frontend took are closed after the
// first rule write.

import (
	"context"
	"encoding/json"
	"errors"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
)

// Inherit gives the Proxier the sockets a predecessor lent (before
// Run); freeze is called once, just before the first sync, to stop the
// predecessor from changing anything from then on; it returns the
// predecessor's pick state (Freeze), which that sync applies. Sockets whose name is
// not a frontend's are left out (the caller's).
func (p *Proxier) Inherit(socks []handover.Socket, freeze func() (json.RawMessage, error)) {
	p.dp.Inherit(socks)
	p.freeze = freeze
}

// Serving is closed once the first sync's rules are written: every
// frontend serves.
func (p *Proxier) Serving() <-chan struct{} { return p.serving }

// ErrReleased is the error of calls after a Release.
var ErrReleased = errors.New("released to a successor")

// call runs fn on the sync goroutine and waits for it.
func (p *Proxier) call(ctx context.Context, fn func() error) error {
	done := make(chan error, 1)
	select {
	case p.calls <- func() { done <- fn() }:
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Lend returns every frontend's listening socket, to be duplicated as it
// is sent (Socket.Open); the frontends serve on.
func (p *Proxier) Lend(ctx context.Context) ([]handover.Socket, error) {
	var socks []handover.Socket
	err := p.call(ctx, func() error {
		if p.released.Load() {
			return ErrReleased
		}
		var err error
		socks, err = p.rec.lend()
		return err
	})
	return socks, err
}

// Freeze stops syncing (changes queue) until Thaw or Release, and returns
// the state that decides the frontends' future picks (package balance).
func (p *Proxier) Freeze(ctx context.Context) (json.RawMessage, error) {
	var picks json.RawMessage
	err := p.call(ctx, func() error {
		if p.released.Load() {
			return ErrReleased
		}
		p.frozen = true
		var err error
		picks, err = json.Marshal(p.rec.pickStates())
		return err
	})
	return picks, err
}

// Thaw syncs again what queued while frozen, verifying the rules: a
// successor that went away before it served may have written its own
// (its first sync comes before it says it serves), for Services or
// listeners this daemon does not have.
func (p *Proxier) Thaw() {
	_ = p.call(context.Background(), func() error {
		if !p.released.Load() {
			p.frozen = false
			p.syncPending(true)
		}
		return nil
	})
}

// Release stops serving for good: no more rule writes, every frontend
// closed (its socket lives on in the successor), health not ready.
// Established connections go on until they end or the daemon stops.
func (p *Proxier) Release(ctx context.Context) error {
	return p.call(ctx, func() error {
		p.frozen = true
		p.released.Store(true)
		p.stopWriter()
		for _, w := range p.writer.stop(ErrReleased) {
			p.rec.written(w)
		}
		p.rec.detachUDPFlows()
		p.rec.closeAll()
		p.dp.CloseListeners()
		return nil
	})
}

// Released reports whether Release was called: the daemon serves
// nothing new.
func (p *Proxier) Released() bool { return p.released.Load() }

// lend returns the frontends' listening sockets, each duplicated as it is
// sent.
func (r *reconciler) lend() ([]handover.Socket, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	socks := make([]handover.Socket, 0, len(r.frontends))
	for _, fe := range r.frontends {
		// A port held by a refusing socket: the successor opens its own.
		if s, _, ok := fe.ListeningSocket(); ok {
			socks = append(socks, s)
		}
	}
	return socks, nil
}

// pickStates is every live frontend's pick state, by key.
func (r *reconciler) pickStates() map[string]balance.PickState {
	out := make(map[string]balance.PickState, len(r.frontends))
	for key, fe := range r.frontends {
		out[key.String()] = fe.Balancer().ExportPicks()
	}
	return out
}

// Transfer sends every live UDP flow and TCP connection to the successor
// through send, after Release, until none is left (nil) or ctx ends (the
// ones left drain here). A connection ends in this process without a byte
// lost: transferred whole, or not at all.
func (p *Proxier) Transfer(ctx context.Context, send func([]handover.Socket) error) error {
	if !p.released.Load() {
		return errors.New("Transfer before Release")
	}
	return p.dp.Transfer(ctx, send)
}

// TakeTransfer takes connections a predecessor transferred (UDP flows and
// pairs of sockets, as Transfer sends them) and copies them on. A
// connection of a Service this daemon does not serve is closed.
func (p *Proxier) TakeTransfer(socks []handover.Socket) (taken int, err error) {
	return p.dp.TakeTransfer(p.rec.frontendsByName(), socks)
}

// FlowsTransferred says the predecessor's UDP flows are in (or will not come):
// the UDP frontends read their sockets from now on.
func (p *Proxier) FlowsTransferred() { p.dp.OpenUDPGate() }

// frontendsByName are the live frontends by their key's String.
func (r *reconciler) frontendsByName() map[string]*dataplane.Frontend {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := make(map[string]*dataplane.Frontend, len(r.frontends))
	for k, fe := range r.frontends {
		m[k.String()] = fe
	}
	return m
}

// detachUDPFlows detaches every UDP server's flows for Transfer.
func (r *reconciler) detachUDPFlows() {
	fes := make([]*dataplane.Frontend, 0, len(r.frontends))
	for _, fe := range r.frontends {
		fes = append(fes, fe)
	}
	r.dp.DetachUDPFlows(fes)
}
