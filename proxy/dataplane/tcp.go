package dataplane

// One TCP connection's path, top to bottom:
//
//	serveTCP (the dataplane's acceptor) →  handleTCP (a worker goroutine;
//	    where the kernel has no conntrack match it first resets a connection
//	    from another host that no rule redirected: Config.GuardAtAccept)
//	  → dialBackend (balancer pick + sock.DialTCP, with retry)
//	  → splice (two halfCopy, one per direction, each a sock.Copy;
//	    half-closes passed on; tcpPair.end aborts both sockets; the idle
//	    sweep of conns.go ends a quiet pair). A direction with nothing to
//	    read for --park-idle-after gives up its goroutine: its socket waits
//	    in the dataplane's sock.Parker, which hands it back to a copier when
//	    it wakes.
//	  → the direction that finishes last closes both sockets and logs the
//	    record (tcpPair.finish; the record's end is connRecord.finish in conns.go)
//
// The acceptor never dials: a slow backend delays only its own client.
// Raw socket work is package sock's (internal/sock).

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/proxyproto"
)

// DefaultDialTimeouts are the per-attempt dial timeouts of the classic
// userspace proxier: up to four endpoints are tried before the client is reset.
var DefaultDialTimeouts = []time.Duration{250 * time.Millisecond, 500 * time.Millisecond, time.Second, 2 * time.Second}

// serveTCP has the dataplane's acceptor take the listener's connections: a
// listener has no goroutine of its own. Accept errors such as EMFILE back
// off (5 ms doubling to 1 s) instead of spinning.
func (fe *Frontend) serveTCP(ln *sock.Listener) error {
	acc, err := fe.dp.acceptor()
	if err != nil {
		return err
	}
	return ln.Serve(acc, fe.accepted, func(err error, retryIn time.Duration) {
		if sock.IsFileLimit(err) {
			fe.dp.budget.ranOut()
		}
		fe.log().WithError(err).WithField("retryIn", retryIn).Warn("Accept failed")
	})
}

// accepted takes one connection from the acceptor's goroutine; it hands the
// work to a worker and never blocks.
func (fe *Frontend) accepted(client *sock.Conn, from netip.AddrPort) {
	fe.m.get().accepted.Inc()
	if !fe.dp.budget.admitTCP() {
		// Over the descriptor budget: a reset now keeps the reserve for
		// accepts, rule syncs and the API watch.
		budgetRefusals.Inc()
		_ = client.SetResetOnClose()
		client.Close()
		return
	}
	c := fe.dp.conns.add(fe, from)
	fe.dp.workers.Go(func() { fe.handleTCP(c, client) })
}

// handleTCP dials a backend for the connection and starts the copies; the
// pair then belongs to them (splice). It runs the upstream copy itself, the
// downstream one runs on a copier.
func (fe *Frontend) handleTCP(c *connRecord, client *sock.Conn) {
	dst := client.OriginalDst(fe.listen)
	c.setOrigDst(dst)
	// A listener on a NodePort is meant to be reached directly; one of the
	// range only through a rule.
	if fe.dp.cfg.GuardAtAccept && !fe.onNodePort && client.ReachedDirectly(dst, c.Client.Addr()) {
		unredirectedResets.Inc()
		fe.logUnredirected(c.Client)
		_ = client.SetResetOnClose()
		client.Close()
		c.finish(fe, 0, 0, CauseNotRedirected)
		fe.dp.conns.remove(c)
		return
	}

	backend, failed := fe.dialBackend(c)
	if backend == nil {
		// A reset tells the client at once that nothing is there, instead of
		// an accepted connection that silently closes or hangs.
		_ = client.SetResetOnClose()
		client.Close()
		c.finish(fe, 0, 0, failed)
		fe.dp.conns.remove(c)
		return
	}
	fe.splice(c, c.setPair(client, backend))
}

