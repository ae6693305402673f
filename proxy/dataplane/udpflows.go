package dataplane

// A UDP server's flow table: the flows by client, least recently used last,
// and the ways a flow leaves it (evicted, moved off an endpoint that no
// longer serves, ended).

import (
	"container/list"
	"net/netip"
	"sync"
	"sync/atomic"
)

// udpFlows is a UDP server's flow table.
type udpFlows struct {
	mu     sync.Mutex // guards flows, lru, closed and direct
	closed bool       // closeFlows ran: no new flow (a failover may still try)
	flows  map[flowKey]*udpFlow
	// direct are the clients from other hosts whose datagrams came to the
	// listener without a rule (udp.go, unredirected), each until a UNIX
	// nanosecond time: their next datagrams are dropped without asking
	// conntrack again.
	direct  map[netip.AddrPort]int64
	lru     list.List // front: most recently used
	evicted atomic.Uint64
	wg      sync.WaitGroup // one per flow reply goroutine
	budget  *descriptorBudget
	server  *udpServer // the table's owner, the budget's flowHolder
}

// flowKey names a flow: a client and the address its datagrams arrived
// on. One client port may send to two addresses of a Service port (its
// cluster IP and its node port; the kernel hands a freed port out again
// soon); each is a flow of its own, whose replies leave from that address,
// as conntrack keeps a flow per destination for kube-proxy.
type flowKey struct {
	client netip.AddrPort
	local  netip.Addr
}

func (fl *udpFlow) key() flowKey { return flowKey{client: fl.client, local: fl.local} }

func (t *udpFlows) removeLocked(fl *udpFlow) bool {
	if cur, ok := t.flows[fl.key()]; ok && cur == fl {
		delete(t.flows, fl.key())
		t.lru.Remove(fl.elem)
		t.budget.flowClosed(t.server)
		return true
	}
	return false
}

// evict ends fl to make room (the flow table or the daemon's UDP share is
// full); its reply goroutine logs and exits. false: fl had ended meanwhile.
func (u *udpServer) evict(fl *udpFlow) bool {
	u.flows.mu.Lock()
	removed := u.flows.removeLocked(fl)
	if removed {
		u.m.get().udpActive.Dec()
		u.flows.evicted.Add(1)
	}
	u.flows.mu.Unlock()
	if !removed {
		return false
	}
	u.m.get().evicted.Inc()
	fl.cause.CompareAndSwap(uint32(causeNone), uint32(CauseEvicted))
	fl.backend.Close()
	return true
}

// endFlowsOff ends the flows whose endpoint no longer serves (gone from the
// Service's slices, or not serving): the client's next datagram opens a flow
// to an endpoint the balancer picks, as kube-proxy's UDP conntrack cleanup
// moves it. A terminating endpoint that still serves keeps its flows. A
// client that sends often from one source port never idles out, so without
// this it would keep talking to a pod that is gone.
func (u *udpServer) endFlowsOff(serving map[netip.AddrPort]bool) {
	u.flows.mu.Lock()
	var off []*udpFlow
	for _, fl := range u.flows.flows {
		if !serving[fl.endpoint] {
			off = append(off, fl)
		}
	}
	u.flows.mu.Unlock()
	for _, fl := range off {
		u.endFlow(fl, CauseEndpointGone)
	}
	if len(off) > 0 {
		u.m.get().moved.Add(float64(len(off)))
	}
}

// counts returns the live and the evicted flow counts.
func (u *udpServer) counts() (active int, evicted uint64) {
	u.flows.mu.Lock()
	defer u.flows.mu.Unlock()
	return len(u.flows.flows), u.flows.evicted.Load()
}

// oldestFlow is the least recently used flow, or nil (the budget's
// flowHolder).
func (u *udpServer) oldestFlow() evictable {
	u.flows.mu.Lock()
	defer u.flows.mu.Unlock()
	if e := u.flows.lru.Back(); e != nil {
		return e.Value.(*udpFlow)
	}
	return nil
}

// lastUsed is when fl last carried a datagram (the budget's evictable).
func (fl *udpFlow) lastUsed() int64 { return fl.lastSeen.Load() }

// evict ends fl to make room for another (the budget's evictable).
func (fl *udpFlow) evict() bool { return fl.server.evict(fl) }

// endFlow removes fl and closes its socket; its reply goroutine then exits.
func (u *udpServer) endFlow(fl *udpFlow, cause Cause) {
	u.flows.mu.Lock()
	if u.flows.removeLocked(fl) {
		u.m.get().udpActive.Dec()
	}
	u.flows.mu.Unlock()
	fl.cause.CompareAndSwap(uint32(causeNone), uint32(cause))
	fl.backend.Close()
}
