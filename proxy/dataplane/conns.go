package dataplane

import (
	"context"
	"net/netip"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
)

// connRecord is one proxied TCP connection, from accept to close. It is what
// the per-connection log line and the live connection table show.
type connRecord struct {
	ID      uint64
	Service config.ServicePortName
	Client  netip.AddrPort
	Start   time.Time

	fe *Frontend

	up, down atomic.Int64 // bytes so far

	mu          sync.Mutex     // guards the fields below, set while the connection lives
	OrigDst     netip.AddrPort // where the client was going (SO_ORIGINAL_DST)
	Endpoint    netip.AddrPort
	Reason      balance.Reason
	Attempt     int
	DialLatency time.Duration
	BackendSees netip.Addr // the source address the backend sees; invalid: the node's
	dialErrors  []string   // "failure endpoint" of every failed dial attempt
	shutdown    bool
	paired      bool // pair is set: the dial succeeded

	pair tcpPair // set once, before the copies start

	// Only the idle sweep touches these.
	sweptMoved  int64 // moved at the last sweep
	quietSweeps int   // sweeps in a row that saw nothing move
}

func (c *connRecord) addUp(n int64) {
	c.up.Add(n)
	c.fe.m.get().bytesIn.Add(float64(n))
}

func (c *connRecord) addDown(n int64) {
	c.down.Add(n)
	c.fe.m.get().bytesOut.Add(float64(n))
}

// moved is the bytes copied so far, both ways.
func (c *connRecord) moved() int64 { return c.up.Load() + c.down.Load() }

func (c *connRecord) endpoint() netip.AddrPort {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.Endpoint
}

func (c *connRecord) origDst() netip.AddrPort {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.OrigDst
}

func (c *connRecord) setOrigDst(dst netip.AddrPort) {
	c.mu.Lock()
	c.OrigDst = dst
	c.mu.Unlock()
}

func (c *connRecord) addDialFailure(ep netip.AddrPort, failure string) {
	c.mu.Lock()
	c.dialErrors = append(c.dialErrors, failure+" "+ep.String())
	c.mu.Unlock()
}

// setDialed records the dial that succeeded: how long it took and the
// address its backend sees (invalid: the node's).
func (c *connRecord) setDialed(d time.Duration, sees netip.Addr) {
	c.mu.Lock()
	c.DialLatency, c.BackendSees = d, sees
	c.mu.Unlock()
}

// seesName is what the debug table and the connection log say the backend
// sees: the client's address, or "node".
func seesName(sees netip.Addr) string {
	if sees.IsValid() {
		return sees.String()
	}
	return "node"
}

// ConnInfo is one live connection, for the debug table.
type ConnInfo struct {
	ID          uint64         `json:"id"`
	Service     string         `json:"service"`
	Client      string         `json:"client"`
	OrigDst     string         `json:"origDst"`
	Endpoint    string         `json:"endpoint,omitempty"`
	Reason      balance.Reason `json:"reason,omitempty"`
	Attempts    int            `json:"attempts"`
	DialLatency time.Duration  `json:"dialLatencyNs"`
	// BackendSees is the source address the backend sees: the client's,
	// or "node" for the node's ("" before the dial succeeded).
	BackendSees string        `json:"backendSees,omitempty"`
	Age         time.Duration `json:"ageNs"`
	BytesUp     int64         `json:"bytesUp"`
	BytesDown   int64         `json:"bytesDown"`
	// AckedUp and AckedDown are the bytes the endpoint and the client
	// have acknowledged: what reached them. With a slow reader both these
	// and BytesUp/Down move in steps, as its kernel reopens its window.
	AckedUp   uint64 `json:"ackedUp"`
	AckedDown uint64 `json:"ackedDown"`
}

func (c *connRecord) info(now time.Time) ConnInfo {
	c.mu.Lock()
	defer c.mu.Unlock()
	ci := ConnInfo{ID: c.ID, Service: c.Service.String(), Client: c.Client.String(), OrigDst: c.OrigDst.String(),
		Reason: c.Reason, Attempts: c.Attempt + 1, DialLatency: c.DialLatency, Age: now.Sub(c.Start),
		BytesUp: c.up.Load(), BytesDown: c.down.Load()}
	if c.Endpoint.IsValid() {
		ci.Endpoint = c.Endpoint.String()
	}
	if c.paired {
		ci.BackendSees = seesName(c.BackendSees)
	}
	return ci
}

func (c *connRecord) setBackend(ep netip.AddrPort, why balance.Reason, attempt int) {
	c.mu.Lock()
	c.Endpoint, c.Reason, c.Attempt = ep, why, attempt
	c.mu.Unlock()
}

