package dataplane

// One UDP flow's path, all of it the frontend's udpServer's:
//
//	serve reads a datagram (with IP_PKTINFO: the address it arrived on)
//	  → flowFor finds or creates the client's flow (a new one from another
//	    host that no rule redirected is dropped first where the kernel has
//	    no conntrack match: unredirected asks conntrack once; then balancer
//	    pick, connected socket to the endpoint from the address the backend
//	    should see (package clientaddr) and sock.DialUDPFrom; the least recently used
//	    flow is evicted when the table is full)
//	  → the datagram is written to the endpoint
//	replies copies the endpoint's datagrams back to the client, sent from
//	the address the client's datagram arrived on so that conntrack can undo
//	the REDIRECT, until the flow has been idle for the UDP timeout; then
//	the flow's source NAT entry and port are given back (fl.release).
//
// At a handover the flow leaves whole instead (transfer_udp.go): replies
// stops at its next read and the socket, NAT and all, goes to the
// successor, whose own replies goroutine carries on.

import (
	"container/list"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
)

// DefaultUDPTimeout is how long a UDP flow lives without traffic. It matches
// the kernel's nf_conntrack_udp_timeout (30 s), so the REDIRECT's conntrack
// entry and the flow expire together, and it is far longer than any DNS
// client's retry interval (1–5 s): a slow answer still finds its flow. The
// classic proxier's 250 ms dropped late DNS answers (kubernetes #14939).
const DefaultUDPTimeout = 30 * time.Second

// DefaultUDPMaxFlows bounds the flow table per service port; each flow holds
// one socket, so a flood of client addresses cannot exhaust descriptors.
const DefaultUDPMaxFlows = 4096

// udpSocket is a frontend socket (sock.ListenUDP), which reports the local
// address each datagram arrived on.
type udpSocket struct {
	conn   *net.UDPConn
	family int
}

// udpFlow is one client ip:port talking to one endpoint.
type udpFlow struct {
	client   netip.AddrPort
	local    netip.Addr // where the client's datagrams arrived; replies leave from it
	endpoint netip.AddrPort
	reason   balance.Reason
	backend  *net.UDPConn
	sees     netip.Addr    // the source address the backend sees; invalid: the node's
	release  func()        // gives back backend's source NAT entry and port, once it is closed
	out      *sock.Sender  // to backend; used by the frontend's read loop only
	elem     *list.Element // in udpFlows.lru
	start    time.Time
	lastSeen atomic.Int64  // unix nanos of the last datagram either way
	up, down atomic.Int64  // bytes
	cause    atomic.Uint32 // a Cause: why it ended; the first one set wins
	err      atomic.Value  // an errBox: the endpoint socket's error, with CauseEndpointError

	failovers int        // endpoints of this client's exchange that failed before this flow's
	server    *udpServer // whose table it is in (insert)

	// A handover (transfer_udp.go): detached asks the reply goroutine to stop
	// at its next read, leaving the socket open; it sets transferable when it
	// did so, then closes stopped, as it does whenever it exits.
	detached     atomic.Bool
	transferable bool
	stopped      chan struct{}

	lastMu sync.Mutex // guards last
	last   []byte     // the last datagram sent to the endpoint, if small: re-sent after a failover
}

// maxResend is the largest datagram a flow keeps to re-send on another
// endpoint when its endpoint fails (a DNS query with EDNS fits): the copy
// is bounded, and bulk datagrams are not worth keeping.
const maxResend = 4096

// keep remembers b as the last datagram sent, if it is small enough.
func (fl *udpFlow) keep(b []byte) {
	fl.lastMu.Lock()
	if len(b) <= maxResend {
		fl.last = append(fl.last[:0], b...)
	} else {
		fl.last = fl.last[:0]
	}
	fl.lastMu.Unlock()
}

func (fl *udpFlow) lastDatagram() []byte {
	fl.lastMu.Lock()
	defer fl.lastMu.Unlock()
	return append([]byte(nil), fl.last...)
}

