package proxy

// One TCP connection's path, top to bottom:
//
//	serveTCP (the proxier's acceptor)  →  handleTCP (one goroutine per connection, the
//	pair's owner)
//	  → dialBackend (balancer pick + sock.DialTCP, with retry)
//	  → splice (two sock.Copy, one per direction; half-closes passed on;
//	    tcpPair.end aborts both sockets; the idle sweep of conns.go ends a
//	    quiet pair)
//	  → both sockets closed in handleTCP, the record logged (conns.go)
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

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
)

// DefaultDialTimeouts are the per-attempt dial timeouts of the classic
// userspace proxier: up to four endpoints are tried before the client is reset.
var DefaultDialTimeouts = []time.Duration{250 * time.Millisecond, 500 * time.Millisecond, time.Second, 2 * time.Second}

// serveTCP has the proxier's acceptor take the listener's connections: a
// listener has no goroutine of its own. Accept errors such as EMFILE back
// off (5 ms doubling to 1 s) instead of spinning.
func (f *frontend) serveTCP(ln *sock.Listener) error {
	acc, err := f.p.acceptor()
	if err != nil {
		return err
	}
	return ln.Serve(acc, f.accepted, func(err error, retryIn time.Duration) {
		if sock.IsFileLimit(err) {
			f.p.budget.ranOut()
		}
		f.log().WithError(err).WithField("retryIn", retryIn).Warn("Accept failed")
	})
}

// accepted takes one connection from the acceptor's goroutine; it hands the
// work to a worker and never blocks.
func (f *frontend) accepted(client *sock.Conn, from netip.AddrPort) {
	f.m.get().accepted.Inc()
	if !f.p.budget.admitTCP() {
		// Over the descriptor budget: a reset now keeps the reserve for
		// accepts, rule syncs and the API watch.
		budgetRefusals.Inc()
		_ = client.SetResetOnClose()
		client.Close()
		return
	}
	c := f.p.conns.add(f, from)
	f.p.workers.Go(func() { f.handleTCP(c, client) })
}

// handleTCP owns the connection: it dials a backend, splices the two and is
// the one place that closes both sockets. It runs the upstream copy itself;
// the downstream one runs on a copier. (With net.Dial, whose stack grew past
// 8 KiB and stayed so while the goroutine waited, both copies ran on
// copiers; the proxy's own dial stays shallow, and an idle connection
// measures the same ~12 KiB either way, with one goroutine hand-off fewer
// per connection.)
func (f *frontend) handleTCP(c *connRecord, client *sock.Conn) {
	defer f.p.conns.remove(c)
	c.setOrigDst(client.OriginalDst(f.listen))

	backend, failed := f.dialBackend(c)
	if backend == nil {
		// A reset tells the client at once that nothing is there, instead of
		// an accepted connection that silently closes or hangs.
		_ = client.SetResetOnClose()
		client.Close()
		c.finish(f, 0, 0, failed)
		return
	}
	pr := c.setPair(client, backend)
	up, down := f.splice(c, pr)
	// Both copies have returned: nothing waits on either socket, so
	// neither Close can wait on the other's I/O.
	client.Close()
	backend.Close()
	f.bal.Done(c.endpoint())
	c.finish(f, up, down, pr.endCause())
}

// dialBackend tries up to len(DialTimeouts) endpoints, each with its own
// timeout; every retry asks the balancer again, bypassing affinity. Without
// a backend it says why.
func (f *frontend) dialBackend(c *connRecord) (*sock.Conn, Cause) {
	client := c.Client.Addr()
	timeouts := f.p.cfg.dialTimeouts()
	for attempt, timeout := range timeouts {
		ep, why, ok := f.bal.Pick(client, attempt)
		if !ok {
			f.m.get().noEndpoints.Inc()
			return nil, CauseNoEndpoints
		}
		if attempt > 0 {
			f.m.get().retries.Inc()
		}
		c.setBackend(ep, why, attempt)
		start := time.Now()
		dialAttempts.WithLabelValues(f.m.service, ep.String()).Inc()
		conn, err := sock.DialTCP(f.ctx, ep, timeout)
		if err == nil {
			err = f.sendProxyHeader(conn, c)
		}
		if err == nil {
			c.setDialLatency(time.Since(start))
			f.report(ep, "")
			return conn, causeNone
		}
		f.bal.Done(ep) // the pick counted it active
		failure := sock.DialFailure(err)
		c.addDialFailure(ep, failure)
		dialFailures.WithLabelValues(f.m.service, ep.String(), failure).Inc()
		f.debug(logrus.Fields{"client": c.Client, "endpoint": ep, "attempt": attempt + 1, "failure": failure}, err, "Dial failed")
		if f.ctx.Err() != nil {
			return nil, CauseShutdown
		}
		if sock.IsFileLimit(err) {
			// Out of descriptors: not the endpoint's fault, and trying
			// more endpoints only makes it worse.
			f.p.budget.ranOut()
			time.Sleep(10 * time.Millisecond)
			continue
		}
		f.report(ep, failure)
	}
	return nil, CauseDialFailed
}

