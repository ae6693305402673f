package proxy

import (
	"net/netip"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// connRecord is one proxied TCP connection, from accept to close. It is what
// the per-connection log line and the live connection table show.
type connRecord struct {
	ID      uint64
	Service config.ServicePortName
	Client  netip.AddrPort
	OrigDst netip.AddrPort // where the client was going (SO_ORIGINAL_DST)
	Start   time.Time

	fe *frontend

	up, down atomic.Int64 // bytes so far

	mu          sync.Mutex // guards the fields below, set while the connection lives
	Endpoint    netip.AddrPort
	Reason      Reason
	Attempt     int
	DialLatency time.Duration
	shutdown    bool
	client      *sock
	backend     *sock
}

func (c *connRecord) addUp(n int64) {
	c.up.Add(n)
	c.fe.m.get().bytesIn.Add(float64(n))
}

func (c *connRecord) addDown(n int64) {
	c.down.Add(n)
	c.fe.m.get().bytesOut.Add(float64(n))
}

func (c *connRecord) setDialLatency(d time.Duration) {
	c.mu.Lock()
	c.DialLatency = d
	c.mu.Unlock()
}

// ConnInfo is one live connection, for the debug table.
type ConnInfo struct {
	ID          uint64        `json:"id"`
	Service     string        `json:"service"`
	Client      string        `json:"client"`
	OrigDst     string        `json:"origDst"`
	Endpoint    string        `json:"endpoint,omitempty"`
	Reason      Reason        `json:"reason,omitempty"`
	Attempts    int           `json:"attempts"`
	DialLatency time.Duration `json:"dialLatencyNs"`
	Age         time.Duration `json:"ageNs"`
	BytesUp     int64         `json:"bytesUp"`
	BytesDown   int64         `json:"bytesDown"`
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
	return ci
}

func (c *connRecord) setBackend(ep netip.AddrPort, why Reason, attempt int) {
	c.mu.Lock()
	c.Endpoint, c.Reason, c.Attempt = ep, why, attempt
	c.mu.Unlock()
}

func (c *connRecord) setConns(client, backend *sock) {
	c.mu.Lock()
	c.client, c.backend = client, backend
	shut := c.shutdown
	c.mu.Unlock()
	if shut { // shutdown raced with the dial
		client.Close()
		backend.Close()
	}
}

// closeCause is the cause for a copy that failed because we closed its socket.
func (c *connRecord) closeCause() Cause {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.shutdown {
		return CauseShutdown
	}
	return CauseBackendClosed
}

// forceClose ends the connection from outside (shutdown).
func (c *connRecord) forceClose() {
	c.mu.Lock()
	c.shutdown = true
	client, backend := c.client, c.backend
	c.mu.Unlock()
	if client != nil {
		client.Close()
		backend.Close()
	}
}

// finish logs the connection's one line and records its duration.
func (c *connRecord) finish(f *frontend, up, down int64, cause Cause) {
	f.m.get().duration.Observe(time.Since(c.Start).Seconds())
	c.mu.Lock()
	l := endLine{protocol: config.TCP, client: c.Client, origDst: c.OrigDst.String(), endpoint: c.Endpoint, reason: c.Reason,
		up: up, down: down, start: c.Start, cause: cause, attempts: c.Attempt + 1, dialLatency: c.DialLatency}
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

func (t *connTable) add(f *frontend, client netip.AddrPort) *connRecord {
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
	t.mu.Lock()
	delete(t.conns, c.ID)
	t.mu.Unlock()
	t.wg.Done()
}

func (t *connTable) list() []*connRecord {
	t.mu.Lock()
	out := make([]*connRecord, 0, len(t.conns))
	for _, c := range t.conns {
		out = append(out, c)
	}
	t.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Connections returns the live TCP connections, oldest first.
func (p *Proxier) Connections() []ConnInfo {
	now := time.Now()
	var out []ConnInfo
	for _, c := range p.conns.list() {
		out = append(out, c.info(now))
	}
	return out
}

// closeAll force-closes every live connection and waits for their goroutines.
func (t *connTable) closeAll() {
	for _, c := range t.list() {
		c.forceClose()
	}
	t.wg.Wait()
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
