package proxy

import (
	"net/netip"
	"slices"
	"sort"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
)

func lessFrontend(a, b config.Frontend) bool {
	if a.Service.Name != b.Service.Name {
		return a.Service.Name.Less(b.Service.Name)
	}
	if a.Family != b.Family {
		return a.Family < b.Family
	}
	return a.Kind < b.Kind
}

// Frontends returns the frontends as of the last sync, sorted by service.
func (p *Proxier) Frontends() []config.Frontend {
	p.rec.mu.Lock()
	defer p.rec.mu.Unlock()
	return append([]config.Frontend(nil), p.rec.sortedLocked()...)
}

// sortedLocked returns the view sorted, sorting it on first read after a
// sync. r.mu is held.
func (r *reconciler) sortedLocked() []config.Frontend {
	if r.sorted == nil && r.view != nil {
		r.sorted = slices.Clone(r.view)
		sort.Slice(r.sorted, func(i, j int) bool { return lessFrontend(r.sorted[i], r.sorted[j]) })
	}
	return r.sorted
}

// FrontendStatus is one frontend and the live state of its listener.
type FrontendStatus struct {
	config.Frontend
	Scheduler      string                   // the scheduler's name; empty without a listener
	Affinities     []balance.Affinity       // the session-affinity pins
	EndpointHealth []balance.EndpointHealth // the outlier state of every endpoint
	// Topology is the hints in use (config's TopologyMode; none with
	// traffic policy Local) for the node's Zone.
	Topology, Zone string
	// UDPFlows and UDPEvicted count the live and the evicted flows of a
	// UDP frontend.
	UDPFlows   int
	UDPEvicted uint64
	// Refusing: no endpoint can serve, so the listener is closed and its
	// port refuses connections (a TCP reset, a UDP port unreachable).
	Refusing bool
}

// Status returns every frontend as of the last sync, sorted by service, with
// its listener's live state: one snapshot, taken under one lock.
func (p *Proxier) Status() []FrontendStatus {
	r := p.rec
	r.mu.Lock()
	defer r.mu.Unlock()
	view := r.sortedLocked()
	out := make([]FrontendStatus, 0, len(view))
	for _, fe := range view {
		out = append(out, r.statusLocked(fe))
	}
	return out
}

// StatusPage is Status for the frontends offset to offset+limit of the
// sorted view, and how many there are: a page of a big node's listeners
// costs what the page holds, not what the node does.
func (p *Proxier) StatusPage(offset, limit int) (page []FrontendStatus, total int) {
	r := p.rec
	r.mu.Lock()
	defer r.mu.Unlock()
	view := r.sortedLocked()
	window := view[min(offset, len(view)):]
	window = window[:min(limit, len(window))]
	page = make([]FrontendStatus, 0, len(window))
	for _, fe := range window {
		page = append(page, r.statusLocked(fe))
	}
	return page, len(view)
}

// statusLocked is fe's status; r.mu is held.
func (r *reconciler) statusLocked(fe config.Frontend) FrontendStatus {
	st := FrontendStatus{Frontend: fe, Zone: r.viewZone, Topology: config.TopologyNone}
	if !localOnly(dataplane.KeyOf(fe), fe.Service) {
		st.Topology = config.TopologyMode(fe.Service.Endpoints, fe.Family, r.viewNode, r.viewZone)
	}
	live := r.liveLocked(fe)
	if live == nil {
		return st
	}
	st.Scheduler, st.Affinities, st.EndpointHealth = live.Balancer().Scheduler(), live.Balancer().Affinities(), live.Balancer().Health()
	st.Refusing = live.Refusing()
	st.UDPFlows, st.UDPEvicted = live.UDPFlows()
	return st
}

// liveLocked returns the listener behind fe, or nil when it is gone; r.mu
// is held.
func (r *reconciler) liveLocked(fe config.Frontend) *dataplane.Frontend {
	if fe.Err != nil {
		return nil
	}
	return r.frontends[dataplane.KeyOf(fe)]
}

// balancerOf returns the balancer of the listener behind fe (nil when it is
// gone) and the node and zone the view was synced for.
func (r *reconciler) balancerOf(fe config.Frontend) (bal *balance.Balancer, node, zone string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if l := r.liveLocked(fe); l != nil {
		bal = l.Balancer()
	}
	return bal, r.viewNode, r.viewZone
}

// Plan returns the frontends st needs, without opening anything: ports are 0
// except where the listener would sit on the NodePort. It is what
// --show-rules renders.
func Plan(st *config.State, bind netip.Addr, nodePortsRestricted bool) []config.Frontend {
	var out []config.Frontend
	var keys []dataplane.Key
	for name, sp := range st.Ports {
		for _, key := range frontendKeys(keys[:0], name, sp, nil) {
			port := 0
			if sp.NodePort != 0 && key.Kind.External() && !nodePortsRestricted {
				port = sp.NodePort
			}
			out = append(out, config.Frontend{Service: sp, Kind: key.Kind, Family: key.Family, Protocol: sp.Protocol,
				Listen: netip.AddrPortFrom(dataplane.BindFor(bind, key.Family), uint16(port))})
		}
	}
	sort.Slice(out, func(i, j int) bool { return lessFrontend(out[i], out[j]) })
	return out
}

// Connections returns every live TCP connection, oldest first.
func (p *Proxier) Connections() []dataplane.ConnInfo { return p.dp.Connections() }

// eachLive calls fn for every live frontend, holding r.mu: fn must not
// block.
func (r *reconciler) eachLive(fn func(*dataplane.Frontend)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, fe := range r.frontends {
		fn(fe)
	}
}