func (fl *udpFlow) touch() { fl.lastSeen.Store(time.Now().UnixNano()) }

// udpServer is a UDP frontend's socket, its read loop and its flow table;
// the table's eviction is its own (the descriptor budget asks it for its
// oldest flow).
type udpServer struct {
	*Frontend // the listener's own: balancer, metrics, log
	sk        *udpSocket
	flows     udpFlows
	served    sync.WaitGroup // the read loop
	quit      chan struct{}  // closed when the read loop is to stop; guarded by flows.mu
}

// serve reads datagrams until the socket is closed: whatever is queued
// when it wakes, a batch at a time (sock.Batch). In a successor it first
// waits for the predecessor's flows (dataplane.udpGate).
func (u *udpServer) serve(quit <-chan struct{}) {
	if g := u.dp.udpGate; g != nil {
		select {
		case <-g:
		case <-quit:
			return
		}
	}
	in, err := sock.NewReceiver(u.sk.conn, true)
	if err != nil {
		u.log().WithError(err).Error("UDP socket unusable; service port not served")
		return
	}
	var backoff time.Duration
	var run [][]byte // one client's datagrams, forwarded together
	forward := func(b *sock.Batch) { run = u.forwardBatch(b, run) }
	for {
		err := in.Next(forward)
		if err == nil {
			backoff = 0
			continue
		}
		if errors.Is(err, net.ErrClosed) {
			return
		}
		backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
		u.log().WithError(err).Warn("UDP read failed")
		select {
		case <-time.After(backoff):
		case <-u.dp.ctx.Done():
			return
		}
	}
}

// forwardBatch forwards a batch drained from the frontend socket:
// consecutive datagrams of one client to one address go together (one GSO
// send where they can). run is scratch space, returned for reuse.
func (u *udpServer) forwardBatch(b *sock.Batch, run [][]byte) [][]byte {
	for i := 0; i < b.Len(); {
		from, to := b.From(i), b.To(i)
		run = append(run[:0], b.Datagram(i))
		j := i + 1
		for ; j < b.Len() && b.From(j) == from && b.To(j) == to; j++ {
			run = append(run, b.Datagram(j))
		}
		u.forward(from, to, run)
		i = j
	}
	clear(run) // hold no datagram of the batch given back
	return run
}

// forward sends datagrams, all from client to the local address to, to the
// client's flow, making the flow if needed.
func (u *udpServer) forward(client netip.AddrPort, to netip.Addr, datagrams [][]byte) {
	fl := u.flowFor(client, to)
	if fl == nil {
		return // no endpoint: dropped (counted and logged in flowFor)
	}
	fl.touch()
	fl.keep(datagrams[len(datagrams)-1])
	sent, err := fl.out.SendSegments(datagrams, netip.Addr{}, netip.AddrPort{})
	n := payloadBytes(datagrams[:sent])
	fl.up.Add(n)
	u.m.get().bytesIn.Add(float64(n))
	if err != nil {
		u.debug(logrus.Fields{"client": client, "endpoint": fl.endpoint}, err, "UDP send to endpoint failed")
		u.endpointFailed(fl, fmt.Errorf("send: %w", err))
	}
}

// flowFor returns the client's flow to the address local, creating it if
// needed. nil: no endpoint (or no socket) for it.
func (u *udpServer) flowFor(client netip.AddrPort, local netip.Addr) *udpFlow {
	t := &u.flows
	t.mu.Lock()
	if fl, ok := t.flows[flowKey{client: client, local: local}]; ok {
		t.lru.MoveToFront(fl.elem)
		t.mu.Unlock()
		return fl
	}
	t.mu.Unlock()
	if u.unredirected(client, local) {
		return nil
	}
	return u.newFlow(&udpFlow{client: client, local: local}, netip.AddrPort{}, nil)
}

// maxDirectClients bounds the clients an unredirected UDP flow is
// remembered for; beyond it they are forgotten together, and each one's
// next datagram asks conntrack again.
const maxDirectClients = 4096

