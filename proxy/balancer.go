package proxy

import (
	"math/rand/v2"
	"net/netip"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
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
)

// Balancer chooses the endpoint for each new connection or UDP flow of one
// frontend. Implementations must be safe for concurrent use.
type Balancer interface {
	// Pick returns the endpoint for a new connection from client. attempt is
	// the number of dials that already failed for this connection; a retry
	// bypasses session affinity and re-pins the client to what it returns.
	// ok is false when there is no endpoint.
	Pick(client netip.Addr, attempt int) (ep netip.AddrPort, why Reason, ok bool)
	// Report tells the outcome of a dial to ep (TCP), or of a flow's
	// traffic (UDP: an answer, or an ICMP error): failed dials in a row eject
	// ep from new picks for a while (outlier.go). It takes no lock. It
	// returns how long ep is now ejected for, and whether a success just
	// returned it from an ejection.
	Report(ep netip.AddrPort, failed bool) (ejectedFor time.Duration, recovered bool)
	// Update replaces the endpoint set, the affinity timeout (0: none) and
	// the outlier detection; endpoints that stay keep their health.
	Update(endpoints []netip.AddrPort, affinity time.Duration, outlier OutlierConfig)
	// Affinities returns the live session-affinity pins, sorted by client,
	// for the debug view (none for a balancer without affinity).
	Affinities() []Affinity
	// Health returns every endpoint's outlier state, sorted by address.
	Health() []EndpointHealth
}

// newBalancer returns the balancer for a new frontend of sp. The frontend
// holds it only as a Balancer: schedulers plug in here without touching the
// data path.
func newBalancer(sp *config.ServicePort) Balancer { return NewRoundRobin() }

var _ Balancer = (*RoundRobin)(nil)

// RoundRobin cycles through the endpoints in rotation (not ejected); with
// affinity a client IP keeps its endpoint until it has been idle for the
// affinity timeout or its endpoint is ejected.
//
// Unlike the classic userspace proxier, the timeout is read at every Pick, so a
// changed timeoutSeconds applies to existing pins whatever order the Service
// and endpoint updates arrived in.
type RoundRobin struct {
	now func() time.Time // for tests; time.Now when nil

	// snapshot is endpoints for Report, which takes no lock.
	snapshot atomic.Pointer[[]*endpoint]
	outlier  atomic.Pointer[OutlierConfig] // nil: off

	mu        sync.Mutex  // guards everything below
	endpoints []*endpoint // sorted by address; never modified, only replaced
	next      int
	ttl       time.Duration // 0: no affinity
	pins      map[netip.Addr]pin
	nextSweep time.Time
}

type pin struct {
	ep       *endpoint
	lastUsed time.Time
}

// NewRoundRobin returns an empty balancer; call Update to give it endpoints.
func NewRoundRobin() *RoundRobin { return &RoundRobin{} }

func (rr *RoundRobin) clock() time.Time {
	if rr.now != nil {
		return rr.now()
	}
	return time.Now()
}

// Update implements Balancer. Pins to endpoints that are gone are dropped; the
// others survive an endpoint change, and so does an endpoint's health.
func (rr *RoundRobin) Update(endpoints []netip.AddrPort, affinity time.Duration, outlier OutlierConfig) {
	addrs := slices.Clone(endpoints)
	sort.Slice(addrs, func(i, j int) bool { return addrs[i].Compare(addrs[j]) < 0 })
	if outlier.enabled() {
		rr.outlier.Store(&outlier)
	} else {
		rr.outlier.Store(nil)
	}

	rr.mu.Lock()
	defer rr.mu.Unlock()
	if !slices.EqualFunc(addrs, rr.endpoints, func(a netip.AddrPort, e *endpoint) bool { return a == e.addr }) {
		eps := make([]*endpoint, len(addrs))
		for i, a := range addrs {
			if e := findEndpoint(rr.endpoints, a); e != nil {
				eps[i] = e
			} else {
				eps[i] = &endpoint{addr: a}
			}
		}
		// Start each new set at a random place so that many nodes do not all
		// send their first connection to the same endpoint.
		rr.next = 0
		if len(eps) > 1 {
			rr.next = rand.IntN(len(eps))
		}
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

// Pick implements Balancer.
func (rr *RoundRobin) Pick(client netip.Addr, attempt int) (netip.AddrPort, Reason, bool) {
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
		if p, ok := rr.pins[client]; ok && attempt == 0 && now.Sub(p.lastUsed) < rr.ttl && !p.ep.ejected(nanos) {
			p.lastUsed = now
			rr.pins[client] = p
			return p.ep.addr, ReasonAffinity, true
		}
	}
	why := ReasonRoundRobin
	if attempt > 0 {
		why = ReasonRetry
	}
	i := rr.next % n
	for tried := 0; rr.endpoints[i].ejected(nanos); {
		if tried++; tried == n {
			i, why = rr.next%n, ReasonAllEjected
			break
		}
		i = (i + 1) % n
	}
	e := rr.endpoints[i]
	rr.next = (i + 1) % n
	if rr.ttl > 0 {
		if rr.pins == nil {
			rr.pins = make(map[netip.Addr]pin)
		}
		rr.pins[client] = pin{ep: e, lastUsed: now}
	}
	return e.addr, why, true
}

// Report implements Balancer.
func (rr *RoundRobin) Report(ep netip.AddrPort, failed bool) (time.Duration, bool) {
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

// Health implements Balancer.
func (rr *RoundRobin) Health() []EndpointHealth {
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
func (rr *RoundRobin) sweepLocked(now time.Time) {
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
func (rr *RoundRobin) Affinities() []Affinity {
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