// logUnredirected says what GuardAtAccept did to a peer (a TCP reset, a
// UDP flow dropped), within the rate limit of its protocol (the
// dataplane's unredirectedTCP, unredirectedUDP), and how many went unsaid
// before it.
func (fe *Frontend) logUnredirected(peer netip.AddrPort) {
	limit, what := fe.dp.unredirectedTCP, "Reset a connection from another host to a proxy port that no rule redirected (no conntrack match for the guard)"
	if fe.protocol == config.UDP {
		limit, what = fe.dp.unredirectedUDP, "Dropped a UDP flow from another host to a proxy port that no rule redirected (no conntrack match for the guard)"
	}
	ok, unsaid := limit.pass()
	if !ok {
		return
	}
	fe.log().WithFields(logrus.Fields{"peer": peer, "listener": fe.listen, "notSaidBefore": unsaid}).Warn(what)
}

// dialBackend tries up to len(DialTimeouts) endpoints, each with its own
// timeout; every retry asks the balancer again, bypassing affinity. Without
// a backend it says why.
func (fe *Frontend) dialBackend(c *connRecord) (*sock.Conn, Cause) {
	client := c.Client.Addr()
	dst := c.origDst()
	timeouts := fe.dp.cfg.dialTimeouts()
	for attempt, timeout := range timeouts {
		ep, why, ok := fe.bal.Pick(client, attempt)
		if !ok {
			fe.m.get().noEndpoints.Inc()
			return nil, CauseNoEndpoints
		}
		if attempt > 0 {
			fe.m.get().retries.Inc()
		}
		c.setBackend(ep, why, attempt)
		start := time.Now()
		dialAttempts.WithLabelValues(fe.m.service, ep.String()).Inc()
		src, wanted := fe.source(c.Client, dst, ep)
		if attempt > 0 {
			// An attempt that timed out may have left the endpoint
			// half-open on the client's port: its late SYN-ACK would meet
			// this attempt's conntrack entry and have it reset, and the
			// SYN after that would pass without the NAT. A retry keeps
			// the client's address from a port of its own.
			src.Port = 0
		}
		conn, dialed, err := sock.DialTCPFrom(fe.dp.ctx, ep, timeout, src)
		if err == nil {
			err = fe.sendProxyHeader(conn, c)
		}
		if err == nil {
			if fe.dp.cfg.parkIdleAfter() <= 0 {
				// No copy returns for idleness (halfCopy.run turns
				// probing on then): from the start.
				_ = conn.KeepAlive()
			}
			c.setDialed(time.Since(start), dialed.Sees)
			fe.countSource(c.Client, ep, dialed, wanted)
			fe.report(ep, "")
			return conn, causeNone
		}
		fe.bal.Done(ep) // the pick counted it active
		failure := sock.DialFailure(err)
		c.addDialFailure(ep, failure)
		dialFailures.WithLabelValues(fe.m.service, ep.String(), failure).Inc()
		fe.debug(logrus.Fields{"client": c.Client, "endpoint": ep, "attempt": attempt + 1, "failure": failure}, err, "Dial failed")
		if fe.dp.ctx.Err() != nil {
			return nil, CauseShutdown
		}
		if sock.IsFileLimit(err) {
			// Out of descriptors: not the endpoint's fault, and trying
			// more endpoints only makes it worse.
			fe.dp.budget.ranOut()
			time.Sleep(10 * time.Millisecond)
			continue
		}
		if sock.IsNoLocalPort(err) {
			// No port left towards ep: the node's limit, no ejection;
			// another endpoint has ports of its own.
			fe.dp.ranOutOfLocalPorts(fe.log(), ep)
			continue
		}
		fe.report(ep, failure)
	}
	return nil, CauseDialFailed
}