// sendProxyHeader sends the PROXY protocol header the Service asks for, if
// any, before any client byte: one send on the fresh connection, no round
// trip; a retry on another endpoint sends it again. On error conn is closed.
func (f *frontend) sendProxyHeader(conn *sock.Conn, c *connRecord) error {
	v, _ := f.proxyProto.Load().(string)
	if v == "" {
		return nil
	}
	hdr := proxyHeader(v, c.Client, c.origDst())
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
func (f *frontend) report(ep netip.AddrPort, failure string) {
	ejectedFor, recovered := f.bal.Report(ep, failure != "")
	switch {
	case ejectedFor > 0:
		endpointEjections.WithLabelValues(f.m.service, ep.String()).Inc()
		f.log().WithFields(logrus.Fields{"endpoint": ep, "failure": failure, "ejectedFor": ejectedFor.String()}).
			Warn("Endpoint ejected after failures in a row; new connections go to the others")
	case recovered:
		f.log().WithField("endpoint", ep).Info("Endpoint back in rotation")
	}
}

// tcpPair is the two sockets of a proxied connection. Its handler goroutine
// owns it and alone closes the sockets, after both copies have returned.
// Whatever decides that the connection is over (a copy's error, the idle
// sweep, shutdown) calls end, which aborts both sockets and never waits: a
// copy parked writing to a backend that stopped reading returns as promptly
// as one parked in a read.
type tcpPair struct {
	client, backend *sock.Conn
	cause           atomic.Uint32 // a Cause: why the pair ended; the first one set wins
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

// splice copies both ways until both directions end, passing half-closes
// on. It returns the bytes sent to the backend (up) and to the client
// (down); the pair's cause says why it ended.
func (f *frontend) splice(c *connRecord, pr *tcpPair) (up, down int64) {
	var ended atomic.Int32
	// copyHalf copies one direction. A FIN is passed on as a half-close and
	// the other direction finishes on its own (request/response protocols
	// depend on it); anything else ends both directions, a reset passed on.
	// The direction that ends first names the cause.
	copyHalf := func(dst, src *sock.Conn, eofCause, resetCause Cause, count func(int64)) int64 {
		n, err := sock.Copy(dst, src, count)
		last := ended.Add(1) == 2
		switch {
		case err == nil && !last:
			pr.setCause(eofCause)
			_ = dst.CloseWrite()
			if src.WaitPeerReset() {
				// The peer that sent the FIN reset its socket since (a
				// client that left before the reply came back): no one
				// will read the other direction, so end the pair now, a
				// reset passed on, or it would wait for the other peer
				// to close. The reset, not the FIN, ended the pair.
				_ = dst.SetResetOnClose()
				pr.cause.Store(uint32(resetCause))
				pr.end(resetCause)
			}
			// Otherwise the pair was ended: by the other direction's end,
			// the idle watch or shutdown.
		case err == nil:
			// Both directions are done: the owner's Close sends the FIN,
			// a shutdown(2) first would only cost a system call.
			pr.end(eofCause)
		case errors.Is(err, net.ErrClosed):
			// Aborted: whoever ended the pair set the cause.
		default:
			_ = dst.SetResetOnClose()
			pr.end(resetCause)
		}
		return n
	}
	// Two goroutines per connection, this one (the handler's) included: the
	// downstream copy runs beside, the upstream copy here.
	downDone := make(chan int64, 1)
	f.p.copiers.Go(func() { downDone <- copyHalf(pr.client, pr.backend, CauseBackendClosed, CauseBackendReset, c.addDown) })
	up = copyHalf(pr.backend, pr.client, CauseClientClosed, CauseClientReset, c.addUp)
	down = <-downDone
	return up, down
}
