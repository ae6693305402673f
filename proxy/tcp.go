package proxy

// One TCP connection's path, top to bottom:
//
//	serveTCP (accept loop)  →  handleTCP (one goroutine per connection)
//	  → dialBackend (balancer pick + dial with retry, sock.go)
//	  → spliceConns (two copy goroutines, splice(2) between the two sockets)
//	  → conn record closed and logged
//
// The accept loop never dials: a slow backend delays only its own client.

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
)

// DefaultDialTimeouts are the per-attempt dial timeouts of the classic
// userspace proxier: up to four endpoints are tried before the client is reset.
var DefaultDialTimeouts = []time.Duration{250 * time.Millisecond, 500 * time.Millisecond, time.Second, 2 * time.Second}

// serveTCP accepts connections until the listener is closed. Accept errors
// such as EMFILE back off (5 ms doubling to 1 s) instead of spinning or dying.
func (f *frontend) serveTCP(ln *tcpListener) {
	var backoff time.Duration
	handle := func(client *sock, from netip.AddrPort) {
		backoff = 0
		f.m.get().accepted.Inc()
		c := f.p.conns.add(f, from)
		f.p.workers.Go(func() { f.handleTCP(c, client) })
	}
	for {
		err := ln.serve(handle)
		if errors.Is(err, net.ErrClosed) {
			return
		}
		backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
		f.log.WithError(err).WithField("retryIn", backoff).Warn("Accept failed")
		select {
		case <-time.After(backoff):
		case <-f.ctx.Done():
			return
		}
	}
}

// handleTCP owns client: it dials a backend, splices the two and closes both.
// It runs the upstream copy itself; the downstream one runs on a copier.
// (With net.Dial, whose stack grew past 8 KiB and stayed so while the
// goroutine waited, both copies ran on copiers; the proxy's own dial stays
// shallow, and an idle connection measures the same ~12 KiB either way,
// with one goroutine hand-off fewer per connection.)
func (f *frontend) handleTCP(c *connRecord, client *sock) {
	c.OrigDst = originalDst(client, f.listen)

	backend, failed := f.dialBackend(c)
	if backend == nil {
		// A reset tells the client at once that nothing is there, instead of
		// an accepted connection that silently closes or hangs.
		_ = client.SetResetOnClose()
		client.Close()
		c.finish(f, 0, 0, failed)
		f.p.conns.remove(c)
		return
	}
	defer f.p.conns.remove(c)
	up, down, cause := f.spliceConns(c, client, backend)
	c.finish(f, up, down, cause)
}

// dialBackend tries up to len(DialTimeouts) endpoints, each with its own
// timeout; every retry asks the balancer again, bypassing affinity. Without
// a backend it says why.
func (f *frontend) dialBackend(c *connRecord) (*sock, Cause) {
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
		conn, err := dialTCP(f.ctx, ep, timeout)
		if err == nil {
			c.setDialLatency(time.Since(start))
			return conn, causeNone
		}
		dialFailures.WithLabelValues(f.m.service, ep.String()).Inc()
		f.log.WithFields(logrus.Fields{"client": c.Client, "endpoint": ep, "attempt": attempt + 1}).
			WithError(err).Debug("Dial failed")
		if f.ctx.Err() != nil {
			return nil, CauseShutdown
		}
		if isFileLimit(err) {
			// Out of descriptors: trying more endpoints only makes it worse.
			time.Sleep(10 * time.Millisecond)
		}
	}
	return nil, CauseDialFailed
}

