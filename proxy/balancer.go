package proxy

import (
	"math/rand/v2"
	"net/netip"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// Reason says why a balancer picked an endpoint; it is logged per connection.
type Reason string

const (
	ReasonRoundRobin Reason = "round-robin"
	ReasonAffinity   Reason = "affinity"
	ReasonRetry      Reason = "retry"
)

// Balancer chooses the endpoint for each new connection or UDP flow of one
// frontend. Implementations must be safe for concurrent use.
type Balancer interface {
	// Pick returns the endpoint for a new connection from client. attempt is
	// the number of dials that already failed for this connection; a retry
	// bypasses session affinity and re-pins the client to what it returns.
	// ok is false when there is no endpoint.
	Pick(client netip.Addr, attempt int) (ep netip.AddrPort, why Reason, ok bool)
	// Update replaces the endpoint set and the affinity timeout (0: none).
	Update(endpoints []netip.AddrPort, affinity time.Duration)
	// Affinities returns the live session-affinity pins, sorted by client,
	// for the debug view (none for a balancer without affinity).
	Affinities() []Affinity
}

// newBalancer returns the balancer for a new frontend of sp. The frontend
// holds it only as a Balancer: schedulers and endpoint ejection plug in here
// without touching the data path.
func newBalancer(sp *config.ServicePort) Balancer { return NewRoundRobin() }

var _ Balancer = (*RoundRobin)(nil)

// RoundRobin cycles through the endpoints; with affinity a client IP keeps its
// endpoint until it has been idle for the affinity timeout.
//
// Unlike the classic userspace proxier, the timeout is read at every Pick, so a
// changed timeoutSeconds applies to existing pins whatever order the Service
// and endpoint updates arrived in.
type RoundRobin struct {
	now func() time.Time // for tests; time.Now when nil

	mu        sync.Mutex // guards everything below
	endpoints []netip.AddrPort
	next      int
	ttl       time.Duration // 0: no affinity
	pins      map[netip.Addr]pin
	nextSweep time.Time
}

type pin struct {
	ep       netip.AddrPort
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
// others survive an endpoint change.
func (rr *RoundRobin) Update(endpoints []netip.AddrPort, affinity time.Duration) {
	eps := slices.Clone(endpoints)
	sort.Slice(eps, func(i, j int) bool { return eps[i].Compare(eps[j]) < 0 })

	rr.mu.Lock()
	defer rr.mu.Unlock()
	if !slices.Equal(eps, rr.endpoints) {
		// Start each new set at a random place so that many nodes do not all
		// send their first connection to the same endpoint.
		rr.next = 0
		if len(eps) > 1 {
			rr.next = rand.IntN(len(eps))
		}
		rr.endpoints = eps
	}
	rr.ttl = affinity
	if affinity <= 0 {
		rr.pins = nil
		return
	}
	for client, p := range rr.pins {
		if _, found := slices.BinarySearchFunc(rr.endpoints, p.ep, netip.AddrPort.Compare); !found {
			delete(rr.pins, client)
		}
	}
}

// Pick implements Balancer.
func (rr *RoundRobin) Pick(client netip.Addr, attempt int) (netip.AddrPort, Reason, bool) {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	if len(rr.endpoints) == 0 {
		return netip.AddrPort{}, "", false
	}
	now := rr.clock()
	if rr.ttl > 0 {
		rr.sweepLocked(now)
		if p, ok := rr.pins[client]; ok && attempt == 0 && now.Sub(p.lastUsed) < rr.ttl {
			p.lastUsed = now
			rr.pins[client] = p
			return p.ep, ReasonAffinity, true
		}
	}
	ep := rr.endpoints[rr.next%len(rr.endpoints)]
	rr.next = (rr.next + 1) % len(rr.endpoints)
	if rr.ttl > 0 {
		if rr.pins == nil {
			rr.pins = make(map[netip.Addr]pin)
		}
		rr.pins[client] = pin{ep: ep, lastUsed: now}
	}
	if attempt > 0 {
		return ep, ReasonRetry, true
	}
	return ep, ReasonRoundRobin, true
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
			out = append(out, Affinity{Client: c, Endpoint: p.ep, Expires: exp})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Client.Less(out[j].Client) })
	return out
}