// sendProxyHeader sends the PROXY protocol header the Service asks for, if
// any, before any client byte: one send on the fresh connection, no round
// trip; a retry on another endpoint sends it again. On error conn is closed.
func (fe *Frontend) sendProxyHeader(conn *sock.Conn, c *connRecord) error {
	v, _ := fe.proxyProto.Load().(string)
	if v == "" {
		return nil
	}
	hdr := proxyproto.Header(v, c.Client, c.origDst())
	if hdr == nil {
		return nil // unknown version: warned about at open
	}
	if err := conn.WriteAll(hdr); err != nil {
		conn.Close()
		return fmt.Errorf("sending the PROXY protocol header: %w", err)
	}
	return nil
}

// report tells the balancer how a dial to ep (or a UDP flow's traffic) went:
// failure is empty for a success, else what went wrong. An ejection is
// logged and counted; so is an endpoint's return from one.
func (fe *Frontend) report(ep netip.AddrPort, failure string) {
	ejectedFor, recovered := fe.bal.Report(ep, failure != "")
	switch {
	case ejectedFor > 0:
		endpointEjections.WithLabelValues(fe.m.service, ep.String()).Inc()
		fe.log().WithFields(logrus.Fields{"endpoint": ep, "failure": failure, "ejectedFor": ejectedFor.String()}).
			Warn("Endpoint ejected after failures in a row; new connections go to the others")
	case recovered:
		fe.log().WithField("endpoint", ep).Info("Endpoint back in rotation")
	}
}

// tcpPair is the two sockets of a proxied connection and its two copies.
// The copies own it: the one that finishes last closes both sockets, once
// nothing waits on either, so that neither Close can wait on the other's
// I/O. Whatever decides that the connection is over (a copy's error, the
// idle sweep, shutdown) calls end, which aborts both sockets and never
// waits: a copy parked writing to a backend that stopped reading returns as
// promptly as one waiting in a read, and a socket parked in the Parker is
// handed back to a copier.
type tcpPair struct {
	client, backend *sock.Conn
	cause           atomic.Uint32 // a Cause: why the pair ended; the first one set wins
	ended           atomic.Int32  // copies whose sock.Copy returned for good
	finished        atomic.Int32  // copies done with the sockets
	up, down        halfCopy
	detach          detachState // a transfer to a successor (transfer.go)
}

// end records why the pair ends, unless a cause was set before, and wakes
// both copies wherever they wait.
func (pr *tcpPair) end(why Cause) {
	pr.setCause(why)
	pr.client.Abort()
	pr.backend.Abort()
}

// setCause records why unless a cause was set before.
func (pr *tcpPair) setCause(why Cause) {
	pr.cause.CompareAndSwap(uint32(causeNone), uint32(why))
}

func (pr *tcpPair) endCause() Cause { return Cause(pr.cause.Load()) }

// splice starts the copies both ways, passing half-closes on: the
// downstream one on a copier, the upstream one here. It returns when the
// upstream copy finished or parked; the last copy to finish closes the
// pair and logs it.
func (fe *Frontend) splice(c *connRecord, pr *tcpPair) {
	fe.halves(c, pr)
	fe.dp.copiers.Go(pr.down.run)
	pr.up.run()
}

// halves sets up the pair's two directions.
func (fe *Frontend) halves(c *connRecord, pr *tcpPair) {
	pr.up = halfCopy{f: fe, c: c, pr: pr, dst: pr.backend, src: pr.client,
		eofCause: CauseClientClosed, resetCause: CauseClientReset, count: c.addUp}
	pr.down = halfCopy{f: fe, c: c, pr: pr, dst: pr.client, src: pr.backend,
		eofCause: CauseBackendClosed, resetCause: CauseBackendReset, count: c.addDown}
}

// halfCopy is one direction of a pair. It runs on one goroutine at a time:
// the handler's or a copier, and between the two, parked, on none.
type halfCopy struct {
	f                    *Frontend
	c                    *connRecord
	pr                   *tcpPair
	dst, src             *sock.Conn
	eofCause, resetCause Cause
	count                func(int64)
	n                    int64 // bytes copied
	probing              bool  // keep-alive turned on for the backend (the downstream copy's source)
	// closed: its source's FIN was passed on, and it watches for that
	// peer's reset (watchPeerReset). Guarded by the pair's detach lock.
	closed bool
}

