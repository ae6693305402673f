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
	"net/netip"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
)

// Socket roles: a frontend's listener on a port of the range, or on its
// NodePort.
const (
	roleRange    = "range"
	roleNodePort = "nodeport"
)

// socketName is a frontend socket's name in a handover.
func socketName(key frontendKey, role string) string { return "frontend " + key.String() + " " + role }

// inherited are the sockets a predecessor lent, by name, until a
// frontend takes one.
type inherited struct {
	mu    sync.Mutex
	socks map[string]handover.Socket
}

// take returns the inherited socket named for key and role if it is of
// proto and bound to ip, as a listener; false when there is none.
func (in *inherited) take(key frontendKey, role string, proto config.Protocol, ip netip.Addr) (listener, bool) {
	in.mu.Lock()
	s, ok := in.socks[socketName(key, role)]
	if ok {
		delete(in.socks, socketName(key, role))
	}
	in.mu.Unlock()
	if !ok {
		return listener{}, false
	}
	defer s.File.Close()
	ap, err := netip.ParseAddrPort(s.Addr)
	if err != nil || s.Proto != strings.ToLower(string(proto)) || ap.Addr() != ip {
		return listener{}, false // another bind address or protocol now: a new socket
	}
	switch proto {
	case config.TCP:
		ln, err := sock.FileListener(s.File)
		if err != nil {
			return listener{}, false
		}
		return listener{tcp: ln, port: int(ap.Port())}, true
	case config.UDP:
		c, err := sock.FileUDP(s.File)
		if err != nil {
			return listener{}, false
		}
		return listener{udp: c, port: int(ap.Port())}, true
	}
	return listener{}, false
}

// closeRest closes the sockets no frontend took: Services gone meanwhile.
func (in *inherited) closeRest() int {
	in.mu.Lock()
	defer in.mu.Unlock()
	n := len(in.socks)
	for _, s := range in.socks {
		s.File.Close()
	}
	clear(in.socks)
	return n
}

// Inherit gives the Proxier the sockets a predecessor lent (before
// Run); freeze is called once, just before the first sync, to stop the
// predecessor from changing anything from then on; it returns the
// predecessor's pick state (Freeze), which that sync applies. Sockets whose name is
// not a frontend's are left out (the caller's).
func (p *Proxier) Inherit(socks []handover.Socket, freeze func() (json.RawMessage, error)) {
	in := &inherited{socks: make(map[string]handover.Socket)}
	for _, s := range socks {
		if strings.HasPrefix(s.Name, "frontend ") {
			in.socks[s.Name] = s
		}
	}
	p.dp.inherited = in
	p.dp.udpGate = make(chan struct{})
	// A hard bound on the UDP pause should the predecessor never send
	// its flows (FlowsTransferred).
	time.AfterFunc(udpGateLimit, p.dp.openUDPGate)
	p.freeze = freeze
}

// udpGateLimit bounds how long a successor's UDP frontends wait for the
// predecessor's flows.
const udpGateLimit = 10 * time.Second

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
		p.dp.closeListeners()
		return nil
	})
}

// Released reports whether Release was called: the daemon serves
// nothing new.
func (p *Proxier) Released() bool { return p.released.Load() }

// lend returns duplicates of the frontends' listening sockets.
func (r *reconciler) lend() ([]handover.Socket, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	socks := make([]handover.Socket, 0, len(r.frontends))
	for key, fe := range r.frontends {
		if fe.refusing != nil {
			continue // its port is held by a refusing socket: the successor opens its own
		}
		role := roleRange
		if fe.onNodePort {
			role = roleNodePort
		}
		s := handover.Socket{Name: socketName(key, role), Proto: strings.ToLower(string(fe.protocol)), Addr: fe.listen.String()}
		// Duplicated when sent, off the sync goroutine: the socket
		// itself is captured here, so a later sync cannot swap it.
		switch {
		case fe.tcp != nil:
			s.Open = fe.tcp.ln.File
		case fe.udp != nil:
			conn := fe.udp.sk.conn
			s.Open = func() (*os.File, error) { return sock.UDPFile(conn) }
		default:
			continue
		}
		socks = append(socks, s)
	}
	return socks, nil
}

// pickStates is every live frontend's pick state, by key.
func (r *reconciler) pickStates() map[string]balance.PickState {
	out := make(map[string]balance.PickState, len(r.frontends))
	for key, fe := range r.frontends {
		out[key.String()] = fe.bal.ExportPicks()
	}
	return out
}
