package proxy

// One UDP flow's path:
//
//	serveUDP reads a datagram (with IP_PKTINFO: the address it arrived on)
//	  → flowFor finds or creates the client's flow (balancer pick, connected
//	    socket to the endpoint; the least recently used flow is evicted when
//	    the table is full)
//	  → the datagram is written to the endpoint
//	flow.replies copies the endpoint's datagrams back to the client, sent from
//	the address the client's datagram arrived on so that conntrack can undo
//	the REDIRECT, until the flow has been idle for the UDP timeout.

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

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
)

// maxDatagram is the largest UDP payload: nothing is ever truncated.
const maxDatagram = 64 * 1024

// DefaultUDPTimeout is how long a UDP flow lives without traffic. It matches
// the kernel's nf_conntrack_udp_timeout (30 s), so the REDIRECT's conntrack
// entry and the flow expire together, and it is far longer than any DNS
// client's retry interval (1–5 s): a slow answer still finds its flow. The
// classic proxier's 250 ms dropped late DNS answers (kubernetes #14939).
const DefaultUDPTimeout = 30 * time.Second

// DefaultUDPMaxFlows bounds the flow table per service port; each flow holds
// one socket, so a flood of client addresses cannot exhaust descriptors.
const DefaultUDPMaxFlows = 4096

// Socket buffer sizes. A client sends in bursts faster than one read loop
// drains at times; the kernel's default receive buffer (~208 KiB, about 270
// small datagrams) dropped datagrams at 50k/s in the benchmark
// (UdpRcvbufErrors), so the frontend socket asks for more. Per-flow sockets
// carry one client's replies and get less. A buffer is a limit, not memory
// taken up front.
const (
	udpListenerBuffer = 4 << 20
	udpFlowBuffer     = 1 << 20
)

// setUDPBuffers sets both buffers of c to size: SO_RCVBUFFORCE and
// SO_SNDBUFFORCE with CAP_NET_ADMIN (which the daemon has to program
// iptables), else the plain options, which the kernel caps at
// net.core.rmem_max / wmem_max.
func setUDPBuffers(c *net.UDPConn, size int) {
	raw, err := c.SyscallConn()
	if err != nil {
		return
	}
	_ = raw.Control(func(fd uintptr) {
		for _, o := range [][2]int{{unix.SO_RCVBUFFORCE, unix.SO_RCVBUF}, {unix.SO_SNDBUFFORCE, unix.SO_SNDBUF}} {
			if unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, o[0], size) != nil {
				_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, o[1], size)
			}
		}
	})
}

// udpSocket is a frontend socket that reports the local address each
// datagram arrived on.
type udpSocket struct {
	conn   *net.UDPConn
	family int
}

func newUDPSocket(c *net.UDPConn, family int) (*udpSocket, error) {
	setUDPBuffers(c, udpListenerBuffer)
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	level, opt := unix.IPPROTO_IP, unix.IP_PKTINFO
	if family == 6 {
		level, opt = unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO
	}
	var serr error
	if err := raw.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), level, opt, 1) }); err != nil {
		return nil, err
	}
	if serr != nil {
		return nil, os.NewSyscallError("setsockopt", serr)
	}
	return &udpSocket{conn: c, family: family}, nil
}

// udpFlow is one client ip:port talking to one endpoint.
type udpFlow struct {
	client   netip.AddrPort
	local    netip.Addr // where the client's datagrams arrived; replies leave from it
	endpoint netip.AddrPort
	reason   Reason
	backend  *net.UDPConn
	out      *dgramSender  // to backend; used by the frontend's read loop only
	elem     *list.Element // in udpFlows.lru
	start    time.Time
	lastSeen atomic.Int64  // unix nanos of the last datagram either way
	up, down atomic.Int64  // bytes
	cause    atomic.Uint32 // a Cause: why it ended; the first one set wins
	err      atomic.Value  // an errBox: the endpoint socket's error, with CauseEndpointError
}

func (fl *udpFlow) touch() { fl.lastSeen.Store(time.Now().UnixNano()) }

// udpFlows is a frontend's flow table.
type udpFlows struct {
	mu      sync.Mutex // guards flows and lru
	flows   map[netip.AddrPort]*udpFlow
	lru     list.List // front: most recently used
	evicted atomic.Uint64
	wg      sync.WaitGroup // one per flow reply goroutine
}

// serveUDP reads datagrams until the socket is closed.
func (f *frontend) serveUDP(s *udpSocket) {
	buf := make([]byte, maxDatagram)
	in, err := newDgramReceiver(s.conn, s.family, true)
	if err != nil {
		f.log.WithError(err).Error("UDP socket unusable; service port not served")
		return
	}
	var backoff time.Duration
	for {
		n, from, to, err := in.receive(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			f.log.WithError(err).Warn("UDP read failed")
			select {
			case <-time.After(backoff):
			case <-f.ctx.Done():
				return
			}
			continue
		}
		backoff = 0
		fl := f.flowFor(s, from, to)
		if fl == nil {
			continue // no endpoint: dropped (counted and logged in flowFor)
		}
		fl.touch()
		if err := fl.out.send(buf[:n], netip.Addr{}, netip.AddrPort{}); err != nil {
			f.log.WithFields(logrus.Fields{"client": from, "endpoint": fl.endpoint}).WithError(err).Debug("UDP send to endpoint failed")
			f.failFlow(fl, fmt.Errorf("send: %w", err))
			continue
		}
		fl.up.Add(int64(n))
		f.m.get().bytesIn.Add(float64(n))
	}
}