// run copies until the direction ends or its source is idle; then it parks
// the source, and the Parker calls resume when it wakes. A FIN is passed on
// as a half-close and the other direction finishes on its own
// (request/response protocols depend on it); anything else ends both
// directions, a reset passed on. The direction that ends first names the
// cause.
func (h *halfCopy) run() {
	idle := h.f.dp.cfg.parkIdleAfter()
	for {
		n, err := sock.Copy(h.dst, h.src, h.count, idle)
		h.n += n
		if errors.Is(err, sock.ErrDetached) {
			h.stopped() // nothing in flight: the pair may go to a successor
			return
		}
		if !errors.Is(err, sock.ErrIdle) {
			h.ended(err)
			return
		}
		if h.src == h.pr.backend && !h.probing {
			// The backend is quiet: from now on it is probed, as the
			// client is (a dial leaves keep-alive out: a short
			// connection would pay for it and never use it).
			h.probing = true
			_ = h.src.KeepAlive()
		}
		if perr := h.f.dp.parker.Load().Park(h.src, h.resume); perr == nil {
			return
		} else if !errors.Is(perr, sock.ErrNotParked) {
			h.f.log().WithError(perr).Debug("Parking an idle connection failed; its copy waits on it")
		}
		idle = 0 // no parking (a proxier without Run, or the parker failed): wait here
	}
}

// resume is the Parker's wake of a parked direction: it must not block.
func (h *halfCopy) resume() { h.f.dp.copiers.Go(h.run) }

// ended is the end of the direction's copy: err nil is the source's EOF.
func (h *halfCopy) ended(err error) {
	pr := h.pr
	last := h.endAndCancelDetach() // a pair with a direction ended stays here
	switch {
	case err == nil && !last:
		pr.setCause(h.eofCause)
		_ = h.dst.CloseWrite()
		h.watchPeerReset()
		return
	case err == nil:
		// Both directions are done: the last Close sends the FIN, a
		// shutdown(2) first would only cost a system call.
		pr.end(h.eofCause)
	case errors.Is(err, net.ErrClosed):
		// Aborted: whoever ended the pair set the cause.
	default:
		_ = h.dst.SetResetOnClose()
		pr.end(h.resetCause)
	}
	if pr.finished.Add(1) == 2 {
		pr.finish(h.f, h.c)
	}
}

// watchPeerReset is a direction after its source's FIN was passed on: it
// waits until that peer resets its socket (a client that left before the
// reply came back), when no one will read the other direction, so the pair
// ends now, a reset passed on, or it would wait for the other peer to
// close; the reset, not the FIN, ended the pair. Otherwise the pair was
// ended (by the other direction's end, the idle watch or shutdown), or a
// handover detached it (transfer.go): the watch goes on in the successor.
func (h *halfCopy) watchPeerReset() {
	pr := h.pr
	h.halfClosed()
	reset, err := h.src.WaitPeerReset()
	if errors.Is(err, sock.ErrDetached) {
		h.stopped()
		return
	}
	if reset {
		_ = h.dst.SetResetOnClose()
		pr.cause.Store(uint32(h.resetCause))
		pr.end(h.resetCause)
	}
	if pr.finished.Add(1) == 2 {
		pr.finish(h.f, h.c)
	}
}

// finish closes the pair's sockets, both copies having returned for good,
// and logs the connection.
func (pr *tcpPair) finish(f *Frontend, c *connRecord) {
	pr.client.Close()
	pr.backend.Close()
	f.bal.Done(c.endpoint())
	c.finish(f, pr.up.n, pr.down.n, pr.endCause())
	f.dp.conns.remove(c)
}