// unredirected is the UDP half of Config.GuardAtAccept: whether the
// datagram from client, the first of a new flow, came to the listener at
// local from another host without a rule redirecting it (its conntrack
// entry's original destination is the listener itself, or it has none),
// to be dropped. One netlink request per new flow, none per datagram of a
// flow; a client found so is remembered for the UDP timeout. Where
// conntrack cannot answer, the datagram passes: the guard never refuses a
// flow it cannot judge.
func (u *udpServer) unredirected(client netip.AddrPort, local netip.Addr) bool {
	ct := u.dp.conntrack
	if ct == nil || u.onNodePort {
		return false // no guard, or a NodePort: meant to be reached directly
	}
	t := &u.flows
	now := time.Now().UnixNano()
	t.mu.Lock()
	until, known := t.direct[client]
	t.mu.Unlock()
	if !known || now > until {
		listener := netip.AddrPortFrom(local, u.listen.Port())
		dst, found, err := ct.UDPOriginalDst(listener, client)
		if err != nil {
			u.debug(logrus.Fields{"client": client}, err, "UDP guard: conntrack did not answer; the flow passes")
			return false
		}
		if found && dst != listener || sock.IsLocalAddr(client.Addr()) {
			return false // redirected, or the node itself
		}
		t.mu.Lock()
		if t.direct == nil || len(t.direct) >= maxDirectClients {
			t.direct = map[netip.AddrPort]int64{}
		}
		t.direct[client] = now + int64(u.dp.cfg.udpTimeout())
		t.mu.Unlock()
		u.logUnredirected(client)
	}
	unredirectedDatagrams.Inc()
	return true
}

// newFlow opens the flow fl (client and local set) to an endpoint the
// balancer picks, other than avoid, sends resend on it first if given, and
// puts it in the table (evicting the least recently used flow when the table
// is full). nil: no endpoint (or no socket) for it.
func (u *udpServer) newFlow(fl *udpFlow, avoid netip.AddrPort, resend []byte) *udpFlow {
	client := fl.client
	for attempt := fl.failovers; ; attempt++ {
		if attempt >= len(DefaultDialTimeouts) {
			return nil
		}
		ep, why, ok := u.bal.Pick(client.Addr(), attempt)
		if !ok {
			u.m.get().noEndpoints.Inc()
			u.debug(logrus.Fields{"client": client}, nil, "UDP datagram dropped: no endpoints")
			return nil
		}
		if ep == avoid {
			u.bal.Done(ep)
			continue // the endpoint that just failed: the next pick moves on
		}
		src, wanted := u.source(client, netip.AddrPort{}, ep)
		c, dialed, release, err := sock.DialUDPFrom(ep, src)
		var out *sock.Sender
		if err == nil {
			if out, err = sock.NewSender(c, config.Family(ep.Addr())); err != nil {
				c.Close()
				release()
			}
		}
		if err != nil {
			u.bal.Done(ep)
			u.log().WithFields(logrus.Fields{"client": client, "endpoint": ep}).WithError(err).Warn("UDP socket to endpoint failed")
			if sock.IsFileLimit(err) {
				u.dp.budget.ranOut()
				return nil
			}
			continue
		}
		u.countSource(client, ep, dialed, wanted)
		fl.endpoint, fl.reason, fl.backend, fl.out, fl.start = ep, why, c, out, time.Now()
		fl.sees, fl.release = dialed.Sees, release
		break
	}
	fl.touch()
	if resend != nil {
		// Before the flow is in the table: the frontend's read loop, the
		// sender's other user, cannot see it yet.
		fl.keep(resend)
		if err := fl.out.Send(resend, netip.Addr{}, netip.AddrPort{}); err == nil {
			fl.up.Add(int64(len(resend)))
			u.m.get().bytesIn.Add(float64(len(resend)))
		}
	}

	in, ok := u.insert(fl)
	if !ok {
		// Not serving, or the read loop made one meanwhile (a failover
		// racing a new datagram): keep that one.
		fl.backend.Close()
		fl.release()
		u.bal.Done(fl.endpoint)
	}
	return in
}