// flowFor returns the client's flow, creating it (and evicting the least
// recently used flow when the table is full) if needed. nil: no endpoint.
func (f *frontend) flowFor(s *udpSocket, client netip.AddrPort, local netip.Addr) *udpFlow {
	t := &f.udp
	t.mu.Lock()
	if fl, ok := t.flows[client]; ok {
		t.lru.MoveToFront(fl.elem)
		t.mu.Unlock()
		return fl
	}
	t.mu.Unlock()

	var backend *net.UDPConn
	var fl *udpFlow
	for attempt := 0; attempt < len(DefaultDialTimeouts); attempt++ {
		ep, why, ok := f.bal.Pick(client.Addr(), attempt)
		if !ok {
			f.m.get().noEndpoints.Inc()
			f.log.WithField("client", client).Debug("UDP datagram dropped: no endpoints")
			return nil
		}
		c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(ep))
		var out *dgramSender
		if err == nil {
			setUDPBuffers(c, udpFlowBuffer)
			if out, err = newDgramSender(c, config.Family(ep.Addr())); err != nil {
				c.Close()
			}
		}
		if err != nil {
			f.log.WithFields(logrus.Fields{"client": client, "endpoint": ep}).WithError(err).Warn("UDP socket to endpoint failed")
			if isFileLimit(err) {
				return nil
			}
			continue
		}
		backend = c
		fl = &udpFlow{client: client, local: local, endpoint: ep, reason: why, backend: c, out: out, start: time.Now()}
		break
	}
	if fl == nil {
		return nil
	}
	fl.touch()

	t.mu.Lock()
	if t.flows == nil {
		t.flows = make(map[netip.AddrPort]*udpFlow)
	}
	var victim *udpFlow
	if max := f.p.cfg.udpMaxFlows(); len(t.flows) >= max {
		victim = t.lru.Back().Value.(*udpFlow)
		if t.removeLocked(victim) {
			f.m.get().udpActive.Dec()
		}
		t.evicted.Add(1)
		f.m.get().evicted.Inc()
	}
	fl.elem = t.lru.PushFront(fl)
	t.flows[client] = fl
	f.m.get().udpActive.Inc()
	t.wg.Add(1)
	t.mu.Unlock()

	if victim != nil {
		victim.cause.CompareAndSwap(uint32(causeNone), uint32(CauseEvicted))
		victim.backend.Close() // its reply goroutine logs and exits
	}
	go f.replies(s, fl, backend)
	return fl
}

func (t *udpFlows) removeLocked(fl *udpFlow) bool {
	if cur, ok := t.flows[fl.client]; ok && cur == fl {
		delete(t.flows, fl.client)
		t.lru.Remove(fl.elem)
		return true
	}
	return false
}

// endFlow removes fl and closes its socket; its reply goroutine then exits.
func (f *frontend) endFlow(fl *udpFlow, cause Cause) {
	f.udp.mu.Lock()
	if f.udp.removeLocked(fl) {
		f.m.get().udpActive.Dec()
	}
	f.udp.mu.Unlock()
	fl.cause.CompareAndSwap(uint32(causeNone), uint32(cause))
	fl.backend.Close()
}

// failFlow ends fl because its endpoint socket failed with err.
func (f *frontend) failFlow(fl *udpFlow, err error) {
	if fl.cause.CompareAndSwap(uint32(causeNone), uint32(CauseEndpointError)) {
		fl.err.Store(errBox{err})
	}
	f.endFlow(fl, CauseEndpointError)
}

type errBox struct{ error }

// replies copies the endpoint's datagrams to the client until the flow has
// been idle for the UDP timeout or its socket is closed.
func (f *frontend) replies(s *udpSocket, fl *udpFlow, backend *net.UDPConn) {
	defer f.udp.wg.Done()
	timeout := f.p.cfg.udpTimeout()
	buf := make([]byte, maxDatagram)
	// This goroutine's own, as they hold the datagram in flight.
	toClient, serr := newDgramSender(s.conn, s.family)
	var fromBackend *dgramReceiver
	if serr == nil {
		fromBackend, serr = newDgramReceiver(backend, s.family, false)
	}
	if serr != nil {
		f.failFlow(fl, fmt.Errorf("reply socket: %w", serr))
	}
	for serr == nil {
		last := time.Unix(0, fl.lastSeen.Load())
		if time.Since(last) >= timeout {
			f.endFlow(fl, CauseIdleTimeout)
			break
		}
		_ = backend.SetReadDeadline(last.Add(timeout))
		n, _, _, err := fromBackend.receive(buf)
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				continue // re-check: the client may have sent meanwhile
			}
			if errors.Is(err, net.ErrClosed) {
				f.endFlow(fl, CauseShutdown)
			} else {
				f.failFlow(fl, err)
			}
			break
		}
		fl.touch()
		if err := toClient.send(buf[:n], fl.local, fl.client); err != nil {
			f.log.WithField("client", fl.client).WithError(err).Debug("UDP reply to client failed")
			continue
		}
		fl.down.Add(int64(n))
		f.m.get().bytesOut.Add(float64(n))
	}
	l := endLine{protocol: config.UDP, client: fl.client, origDst: fl.local.String(), endpoint: fl.endpoint, reason: fl.reason,
		up: fl.up.Load(), down: fl.down.Load(), start: fl.start, cause: Cause(fl.cause.Load())}
	if e, ok := fl.err.Load().(errBox); ok {
		l.err = e.error
	}
	f.logEnd(l)
}

// closeFlows ends every flow (the frontend is going away) and waits for them.
func (f *frontend) closeFlows() {
	f.udp.mu.Lock()
	var all []*udpFlow
	for _, fl := range f.udp.flows {
		all = append(all, fl)
	}
	f.udp.mu.Unlock()
	for _, fl := range all {
		f.endFlow(fl, CauseShutdown)
	}
	f.udp.wg.Wait()
}