// setPair makes client and backend the connection's pair and returns it;
// shutdown and the idle sweep can end it from now on.
func (c *connRecord) setPair(client, backend *sock.Conn) *tcpPair {
	c.pair.client, c.pair.backend = client, backend
	c.mu.Lock()
	c.paired = true
	shut := c.shutdown
	c.mu.Unlock()
	if shut { // shutdown raced with the dial
		c.pair.end(CauseShutdown)
	}
	return &c.pair
}

// end ends the connection's pair, if it has one, from outside: shutdown or
// the idle sweep. It never waits: the handler closes the sockets once its
// copies have returned.
func (c *connRecord) end(why Cause) {
	c.mu.Lock()
	c.shutdown = c.shutdown || why == CauseShutdown
	paired := c.paired
	c.mu.Unlock()
	if paired {
		c.pair.end(why)
	}
}

// finish logs the connection's one line and records its duration.
func (c *connRecord) finish(f *Frontend, up, down int64, cause Cause) {
	f.m.get().duration.Observe(time.Since(c.Start).Seconds())
	c.mu.Lock()
	l := endLine{protocol: config.TCP, client: c.Client, origDst: c.OrigDst.String(), endpoint: c.Endpoint, reason: c.Reason,
		up: up, down: down, start: c.Start, cause: cause, attempts: c.Attempt + 1, dialLatency: c.DialLatency,
		dialErrors: c.dialErrors, backendSees: seesName(c.BackendSees)}
	if !c.paired {
		l.backendSees = ""
	}
	c.mu.Unlock()
	f.logEnd(l)
}

// connTable holds every live TCP connection of a Proxier.
type connTable struct {
	nextID atomic.Uint64
	wg     sync.WaitGroup // one per live connection

	mu    sync.Mutex
	conns map[uint64]*connRecord
}

func (t *connTable) add(f *Frontend, client netip.AddrPort) *connRecord {
	c := &connRecord{
		fe:      f,
		ID:      t.nextID.Add(1),
		Service: f.key.Name,
		Client:  client,
		Start:   time.Now(),
	}
	t.wg.Add(1)
	f.m.get().active.Inc()
	t.mu.Lock()
	if t.conns == nil {
		t.conns = make(map[uint64]*connRecord)
	}
	t.conns[c.ID] = c
	t.mu.Unlock()
	return c
}

func (t *connTable) remove(c *connRecord) {
	c.fe.m.get().active.Dec()
	c.fe.dp.budget.releaseTCP()
	t.mu.Lock()
	delete(t.conns, c.ID)
	t.mu.Unlock()
	t.wg.Done()
}

func (t *connTable) list() []*connRecord {
	out := t.all()
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// count is the number of live connections.
func (t *connTable) count() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.conns)
}

// all returns the live connections in no order.
func (t *connTable) all() []*connRecord {
	t.mu.Lock()
	out := make([]*connRecord, 0, len(t.conns))
	for _, c := range t.conns {
		out = append(out, c)
	}
	t.mu.Unlock()
	return out
}

// closeAll force-closes every live connection and waits for their goroutines.
func (t *connTable) closeAll() {
	for _, c := range t.list() {
		c.end(CauseShutdown)
	}
	t.wg.Wait()
}

// sweepIdle ends the pairs through which no byte moved, either way, for
// idle, until ctx ends. It looks every idle/4, so a quiet pair ends between
// idle and 1.25 idle after its last byte, whatever its copies wait on: a
// copy parked writing to a backend that stopped reading counts as quiet
// too, where a read deadline could not fire. One goroutine for all
// connections: nothing per connection to arm or stop.
func (t *connTable) sweepIdle(ctx context.Context, idle time.Duration) {
	const looks = 4
	tick := time.NewTicker(max(idle/looks, time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		for _, c := range t.all() {
			if m := c.moved(); m != c.sweptMoved {
				c.sweptMoved, c.quietSweeps = m, 0
			} else if c.quietSweeps++; c.quietSweeps >= looks {
				c.end(CauseIdleTimeout)
			}
		}
	}
}

// drain waits up to grace for live connections to end on their own.
func (t *connTable) drain(grace time.Duration) {
	done := make(chan struct{})
	go func() { t.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(grace):
		t.closeAll()
		<-done
	}
}

// Connections returns the live TCP connections, oldest first.
func (d *Dataplane) Connections() []ConnInfo {
	now := time.Now()
	var out []ConnInfo
	for _, c := range d.conns.list() {
		ci := c.info(now)
		c.mu.Lock()
		paired, pair := c.paired, &c.pair
		c.mu.Unlock()
		if paired {
			// Two getsockopts per connection, only when someone looks.
			ci.AckedDown, _ = pair.client.Acked()
			ci.AckedUp, _ = pair.backend.Acked()
		}
		out = append(out, ci)
	}
	return out
}