// insert puts fl (open to its endpoint) in the table and starts its reply
// goroutine. It returns the client's flow in the table and whether that is
// fl: nil when the server no longer serves.
func (u *udpServer) insert(fl *udpFlow) (*udpFlow, bool) {
	t := &u.flows
	t.mu.Lock()
	if t.flows == nil {
		t.flows = make(map[flowKey]*udpFlow)
	}
	if t.closed {
		t.mu.Unlock()
		return nil, false
	}
	if cur, ok := t.flows[fl.key()]; ok {
		t.mu.Unlock()
		return cur, false
	}
	var victim *udpFlow
	if max := u.dp.cfg.udpMaxFlows(); len(t.flows) >= max {
		victim = t.lru.Back().Value.(*udpFlow)
	}
	fl.server = u
	fl.elem = t.lru.PushFront(fl)
	t.flows[fl.key()] = fl
	u.m.get().udpActive.Inc()
	overBudget := t.budget.flowOpened(u)
	t.wg.Add(1)
	t.mu.Unlock()

	switch {
	case victim != nil:
		u.evict(victim) // this service port's table is full
	case overBudget:
		t.budget.evictForNew() // the daemon's UDP share is: a flow of the fullest service port
	}
	fl.stopped = make(chan struct{})
	go u.replies(fl, fl.backend)
	return fl, true
}

// failFlow ends fl because its endpoint socket failed with err.
func (u *udpServer) failFlow(fl *udpFlow, err error) bool {
	first := fl.cause.CompareAndSwap(uint32(causeNone), uint32(CauseEndpointError))
	if first {
		fl.err.Store(errBox{err})
	}
	u.endFlow(fl, CauseEndpointError)
	return first
}

// endpointFailed handles an error of fl's endpoint socket, seen by the read
// loop (a send) or the reply loop (a receive). An ICMP error (port or host
// unreachable) counts against the endpoint for ejection, and the client's
// exchange moves to another endpoint with its last datagram re-sent: the
// client gets an answer instead of waiting out its timeout. Only the first
// of the two loops to see the failure acts on it.
func (u *udpServer) endpointFailed(fl *udpFlow, err error) {
	if !u.failFlow(fl, err) {
		return
	}
	reason := sock.DatagramFailure(err)
	udpEndpointErrors.WithLabelValues(u.m.service, fl.endpoint.String(), reason).Inc()
	if reason == "error" {
		return // not the endpoint's fault: no ejection, no failover
	}
	u.report(fl.endpoint, reason)
	next := &udpFlow{client: fl.client, local: fl.local, failovers: fl.failovers + 1}
	if last := fl.lastDatagram(); len(last) > 0 {
		u.newFlow(next, fl.endpoint, last)
	}
}

type errBox struct{ error }

