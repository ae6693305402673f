package proxy

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

// descriptorBudget splits RLIMIT_NOFILE. Safe for concurrent use.
type descriptorBudget struct {
	limit   int // RLIMIT_NOFILE (soft)
	reserve int // never for flows or connections: accepts, syncs, the API watch, HTTP
	udpCap  int // UDP flows of all service ports together

	udpFlows  atomic.Int64 // flows open now, all service ports
	tcpConns  atomic.Int64 // TCP connections open now (two descriptors each)
	listeners atomic.Int64 // listening sockets and NodePort holds

	mu  sync.Mutex
	udp map[*udpServer]bool // the UDP servers, for eviction across Services

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
	b := &descriptorBudget{limit: limit, udp: map[*udpServer]bool{}}
	b.reserve = min(max(64, limit/16), limit/4) // a tiny limit keeps room for connections
	b.udpCap = max(1, (limit-b.reserve)/2)
	descriptorBudgetGauge.WithLabelValues("limit").Set(float64(b.limit))
	descriptorBudgetGauge.WithLabelValues("reserve").Set(float64(b.reserve))
	descriptorBudgetGauge.WithLabelValues("udp_flows").Set(float64(b.udpCap))
	return b
}

func (b *descriptorBudget) addUDP(u *udpServer) {
	b.mu.Lock()
	b.udp[u] = true
	b.mu.Unlock()
}

func (b *descriptorBudget) removeUDP(u *udpServer) {
	b.mu.Lock()
	delete(b.udp, u)
	b.mu.Unlock()
}

// flowOpened counts a new flow and reports whether the UDP share is now
// exceeded (the caller evicts).
func (b *descriptorBudget) flowOpened() bool {
	return b.udpFlows.Add(1) > int64(b.udpCap)
}

func (b *descriptorBudget) flowClosed() {
	b.udpFlows.Add(-1)
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

func (b *descriptorBudget) evictOne() bool {
	b.mu.Lock()
	var owner *udpServer
	var most int
	var oldestSeen int64
	for u := range b.udp {
		n, _ := u.counts()
		if n == 0 || n < most {
			continue
		}
		fl := u.oldest()
		if fl == nil {
			continue
		}
		// The Service port with the most flows gives one up (its least
		// recently used): a flood on one leaves the others' flows in
		// place. Between equals, the one with the older flow.
		if seen := fl.lastSeen.Load(); n > most || seen < oldestSeen {
			owner, most, oldestSeen = u, n, seen
		}
	}
	b.mu.Unlock()
	if owner == nil {
		return true
	}
	victim := owner.oldest()
	return victim == nil || owner.evict(victim)
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
