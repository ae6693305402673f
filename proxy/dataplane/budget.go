package dataplane

// One descriptor budget for the whole daemon. Every UDP flow holds a socket
// and every TCP connection two; the flow cap per service port (4096) did not
// stop a flood spread over several Services from taking every descriptor,
// after which accepts, the rule check's iptables-save and the API watch
// failed alike. So UDP flows, across all service ports, may hold at most a
// share of RLIMIT_NOFILE, and a reserve is never theirs: past the share a
// new flow evicts the least recently used flow of the service port holding
// the most, so that a flood over one Service leaves the others' flows.

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
)

// flowHolder is a holder of UDP flows as the budget sees it (a UDP
// server's flow table): the budget counts each holder's flows and, past
// the UDP share, takes the least recently used flow of the fullest.
type flowHolder interface {
	// oldestFlow is the holder's least recently used flow, or nil.
	oldestFlow() evictable
}

// evictable is a flow the budget may end to make room.
type evictable interface {
	lastUsed() int64 // when it last carried a datagram (Unix ns)
	evict() bool     // ends it; false: it had ended meanwhile
}

// descriptorBudget splits RLIMIT_NOFILE. Safe for concurrent use.
type descriptorBudget struct {
	limit   int // RLIMIT_NOFILE (soft)
	reserve int // never for flows or connections: accepts, syncs, the API watch, HTTP
	udpCap  int // UDP flows of all service ports together

	udpFlows  atomic.Int64 // flows open now, all service ports
	tcpConns  atomic.Int64 // TCP connections open now (two descriptors each)
	listeners atomic.Int64 // listening sockets and NodePort holds

	// mu guards the index of UDP servers by flow count, so that eviction
	// finds the fullest service port without looking at every one (a
	// flood past the share evicts once per datagram). Taken inside a
	// server's flow lock, never around it.
	mu        sync.Mutex
	flowCount map[flowHolder]int              // every open UDP server's flows
	byCount   map[int]map[flowHolder]struct{} // the servers holding n > 0 flows
	most      int                             // the largest n in byCount (0: none)

	// fileLimitAt is when the daemon last ran out of descriptors (unix
	// nanoseconds): /healthz is 503 for a while after.
	fileLimitAt atomic.Int64
}

// newDescriptorBudget derives the budget from limit (0: the process's soft
// RLIMIT_NOFILE): a reserve of 1/16 (at least 64, at most 1/4), then half of the rest for
// UDP flows at most; TCP connections and listeners have what the flows do
// not hold.
func newDescriptorBudget(limit int) *descriptorBudget {
	if limit <= 0 {
		limit = int(sock.FileLimit())
	}
	b := &descriptorBudget{limit: limit, flowCount: map[flowHolder]int{}, byCount: map[int]map[flowHolder]struct{}{}}
	b.reserve = min(max(64, limit/16), limit/4) // a tiny limit keeps room for connections
	b.udpCap = max(1, (limit-b.reserve)/2)
	descriptorBudgetGauge.WithLabelValues("limit").Set(float64(b.limit))
	descriptorBudgetGauge.WithLabelValues("reserve").Set(float64(b.reserve))
	descriptorBudgetGauge.WithLabelValues("udp_flows").Set(float64(b.udpCap))
	return b
}

// addUDP indexes a UDP server that opens (with no flow yet).
func (b *descriptorBudget) addUDP(u flowHolder) {
	b.mu.Lock()
	if _, ok := b.flowCount[u]; !ok {
		b.flowCount[u] = 0
	}
	b.mu.Unlock()
}

// removeUDP takes a closing server out of the index; its flows still close
// and count out of the share.
func (b *descriptorBudget) removeUDP(u flowHolder) {
	b.mu.Lock()
	b.moveLocked(u, -b.flowCount[u])
	delete(b.flowCount, u)
	b.mu.Unlock()
}

// flowOpened counts a new flow of u and reports whether the UDP share is
// now exceeded (the caller evicts).
func (b *descriptorBudget) flowOpened(u flowHolder) bool {
	b.mu.Lock()
	b.moveLocked(u, 1)
	b.mu.Unlock()
	return b.udpFlows.Add(1) > int64(b.udpCap)
}

func (b *descriptorBudget) flowClosed(u flowHolder) {
	b.udpFlows.Add(-1)
	b.mu.Lock()
	b.moveLocked(u, -1)
	b.mu.Unlock()
}