// replies copies the endpoint's datagrams to the client until the flow has
// been idle for the UDP timeout or its socket is closed.
func (u *udpServer) replies(fl *udpFlow, backend *net.UDPConn) {
	defer close(fl.stopped)
	defer u.flows.wg.Done()
	defer u.bal.Done(fl.endpoint)
	defer func() {
		if !fl.transferable {
			fl.release() // its socket is closed by then: every way out of the loop but a detach closes it
		}
	}()
	timeout := u.dp.cfg.udpTimeout()
	// This goroutine's own, as they hold the datagram in flight.
	toClient, serr := sock.NewSender(u.sk.conn, u.sk.family)
	var fromBackend *sock.Receiver
	if serr == nil {
		fromBackend, serr = sock.NewReceiver(backend, false)
	}
	if serr != nil {
		u.failFlow(fl, fmt.Errorf("reply socket: %w", serr))
	}
	answered := false
	var run [][]byte
	reply := func(b *sock.Batch) {
		run = run[:0]
		for i := 0; i < b.Len(); i++ {
			run = append(run, b.Datagram(i))
		}
		u.reply(fl, toClient, run, &answered)
		clear(run) // hold no datagram of the batch given back
	}
	armed := false // the read deadline is set; it moves only when it fires
	for serr == nil {
		if !armed {
			if fl.detached.Load() {
				fl.transferable = true // for a successor: the socket stays open
				return
			}
			last := time.Unix(0, fl.lastSeen.Load())
			if time.Since(last) >= timeout {
				u.endFlow(fl, CauseIdleTimeout)
				break
			}
			// Set per datagram it cost a timer update each (lock and
			// heap): an expiry re-checks lastSeen instead.
			_ = backend.SetReadDeadline(last.Add(timeout))
			armed = true
			if fl.detached.Load() {
				armed = false // detachFlows' wake-up may have come before this deadline
				continue
			}
		}
		// A read error: an ICMP error the kernel reports, the deadline, a
		// close.
		if err := fromBackend.Next(reply); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				armed = false
				continue // re-check: the client may have sent meanwhile
			}
			if errors.Is(err, net.ErrClosed) {
				u.endFlow(fl, CauseShutdown)
			} else {
				u.endpointFailed(fl, err)
			}
			break
		}
	}
	// origDst stays out: the datagram arrived redirected, on fl.local, and
	// the address and port the client sent to are only in conntrack.
	l := endLine{protocol: config.UDP, client: fl.client, endpoint: fl.endpoint, reason: fl.reason,
		up: fl.up.Load(), down: fl.down.Load(), start: fl.start, cause: Cause(fl.cause.Load()), backendSees: seesName(fl.sees)}
	if e, ok := fl.err.Load().(errBox); ok {
		l.err = e.error
	}
	u.logEnd(l)
}

// reply sends the endpoint's datagrams to the flow's client, from the
// address the client's came to (one GSO send where they can).
func (u *udpServer) reply(fl *udpFlow, toClient *sock.Sender, datagrams [][]byte, answered *bool) {
	if !*answered {
		*answered = true
		u.report(fl.endpoint, "") // the endpoint is alive
	}
	fl.touch()
	sent, err := toClient.SendSegments(datagrams, fl.local, fl.client)
	n := payloadBytes(datagrams[:sent])
	fl.down.Add(n)
	u.m.get().bytesOut.Add(float64(n))
	if err != nil {
		u.debug(logrus.Fields{"client": fl.client}, err, "UDP reply to client failed")
	}
}

// payloadBytes is the bytes of datagrams together.
func payloadBytes(datagrams [][]byte) (n int64) {
	for _, d := range datagrams {
		n += int64(len(d))
	}
	return n
}

// open starts serving on sk: a new server, or one that refused meanwhile.
func (u *udpServer) open(sk *udpSocket) {
	quit := make(chan struct{})
	u.flows.mu.Lock()
	u.sk, u.flows.closed, u.quit = sk, false, quit
	u.flows.mu.Unlock()
	u.flows.budget.addUDP(u)
	u.served.Go(func() { u.serve(quit) })
}

// stopReading closes the frontend socket and waits for the read loop.
func (u *udpServer) stopReading() {
	u.flows.mu.Lock()
	quit := u.quit
	u.quit = nil
	u.flows.mu.Unlock()
	if quit != nil {
		close(quit)
	}
	u.sk.conn.Close()
	u.served.Wait()
}

// close stops the read loop and ends every flow (the frontend is going
// away, or refuses), waiting for them.
func (u *udpServer) close() {
	u.stopReading()
	u.flows.budget.removeUDP(u)
	u.flows.mu.Lock()
	u.flows.closed = true
	var all []*udpFlow
	for _, fl := range u.flows.flows {
		all = append(all, fl)
	}
	u.flows.mu.Unlock()
	for _, fl := range all {
		u.endFlow(fl, CauseShutdown)
	}
	u.flows.wg.Wait()
}
