package balance

// Schedulers: how a balancer chooses among the endpoints in rotation, per
// Service (annotation kube-userspace-proxy.io/scheduler). The seed article
// lists IPVS's; iptables mode picks at random. A userspace proxy offers them
// at no kernel cost. ClientIP affinity applies before any of them; ejected
// and drained endpoints are never offered to them (balancer.go).
//
// IPVS's sed and nq weigh active connections by endpoint weights; with the
// equal weights of Kubernetes endpoints sed picks what lc picks, and nq
// differs only in preferring an idle endpoint, which lc also does: both
// would be lc under another name, so they are not offered.

import (
	"encoding/binary"
	"hash/fnv"
	"math/rand/v2"
	"net/netip"
)

// Scheduler names, as the annotation gives them.
const (
	SchedRoundRobin = "rr"
	SchedLeastConn  = "lc"
	SchedSourceHash = "sh"
	SchedRandom     = "random"
)

// scheduler chooses one of eps for a new connection from client, among those
// in rotation (in.ok), or returns nil when none is. Called with the
// balancer's lock held.
type scheduler interface {
	name() string
	reason() Reason
	choose(eps []*endpoint, client netip.Addr, in rotation) *endpoint
	// peek returns what choose would, changing nothing; nil also when the
	// choice cannot be known in advance (random).
	peek(eps []*endpoint, client netip.Addr, in rotation) *endpoint
	// reset is told of a new endpoint set of n.
	reset(n int)
}

// rotation says which endpoints a pick may choose: never a drained one, and
// no ejected one unless ejection is ignored (every endpoint is ejected). A
// value, not a closure: a closure handed to an interface method escapes, one
// allocation per pick.
type rotation struct {
	nanos          int64 // now, for ejection
	ignoreEjection bool
}

func (r rotation) ok(e *endpoint) bool {
	return !e.drained.Load() && (r.ignoreEjection || !e.ejected(r.nanos))
}

// newScheduler returns the named scheduler, or rr and false for a name it
// does not know ("" is rr).
func newScheduler(name string) (scheduler, bool) {
	switch name {
	case SchedRoundRobin, "":
		return &roundRobin{}, true
	case SchedLeastConn:
		return &leastConn{}, true
	case SchedSourceHash:
		return sourceHash{}, true
	case SchedRandom:
		return randomPick{}, true
	}
	return &roundRobin{}, false
}

// KnownScheduler reports whether name is a scheduler ("" included).
func KnownScheduler(name string) bool { _, ok := newScheduler(name); return ok }

// roundRobin cycles through the endpoints, skipping those not ok.
type roundRobin struct{ next int }

func (*roundRobin) name() string   { return SchedRoundRobin }
func (*roundRobin) reason() Reason { return ReasonRoundRobin }

// reset starts each new set at a random place, so that many nodes do not
// all send their first connection to the same endpoint.
func (r *roundRobin) reset(n int) {
	r.next = 0
	if n > 1 {
		r.next = rand.IntN(n)
	}
}

func (r *roundRobin) peek(eps []*endpoint, client netip.Addr, in rotation) *endpoint {
	c := *r
	return c.choose(eps, client, in)
}

// position is the index in the sorted endpoints where the next pick starts looking.
func (r *roundRobin) position() int { return r.next }

func (r *roundRobin) choose(eps []*endpoint, _ netip.Addr, in rotation) *endpoint {
	n := len(eps)
	for tried := 0; tried < n; tried++ {
		i := (r.next + tried) % n
		if in.ok(eps[i]) {
			r.next = (i + 1) % n
			return eps[i]
		}
	}
	return nil
}

// leastConn picks the endpoint with the fewest active connections; ties go
// round-robin, so that idle endpoints share new connections evenly.
type leastConn struct{ roundRobin }

func (*leastConn) name() string   { return SchedLeastConn }
func (*leastConn) reason() Reason { return ReasonLeastConn }

func (l *leastConn) peek(eps []*endpoint, client netip.Addr, in rotation) *endpoint {
	c := *l
	return c.choose(eps, client, in)
}

func (l *leastConn) choose(eps []*endpoint, _ netip.Addr, in rotation) *endpoint {
	n := len(eps)
	best := -1
	var least int64
	for tried := 0; tried < n; tried++ {
		i := (l.next + tried) % n
		if !in.ok(eps[i]) {
			continue
		}
		if a := eps[i].active.Load(); best < 0 || a < least {
			best, least = i, a
		}
	}
	if best < 0 {
		return nil
	}
	l.next = (best + 1) % n
	return eps[best]
}

// sourceHash is rendezvous (highest random weight) hashing of the client
// address with each endpoint's: a client keeps its endpoint while that
// endpoint stays, on every node and across restarts (the hash has no seed),
// and removing one of N endpoints moves only the clients that were on it,
// about 1/N of them. O(endpoints) per pick.
type sourceHash struct{}

func (sourceHash) name() string   { return SchedSourceHash }
func (sourceHash) reason() Reason { return ReasonSourceHash }
func (sourceHash) reset(int)      {}

func (s sourceHash) peek(eps []*endpoint, client netip.Addr, in rotation) *endpoint {
	return s.choose(eps, client, in)
}

func (sourceHash) choose(eps []*endpoint, client netip.Addr, in rotation) *endpoint {
	var best *endpoint
	var top uint64
	c := client.Unmap().As16()
	for _, e := range eps {
		if !in.ok(e) {
			continue
		}
		if w := rendezvousWeight(c, e.addr); best == nil || w > top {
			best, top = e, w
		}
	}
	return best
}

// rendezvousWeight is the FNV-1a hash of the client's and the endpoint's
// addresses, finished with a 64-bit mixer (FNV alone spreads the last bytes
// poorly).
func rendezvousWeight(client [16]byte, ep netip.AddrPort) uint64 {
	h := fnv.New64a()
	h.Write(client[:])
	a := ep.Addr().Unmap().As16()
	h.Write(a[:])
	var port [2]byte
	binary.BigEndian.PutUint16(port[:], ep.Port())
	h.Write(port[:])
	x := h.Sum64()
	// splitmix64's finalizer.
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// randomPick picks uniformly among the endpoints in rotation, as iptables
// mode does.
type randomPick struct{}

func (randomPick) name() string   { return SchedRandom }
func (randomPick) reason() Reason { return ReasonRandom }
func (randomPick) reset(int)      {}

func (randomPick) peek([]*endpoint, netip.Addr, rotation) *endpoint { return nil }

func (randomPick) choose(eps []*endpoint, _ netip.Addr, in rotation) *endpoint {
	var chosen *endpoint
	seen := 0
	for _, e := range eps { // reservoir sampling: one pass, no allocation
		if in.ok(e) {
			if seen++; rand.IntN(seen) == 0 {
				chosen = e
			}
		}
	}
	return chosen
}
