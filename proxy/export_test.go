package proxy

// Test-only ways into a Proxier: a sync without Run, and one frontend's
// live state by name.

import (
	"context"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
)

// sync makes listeners and rules match st and waits for the rules, on the
// caller's goroutine: what one turn of Run does, without the rule writer's
// goroutine.
func (p *Proxier) sync(st *config.State, verify bool) error {
	w := p.rec.apply(config.Diff(p.rec.synced, st), verify)
	w.err = p.writer.write(context.Background(), w)
	p.writer.record(w)
	p.rec.written(w)
	return w.err
}

// shutdown does what Run does when its context ends, for a Proxier synced
// by sync.
func (p *Proxier) shutdownSynced(grace time.Duration) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	p.shutdown(ctx, grace)
}

// writtenFor returns the State the last rule write was made for.
func (p *Proxier) writtenFor() *config.State {
	p.writer.mu.Lock()
	defer p.writer.mu.Unlock()
	return p.writer.lastWritten
}

// Lookup returns the frontend serving name for family and kind as of the last sync.
func (p *Proxier) Lookup(name config.ServicePortName, family int, kind config.Kind) (config.Frontend, bool) {
	for _, fe := range p.Frontends() {
		if fe.Service.Name == name && fe.Family == family && fe.Kind == kind && fe.Err == nil {
			return fe, true
		}
	}
	return config.Frontend{}, false
}

// ListenPort returns the proxy port serving name for family and kind, or 0.
func (p *Proxier) ListenPort(name config.ServicePortName, family int, kind config.Kind) int {
	fe, _ := p.Lookup(name, family, kind)
	return int(fe.Listen.Port())
}

// status is fe's status as of now.
func (p *Proxier) status(fe config.Frontend) FrontendStatus {
	p.rec.mu.Lock()
	defer p.rec.mu.Unlock()
	return p.rec.statusLocked(fe)
}

func (p *Proxier) Affinities(fe config.Frontend) []balance.Affinity { return p.status(fe).Affinities }
func (p *Proxier) EndpointHealth(fe config.Frontend) []balance.EndpointHealth {
	return p.status(fe).EndpointHealth
}
func (p *Proxier) Scheduler(fe config.Frontend) string { return p.status(fe).Scheduler }

func (p *Proxier) UDPFlows(fe config.Frontend) (active int, evicted uint64) {
	st := p.status(fe)
	return st.UDPFlows, st.UDPEvicted
}

func (p *Proxier) Topology(fe config.Frontend) (mode, zone string) {
	st := p.status(fe)
	return st.Topology, st.Zone
}
