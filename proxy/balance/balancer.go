package balance

import (
	"net/netip"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// Reason says why a balancer picked an endpoint; it is logged per connection.
type Reason string

const (
	ReasonRoundRobin Reason = "round-robin"
	ReasonAffinity   Reason = "affinity"
	ReasonRetry      Reason = "retry"
	// ReasonAllEjected: every endpoint is ejected, so the pick ignores
	// ejection (Envoy's panic mode): a guess beats refusing everyone.
	ReasonAllEjected Reason = "all-ejected"
	// The other schedulers' picks (schedulers.go).
	ReasonLeastConn  Reason = "least-connections"
	ReasonSourceHash Reason = "source-hash"
	ReasonRandom     Reason = "random"
)

// Balancer chooses the endpoint for each new connection or UDP flow
// of one frontend, safe for concurrent use. It cycles through the endpoints in rotation (not ejected); with
// affinity a client IP keeps its endpoint until it has been idle for the
// affinity timeout or its endpoint is ejected.
//
// Unlike the classic userspace proxier, the timeout is read at every Pick, so a
// changed timeoutSeconds applies to existing pins whatever order the Service
// and endpoint updates arrived in.
type Balancer struct {
	now func() time.Time // for tests; time.Now when nil

	// snapshot is endpoints for Report, which takes no lock.
	snapshot atomic.Pointer[[]*endpoint]
	outlier  atomic.Pointer[OutlierConfig] // nil: off

	mu        sync.Mutex  // guards everything below
	endpoints []*endpoint // sorted by address; never modified, only replaced
	sched     scheduler
	ttl       time.Duration // 0: no affinity
	pins      map[netip.Addr]pin
	nextSweep time.Time
}

type pin struct {
	ep       *endpoint
	lastUsed time.Time
}

// New returns an empty balancer with the named scheduler (rr when
// the name is unknown); call Update to give it endpoints.
func New(scheduler string) *Balancer {
	b := &Balancer{}
	b.sched, _ = newScheduler(scheduler)
	return b
}

func (rr *Balancer) clock() time.Time {
	if rr.now != nil {
		return rr.now()
	}
	return time.Now()
}

// Update replaces the endpoint set, the affinity timeout (0: none), the
// outlier detection and the scheduler; endpoints that stay keep their
// health, drain and counts.
// Pins to endpoints that are gone are dropped; the others survive an
// endpoint change, and so does an endpoint's health.
func (rr *Balancer) Update(endpoints []netip.AddrPort, affinity time.Duration, outlier OutlierConfig, scheduler string) {
	addrs := slices.Clone(endpoints)
	sort.Slice(addrs, func(i, j int) bool { return addrs[i].Compare(addrs[j]) < 0 })
	if outlier.enabled() {
		rr.outlier.Store(&outlier)
	} else {
		rr.outlier.Store(nil)
	}

	rr.mu.Lock()
	defer rr.mu.Unlock()
	if rr.sched == nil || rr.sched.name() != scheduler {
		rr.sched, _ = newScheduler(scheduler)
	}
	if !slices.EqualFunc(addrs, rr.endpoints, func(a netip.AddrPort, e *endpoint) bool { return a == e.addr }) {
		eps := make([]*endpoint, len(addrs))
		for i, a := range addrs {
			if e := findEndpoint(rr.endpoints, a); e != nil {
				eps[i] = e
			} else {
				eps[i] = &endpoint{addr: a}
			}
		}
		rr.sched.reset(len(eps))
		rr.endpoints = eps
		rr.snapshot.Store(&eps)
	}
	rr.ttl = affinity
	if affinity <= 0 {
		rr.pins = nil
		return
	}
	for client, p := range rr.pins {
		if findEndpoint(rr.endpoints, p.ep.addr) != p.ep {
			delete(rr.pins, client)
		}
	}
}

// findEndpoint returns the endpoint of eps (sorted) with address a, or nil.
func findEndpoint(eps []*endpoint, a netip.AddrPort) *endpoint {
	i, found := slices.BinarySearchFunc(eps, a, func(e *endpoint, a netip.AddrPort) int { return e.addr.Compare(a) })
	if !found {
		return nil
	}
	return eps[i]
}

// Pick returns the endpoint for a new connection from client. attempt is
// the number of dials that already failed for this connection; a retry
// bypasses session affinity and re-pins the client to what it returns.
// ok is false when there is no endpoint.
func (rr *Balancer) Pick(client netip.Addr, attempt int) (netip.AddrPort, Reason, bool) {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	n := len(rr.endpoints)
	if n == 0 {
		return netip.AddrPort{}, "", false
	}
	now := rr.clock()
	// With detection off nothing is ever ejected: the checks below are
	// then one atomic load per endpoint looked at.
	nanos := now.UnixNano()
	if rr.ttl > 0 {
		rr.sweepLocked(now)
		if p, ok := rr.pins[client]; ok && attempt == 0 && now.Sub(p.lastUsed) < rr.ttl && !p.ep.ejected(nanos) && !p.ep.drained.Load() {
			p.lastUsed = now
			rr.pins[client] = p
			p.ep.active.Add(1)
			return p.ep.addr, ReasonAffinity, true
		}
	}
	// The scheduler chooses among the endpoints in rotation: not drained
	// by hand, not ejected; with every one ejected, among the not drained.
	e := rr.sched.choose(rr.endpoints, client, rotation{nanos: nanos})
	why := rr.sched.reason()
	if e == nil {
		if e = rr.sched.choose(rr.endpoints, client, rotation{ignoreEjection: true}); e == nil {
			return netip.AddrPort{}, "", false // every endpoint drained
		}
		why = ReasonAllEjected
	} else if attempt > 0 {
		why = ReasonRetry
	}
	e.active.Add(1)
	if rr.ttl > 0 {
		if rr.pins == nil {
			rr.pins = make(map[netip.Addr]pin)
		}
		rr.pins[client] = pin{ep: e, lastUsed: now}
	}
	return e.addr, why, true
}

// Report tells the outcome of a dial to ep (TCP), or of a flow's
// traffic (UDP: an answer, or an ICMP error): failed dials in a row eject
// ep from new picks for a while (outlier.go). It takes no lock. It
// returns how long ep is now ejected for, and whether a success just
// returned it from an ejection.
func (rr *Balancer) Report(ep netip.AddrPort, failed bool) (time.Duration, bool) {
	o := rr.outlier.Load()
	eps := rr.snapshot.Load()
	if o == nil || eps == nil {
		return 0, false
	}
	e := findEndpoint(*eps, ep)
	if e == nil {
		return 0, false // gone since the pick
	}
	return e.report(*o, failed, rr.clock())
}

// Done says that a connection or flow that Pick sent to ep has ended
// (or its dial failed): the count of active connections, which lc and
// the debug view use, goes down. It takes no lock.
func (rr *Balancer) Done(ep netip.AddrPort) {
	if eps := rr.snapshot.Load(); eps != nil {
		if e := findEndpoint(*eps, ep); e != nil {
			e.active.Add(-1)
		}
	}
}

// Transferred counts a connection to ep that a predecessor picked (a
// handover), as Pick would have: Done takes it back.
func (rr *Balancer) Transferred(ep netip.AddrPort) {
	if eps := rr.snapshot.Load(); eps != nil {
		if e := findEndpoint(*eps, ep); e != nil {
			e.active.Add(1)
		}
	}
}

// SetDrained stops (or, with false, resumes) new picks of ep while its
// connections go on; false when ep is not an endpoint of the balancer.
func (rr *Balancer) SetDrained(ep netip.AddrPort, drained bool) bool {
	if eps := rr.snapshot.Load(); eps != nil {
		if e := findEndpoint(*eps, ep); e != nil {
			e.drained.Store(drained)
			return true
		}
	}
	return false
}

// Scheduler names how it chooses: rr, lc, sh or random.
func (rr *Balancer) Scheduler() string {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	return rr.sched.name()
}

// Health returns every endpoint's outlier state, sorted by address.
func (rr *Balancer) Health() []EndpointHealth {
	eps := rr.snapshot.Load()
	if eps == nil {
		return nil
	}
	now := rr.clock()
	out := make([]EndpointHealth, 0, len(*eps))
	for _, e := range *eps {
		out = append(out, e.health(now))
	}
	return out
}

// sweepLocked drops expired pins at most once a minute, so that clients that
// never come back do not grow the table forever.
func (rr *Balancer) sweepLocked(now time.Time) {
	if now.Before(rr.nextSweep) {
		return
	}
	rr.nextSweep = now.Add(time.Minute)
	for client, p := range rr.pins {
		if now.Sub(p.lastUsed) >= rr.ttl {
			delete(rr.pins, client)
		}
	}
}

// Affinity is one client's pin, for the debug view.
type Affinity struct {
	Client   netip.Addr     `json:"client"`
	Endpoint netip.AddrPort `json:"endpoint"`
	Expires  time.Time      `json:"expires"`
}

// Affinities returns the live pins, sorted by client.
func (rr *Balancer) Affinities() []Affinity {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	now := rr.clock()
	var out []Affinity
	for c, p := range rr.pins {
		if exp := p.lastUsed.Add(rr.ttl); exp.After(now) {
			out = append(out, Affinity{Client: c, Endpoint: p.ep.addr, Expires: exp})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Client.Less(out[j].Client) })
	return out
}

// Prediction is what the next Pick for one client will return, and why.
type Prediction struct {
	// Endpoint is the endpoint the next connection gets; absent when no
	// endpoint can take it, or when the scheduler picks at random.
	Endpoint *netip.AddrPort `json:"endpoint,omitempty"`
	Reason   Reason          `json:"reason,omitempty"`
	// Candidates are the endpoints a random pick chooses among.
	Candidates []netip.AddrPort `json:"candidates,omitempty"`
	// Pin is the client's affinity pin, live or expired, that the
	// prediction took into account.
	Pin *Affinity `json:"pin,omitempty"`
	// PinIgnored says why a pin the client has is not followed.
	PinIgnored string `json:"pinIgnored,omitempty"`
	// Position is round-robin's place in the sorted endpoint list: the
	// index where the next pick starts looking (rr and lc only).
	Position *int `json:"position,omitempty"`
}

// Predict says what Pick would answer for a first attempt from client
// now, changing nothing (explain).
// It makes the same decisions as Pick, on copies.
func (rr *Balancer) Predict(client netip.Addr) Prediction {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	var pr Prediction
	if pos, ok := rr.sched.(interface{ position() int }); ok {
		i := pos.position()
		pr.Position = &i
	}
	if len(rr.endpoints) == 0 {
		return pr
	}
	now := rr.clock()
	nanos := now.UnixNano()
	if rr.ttl > 0 {
		if p, ok := rr.pins[client]; ok {
			pr.Pin = &Affinity{Client: client, Endpoint: p.ep.addr, Expires: p.lastUsed.Add(rr.ttl)}
			switch {
			case now.Sub(p.lastUsed) >= rr.ttl:
				pr.PinIgnored = "expired"
			case p.ep.ejected(nanos):
				pr.PinIgnored = "its endpoint is ejected"
			case p.ep.drained.Load():
				pr.PinIgnored = "its endpoint is drained"
			default:
				ep := p.ep.addr
				pr.Endpoint, pr.Reason = &ep, ReasonAffinity
				return pr
			}
		}
	}
	in := rotation{nanos: nanos}
	why := rr.sched.reason()
	if !anyOK(rr.endpoints, in) {
		in, why = rotation{ignoreEjection: true}, ReasonAllEjected
		if !anyOK(rr.endpoints, in) {
			return pr // every endpoint drained
		}
	}
	pr.Reason = why
	if e := rr.sched.peek(rr.endpoints, client, in); e != nil {
		ep := e.addr
		pr.Endpoint = &ep
		return pr
	}
	for _, e := range rr.endpoints {
		if in.ok(e) {
			pr.Candidates = append(pr.Candidates, e.addr)
		}
	}
	return pr
}

func anyOK(eps []*endpoint, in rotation) bool {
	for _, e := range eps {
		if in.ok(e) {
			return true
		}
	}
	return false
}

// A balancer's pick state: what decides its future picks (affinity pins,
// each endpoint's ejection and drain, the scheduler's place), handed to a
// successor with the freeze (package handover). The successor's plan gives
// it to the frontend of the same key with the endpoints of its first sync
// (keyServe.picks), so a pinned client keeps its endpoint, an ejected
// endpoint stays out for the rest of its ejection, a drain set by hand
// holds, and round-robin goes on where it was.

// PickState is one balancer's state. Times are wall-clock unix
// nanoseconds: both daemons run on one machine.
type PickState struct {
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

// ExportPicks returns what decides rr's future picks.
func (rr *Balancer) ExportPicks() PickState {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	st := PickState{Scheduler: rr.sched.name()}
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

// ImportPicks applies st to rr, whose endpoints are set: what refers to an
// endpoint rr does not have is dropped, the position kept only for the
// same scheduler and only where it falls inside rr's endpoint list, pins
// only with affinity on. It returns how many pins it kept.
func (rr *Balancer) ImportPicks(st PickState) int {
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
