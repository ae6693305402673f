package proxy

// The state that decides a frontend's future picks, handed to a successor
// with the freeze (package handover): affinity pins, each endpoint's
// ejection and drain, the scheduler's place. The successor applies it to
// the frontend of the same key when its first sync gives that frontend its
// endpoints, so a pinned client keeps its endpoint, an ejected endpoint
// stays out for the rest of its ejection, a drain set by hand holds, and
// round-robin goes on where it was.
//
// Who owns what: the running daemon's sync goroutine takes it (Freeze);
// the successor's reconciler holds it until its first sync has applied
// (reconciler.update) or dropped every frontend's part.

import (
	"net/netip"
	"time"
)

// pickState is one balancer's state. Times are wall-clock unix
// nanoseconds: both daemons run on one machine.
type pickState struct {
	Scheduler string          `json:"scheduler"`
	Position  *int            `json:"position,omitempty"` // rr and lc
	Endpoints []endpointState `json:"endpoints,omitempty"`
	Pins      []pinState      `json:"pins,omitempty"`
}

type endpointState struct {
	Addr      netip.AddrPort `json:"addr"`
	Failures  int32          `json:"failures,omitempty"`
	Ejections int32          `json:"ejections,omitempty"`
	Until     int64          `json:"until,omitempty"`
	Drained   bool           `json:"drained,omitempty"`
}

type pinState struct {
	Client   netip.Addr     `json:"client"`
	Endpoint netip.AddrPort `json:"endpoint"`
	LastUsed int64          `json:"lastUsed"`
}

// positioned is a scheduler with a place in the endpoint list.
type positioned interface {
	position() int
	setPosition(int)
}

func (r *roundRobin) setPosition(i int) { r.next = i }

// exportState returns what decides rr's future picks.
func (rr *EndpointBalancer) exportState() pickState {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	st := pickState{Scheduler: rr.sched.name()}
	if p, ok := rr.sched.(positioned); ok {
		pos := p.position()
		st.Position = &pos
	}
	for _, e := range rr.endpoints {
		es := endpointState{Addr: e.addr, Failures: e.failures.Load(), Ejections: e.ejections.Load(), Until: e.until.Load(), Drained: e.drained.Load()}
		if es != (endpointState{Addr: e.addr}) {
			st.Endpoints = append(st.Endpoints, es)
		}
	}
	now := rr.clock()
	for client, p := range rr.pins {
		if now.Sub(p.lastUsed) < rr.ttl {
			st.Pins = append(st.Pins, pinState{Client: client, Endpoint: p.ep.addr, LastUsed: p.lastUsed.UnixNano()})
		}
	}
	return st
}

// importState applies st to rr, whose endpoints are set: what refers to an
// endpoint rr does not have is dropped, the position kept only for the
// same scheduler and only where it falls inside rr's endpoint list, pins
// only with affinity on. It returns how many pins it kept.
func (rr *EndpointBalancer) importState(st pickState) int {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	for _, es := range st.Endpoints {
		if e := findEndpoint(rr.endpoints, es.Addr); e != nil {
			e.failures.Store(es.Failures)
			e.ejections.Store(es.Ejections)
			e.until.Store(es.Until)
			e.drained.Store(es.Drained)
		}
	}
	if p, ok := rr.sched.(positioned); ok && st.Position != nil && st.Scheduler == rr.sched.name() &&
		*st.Position >= 0 && *st.Position < max(len(rr.endpoints), 1) {
		p.setPosition(*st.Position)
	}
	if rr.ttl <= 0 {
		return 0
	}
	kept := 0
	for _, ps := range st.Pins {
		e := findEndpoint(rr.endpoints, ps.Endpoint)
		if e == nil {
			continue
		}
		if rr.pins == nil {
			rr.pins = make(map[netip.Addr]pin)
		}
		rr.pins[ps.Client] = pin{ep: e, lastUsed: time.Unix(0, ps.LastUsed)}
		kept++
	}
	return kept
}

// pickStates is every live frontend's pick state, by key.
func (r *reconciler) pickStates() map[string]pickState {
	out := make(map[string]pickState, len(r.frontends))
	for key, fe := range r.frontends {
		out[key.String()] = fe.bal.exportState()
	}
	return out
}
