package proxy

import (
	"errors"
	"net/netip"
	"sort"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/sirupsen/logrus"
)

func lessFrontend(a, b Frontend) bool {
	if a.Service.Name != b.Service.Name {
		return a.Service.Name.Less(b.Service.Name)
	}
	if a.Family != b.Family {
		return a.Family < b.Family
	}
	return a.Kind < b.Kind
}

// Frontends returns the frontends as of the last sync, sorted by service.
func (p *Proxier) Frontends() []Frontend {
	p.viewMu.Lock()
	defer p.viewMu.Unlock()
	if p.sorted == nil && p.view != nil {
		p.sorted = append([]Frontend(nil), p.view...)
		sort.Slice(p.sorted, func(i, j int) bool { return lessFrontend(p.sorted[i], p.sorted[j]) })
	}
	return append([]Frontend(nil), p.sorted...)
}

// Lookup returns the frontend serving name for family and kind as of the last sync.
func (p *Proxier) Lookup(name config.ServicePortName, family int, kind Kind) (Frontend, bool) {
	for _, fe := range p.Frontends() {
		if fe.Service.Name == name && fe.Family == family && fe.Kind == kind && fe.Err == nil {
			return fe, true
		}
	}
	return Frontend{}, false
}

// ListenPort returns the proxy port serving name for family and kind, or 0.
func (p *Proxier) ListenPort(name config.ServicePortName, family int, kind Kind) int {
	fe, _ := p.Lookup(name, family, kind)
	return int(fe.Listen.Port())
}

// Plan returns the frontends st needs, without opening anything: ports are 0
// except where the listener would sit on the NodePort. It is what
// --show-rules renders.
func Plan(st *config.State, bind netip.Addr, nodePortsRestricted bool) []Frontend {
	var out []Frontend
	var keys []frontendKey
	for name, sp := range st.Ports {
		for _, key := range frontendKeys(keys[:0], name, sp) {
			port := 0
			if sp.NodePort != 0 && key.Kind != KindInternal && !nodePortsRestricted {
				port = sp.NodePort
			}
			out = append(out, Frontend{Service: sp, Kind: key.Kind, Family: key.Family, Protocol: sp.Protocol,
				Listen: netip.AddrPortFrom(bindFor(bind, key.Family), uint16(port))})
		}
	}
	sort.Slice(out, func(i, j int) bool { return lessFrontend(out[i], out[j]) })
	return out
}

// Affinities returns the session-affinity pins of the frontend fe names, as
// of now.
func (p *Proxier) Affinities(fe Frontend) []Affinity {
	if live := p.liveFrontend(fe); live != nil {
		return live.bal.Affinities()
	}
	return nil
}

// EndpointHealth returns the outlier state of every endpoint of the frontend fe
// names (outlier.go), as of now.
func (p *Proxier) EndpointHealth(fe Frontend) []EndpointHealth {
	if live := p.liveFrontend(fe); live != nil {
		return live.bal.Health()
	}
	return nil
}

// UDPFlows returns the live and the evicted flow counts of the UDP frontend
// fe names.
func (p *Proxier) UDPFlows(fe Frontend) (active int, evicted uint64) {
	live := p.liveFrontend(fe)
	if live == nil {
		return 0, 0
	}
	live.udp.mu.Lock()
	defer live.udp.mu.Unlock()
	return len(live.udp.flows), live.udp.evicted.Load()
}

// liveFrontend returns the listener behind fe, or nil when it is gone.
func (p *Proxier) liveFrontend(fe Frontend) *frontend {
	if fe.Err != nil {
		return nil
	}
	p.liveMu.RLock()
	defer p.liveMu.RUnlock()
	return p.frontends[fe.key()]
}

// eachLive calls fn for every live frontend, holding the read side of
// liveMu: fn must not block.
func (p *Proxier) eachLive(fn func(*frontend)) {
	p.liveMu.RLock()
	defer p.liveMu.RUnlock()
	for _, fe := range p.frontends {
		fn(fe)
	}
}

// ErrUnknownEndpoint is Drain's answer for a service port or endpoint that
// no listener serves.
var ErrUnknownEndpoint = errors.New("no listener of this service port has this endpoint")

// Drain stops (drained) or resumes new picks of endpoint ep on every listener
// of the service port name, while the connections to it go on. It returns how
// many are still open. The drain lasts while the endpoint stays in the
// Service; a listener opened anew (its Service's addresses changed) starts
// without it.
func (p *Proxier) Drain(name config.ServicePortName, ep netip.AddrPort, drained bool) (active int, err error) {
	found := false
	p.eachLive(func(fe *frontend) {
		if fe.key.Name != name || !fe.bal.SetDrained(ep, drained) {
			return
		}
		found = true
		for _, h := range fe.bal.Health() {
			if h.Endpoint == ep {
				active += h.Active
			}
		}
	})
	if !found {
		return 0, ErrUnknownEndpoint
	}
	p.cfg.log().WithFields(logrus.Fields{"service": name.String(), "endpoint": ep, "drained": drained, "active": active}).Info("Endpoint drain set by hand")
	return active, nil
}

// Scheduler names the scheduler of the frontend fe names.
func (p *Proxier) Scheduler(fe Frontend) string {
	if live := p.liveFrontend(fe); live != nil {
		return live.bal.Scheduler()
	}
	return ""
}

// Topology returns the hints in use for the frontend fe names (config's
// TopologyMode; none with traffic policy Local) and the node's zone, as of
// the last sync.
func (p *Proxier) Topology(fe Frontend) (mode, zone string) {
	p.viewMu.Lock()
	node, zone := p.viewNode, p.viewZone
	p.viewMu.Unlock()
	if fe.key().localOnly(fe.Service) {
		return config.TopologyNone, zone
	}
	return config.TopologyMode(fe.Service.Endpoints, fe.Family, node, zone), zone
}