// spliceConns copies both ways until both directions end, propagating
// half-closes, and closes both sockets. It returns the bytes sent to the
// backend (up) and to the client (down) and why the exchange ended.
func (f *frontend) spliceConns(c *connRecord, client, backend *sock) (up, down int64, cause Cause) {
	idle := f.p.cfg.TCPIdleTimeout
	c.setConns(client, backend)
	var first sync.Once // the direction that ends first names the cause
	var ended atomic.Int32
	lateReset := causeNone // set by a direction that saw its peer reset after the FIN
	// copyHalf copies one direction. A FIN is passed on as a half-close and
	// the other direction finishes on its own (request/response protocols
	// depend on it); anything else ends both directions, a reset passed on.
	copyHalf := func(dst, src *sock, eofCause, resetCause Cause, count func(int64)) int64 {
		n, err := copyUntilIdle(dst, src, client, backend, idle, count)
		last := ended.Add(1) == 2
		why := eofCause
		watch := false
		switch {
		case err == nil && !last:
			_ = dst.CloseWrite()
			watch = true
		case err == nil:
			// Both directions are done: the Close below sends the FIN,
			// a shutdown(2) first would only cost a system call.
		case errors.Is(err, os.ErrDeadlineExceeded):
			why = CauseIdleTimeout
		case errors.Is(err, net.ErrClosed):
			why = c.closeCause()
		default:
			why = resetCause
			_ = dst.SetResetOnClose()
		}
		first.Do(func() { cause = why })
		if watch && waitPeerReset(src) {
			// The peer that sent the FIN reset its socket since (a client
			// that left before the reply came back): no one will read the
			// other direction, so end the pair now, a reset passed on, or
			// it would wait for the other peer to close.
			_ = dst.SetResetOnClose()
			err = errPeerReset
			lateReset = resetCause
		}
		if err != nil || last {
			client.Close() // wakes a direction still watching for a reset
			backend.Close()
		}
		return n
	}
	// Two goroutines per connection, this one (the handler's) included: the
	// downstream copy runs beside, the upstream copy here.
	downDone := make(chan int64, 1)
	f.p.copiers.Go(func() { downDone <- copyHalf(client, backend, CauseBackendClosed, CauseBackendReset, c.addDown) })
	up = copyHalf(backend, client, CauseClientClosed, CauseClientReset, c.addUp)
	down = <-downDone
	client.Close()
	backend.Close()
	if lateReset != causeNone {
		cause = lateReset // the reset, not the FIN before it, ended the pair
	}
	return up, down, cause
}

// copyUntilIdle is spliceCopy(dst, src) — splice(2) through a pipe held only
// while data moves — with an idle timeout: the read deadline on src fires
// every idle period, and the copy goes on while the kernel's TCP_INFO says
// either peer sent data within the period. It returns nil at EOF. count gets
// the bytes of every burst, so live connections show in the metrics.
func copyUntilIdle(dst, src, client, backend *sock, idle time.Duration, count func(int64)) (int64, error) {
	var total int64
	for {
		if idle > 0 {
			_ = src.SetReadDeadline(time.Now().Add(idle))
		}
		n, err := spliceCopy(dst, src, count)
		total += n
		if err == nil || !errors.Is(err, os.ErrDeadlineExceeded) {
			return total, err
		}
		quiet := min(sinceLastRecv(client), sinceLastRecv(backend))
		if n > 0 || quiet < idle {
			continue
		}
		return total, err
	}
}

var errPeerReset = errors.New("peer reset after its FIN")

// waitPeerReset waits on c, whose peer has sent its FIN, until the peer
// resets it (true) or c is closed (false). After the FIN nothing but the
// reset makes c readable again; other wake-ups are checked and ignored.
func waitPeerReset(c *sock) bool {
	_ = c.SetReadDeadline(time.Time{}) // the other direction owns idleness now
	reset := false
	// The first call checks at once: a reset that came between the EOF
	// and this call woke no one.
	_ = c.read(func(fd uintptr) bool {
		// The socket is in CLOSE_WAIT until the reset moves it to CLOSE.
		state, err := tcpState(int(fd))
		reset = err == nil && state == tcpClose
		return reset
	})
	return reset
}

// sinceLastRecv reads how long ago the kernel last received data on c.
func sinceLastRecv(c *sock) time.Duration {
	var info *unix.TCPInfo
	_ = c.control(func(fd int) {
		info, _ = unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
	})
	if info == nil {
		return 0 // unknown: treat as active rather than cut a live connection
	}
	return time.Duration(info.Last_data_recv) * time.Millisecond
}

func isFileLimit(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE)
}