// moveLocked changes u's flow count by delta in the index (a server not
// indexed is left out). Finding the new largest count after a decrease steps
// down one count at a time: as many steps, over time, as flows were opened.
func (b *descriptorBudget) moveLocked(u flowHolder, delta int) {
	n, ok := b.flowCount[u]
	if !ok || delta == 0 {
		return
	}
	if n > 0 {
		delete(b.byCount[n], u)
		if len(b.byCount[n]) == 0 {
			delete(b.byCount, n)
		}
	}
	n = max(0, n+delta)
	b.flowCount[u] = n
	if n > 0 {
		if b.byCount[n] == nil {
			b.byCount[n] = map[flowHolder]struct{}{}
		}
		b.byCount[n][u] = struct{}{}
		b.most = max(b.most, n)
	}
	for b.most > 0 && len(b.byCount[b.most]) == 0 {
		b.most--
	}
}

// evictForNew ends a flow to make room for a new one past the daemon's
// UDP share: the least recently used flow of the UDP frontend holding the
// most (evictOne). Two flows opened at once may pick the same victim: the
// one that finds it gone picks again, so that every flow over the share
// evicts one.
func (b *descriptorBudget) evictForNew() {
	for try := 0; try < 8 && b.udpFlows.Load() > int64(b.udpCap); try++ {
		if b.evictOne() {
			return
		}
	}
}

// fullestSample is how many of the servers holding the most flows are
// compared for the oldest flow: a tie between many is settled among a few.
const fullestSample = 8

// evictOne evicts the least recently used flow of the service port
// holding the most flows, so that a flood on one leaves the others' flows
// in place; between equals, the one with the older flow. false: the victim
// ended meanwhile (pick again).
func (b *descriptorBudget) evictOne() bool {
	b.mu.Lock()
	candidates := make([]flowHolder, 0, fullestSample)
	for u := range b.byCount[b.most] {
		if candidates = append(candidates, u); len(candidates) == fullestSample {
			break
		}
	}
	b.mu.Unlock()
	var victim evictable
	for _, u := range candidates { // outside b.mu: oldestFlow takes the holder's lock
		if fl := u.oldestFlow(); fl != nil && (victim == nil || fl.lastUsed() < victim.lastUsed()) {
			victim = fl
		}
	}
	if victim == nil {
		return true
	}
	return victim.evict()
}

// admitTCP takes a place for a new TCP connection (its socket is already
// accepted; the dial needs one more), or reports false when it would eat
// into the reserve: the caller resets it at once, which the client sees at
// once, instead of an accept or a rule sync failing later. release gives
// the place back.
func (b *descriptorBudget) admitTCP() bool {
	if n := b.tcpConns.Add(1); 2*n+b.udpFlows.Load()+b.listeners.Load() > int64(b.limit-b.reserve) {
		b.tcpConns.Add(-1)
		return false
	}
	return true
}

func (b *descriptorBudget) releaseTCP() { b.tcpConns.Add(-1) }

// ranOut records that a system call failed for want of descriptors.
func (b *descriptorBudget) ranOut() { b.fileLimitAt.Store(time.Now().UnixNano()) }

// exhaustedWithin reports whether the daemon ran out of descriptors less
// than d ago.
func (b *descriptorBudget) exhaustedWithin(d time.Duration) bool {
	at := b.fileLimitAt.Load()
	return at != 0 && time.Since(time.Unix(0, at)) < d
}

// BudgetStatus is the descriptor budget as of now.
type BudgetStatus struct {
	Limit    int   // RLIMIT_NOFILE (soft)
	Reserve  int   // never for flows or connections
	UDPShare int   // UDP flows of all service ports together
	UDPFlows int64 // open now
	TCPConns int64 // open now, two descriptors each
}

// Budget is the descriptor budget as of now.
func (d *Dataplane) Budget() BudgetStatus {
	b := d.budget
	return BudgetStatus{Limit: b.limit, Reserve: b.reserve, UDPShare: b.udpCap, UDPFlows: b.udpFlows.Load(), TCPConns: b.tcpConns.Load()}
}

// Parked is how many sockets wait in the parker without a goroutine.
func (d *Dataplane) Parked() int64 { return d.parker.Load().Parked() }
