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
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"
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

// udpSocket wraps the frontend socket with control messages for one family.
type udpSocket struct {
	conn *net.UDPConn
	v4   *ipv4.PacketConn
	v6   *ipv6.PacketConn
}

func newUDPSocket(c *net.UDPConn, family int) (*udpSocket, error) {
	s := &udpSocket{conn: c}
	setUDPBuffers(c, udpListenerBuffer)
	if family == 4 {
		s.v4 = ipv4.NewPacketConn(c)
		return s, s.v4.SetControlMessage(ipv4.FlagDst, true)
	}
	s.v6 = ipv6.NewPacketConn(c)
	return s, s.v6.SetControlMessage(ipv6.FlagDst, true)
}

// read returns a datagram, its sender and the local address it was sent to.
func (s *udpSocket) read(buf []byte) (n int, from netip.AddrPort, to netip.Addr, err error) {
	var src net.Addr
	if s.v4 != nil {
		var cm *ipv4.ControlMessage
		n, cm, src, err = s.v4.ReadFrom(buf)
		if cm != nil {
			to, _ = netip.AddrFromSlice(cm.Dst.To4())
		}
	} else {
		var cm *ipv6.ControlMessage
		n, cm, src, err = s.v6.ReadFrom(buf)
		if cm != nil {
			to, _ = netip.AddrFromSlice(cm.Dst)
		}
	}
	if ua, ok := src.(*net.UDPAddr); ok {
		from = ua.AddrPort()
		from = netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
	}
	return n, from, to.Unmap(), err
}

// write sends b to the client from local address src.
func (s *udpSocket) write(b []byte, src netip.Addr, to netip.AddrPort) error {
	dst := net.UDPAddrFromAddrPort(to)
	var err error
	if s.v4 != nil {
		var cm *ipv4.ControlMessage
		if src.IsValid() {
			cm = &ipv4.ControlMessage{Src: src.AsSlice()}
		}
		_, err = s.v4.WriteTo(b, cm, dst)
	} else {
		var cm *ipv6.ControlMessage
		if src.IsValid() {
			cm = &ipv6.ControlMessage{Src: src.AsSlice()}
		}
		_, err = s.v6.WriteTo(b, cm, dst)
	}
	return err
}

// udpFlow is one client ip:port talking to one endpoint.
type udpFlow struct {
	client   netip.AddrPort
	local    netip.Addr // where the client's datagrams arrived; replies leave from it
	endpoint netip.AddrPort
	reason   Reason
	backend  *net.UDPConn
	elem     *list.Element // in udpFlows.lru
	start    time.Time
	lastSeen atomic.Int64 // unix nanos of the last datagram either way
	up, down atomic.Int64 // bytes
	cause    atomic.Value // string: why it ended
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
	var backoff time.Duration
	for {
		n, from, to, err := s.read(buf)
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
		if _, err := fl.backend.Write(buf[:n]); err != nil {
			f.log.WithFields(logrus.Fields{"client": from, "endpoint": fl.endpoint}).WithError(err).Debug("UDP send to endpoint failed")
			f.endFlow(fl, "send failed: "+err.Error())
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
		if err == nil {
			setUDPBuffers(c, udpFlowBuffer)
		}
		if err != nil {
			f.log.WithFields(logrus.Fields{"client": client, "endpoint": ep}).WithError(err).Warn("UDP socket to endpoint failed")
			if isFileLimit(err) {
				return nil
			}
			continue
		}
		backend = c
		fl = &udpFlow{client: client, local: local, endpoint: ep, reason: why, backend: c, start: time.Now()}
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
		victim.cause.Store("evicted")
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
func (f *frontend) endFlow(fl *udpFlow, cause string) {
	f.udp.mu.Lock()
	if f.udp.removeLocked(fl) {
		f.m.get().udpActive.Dec()
	}
	f.udp.mu.Unlock()
	fl.cause.CompareAndSwap(nil, cause)
	fl.backend.Close()
}

// replies copies the endpoint's datagrams to the client until the flow has
// been idle for the UDP timeout or its socket is closed.
func (f *frontend) replies(s *udpSocket, fl *udpFlow, backend *net.UDPConn) {
	defer f.udp.wg.Done()
	timeout := f.p.cfg.udpTimeout()
	buf := make([]byte, maxDatagram)
	for {
		last := time.Unix(0, fl.lastSeen.Load())
		if time.Since(last) >= timeout {
			f.endFlow(fl, CauseIdleTimeout)
			break
		}
		_ = backend.SetReadDeadline(last.Add(timeout))
		n, err := backend.Read(buf)
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				continue // re-check: the client may have sent meanwhile
			}
			cause := "endpoint error: " + err.Error()
			if errors.Is(err, net.ErrClosed) {
				cause = CauseShutdown
			}
			f.endFlow(fl, cause)
			break
		}
		fl.touch()
		if err := s.write(buf[:n], fl.local, fl.client); err != nil {
			f.log.WithField("client", fl.client).WithError(err).Debug("UDP reply to client failed")
			continue
		}
		fl.down.Add(int64(n))
		f.m.get().bytesOut.Add(float64(n))
	}
	cause, _ := fl.cause.Load().(string)
	if !f.p.cfg.logConn(cause) {
		return
	}
	f.p.cfg.connLog().WithFields(logrus.Fields{
		"service":   f.key.Name.String(),
		"client":    fl.client.String(),
		"origDst":   fl.local.String(),
		"protocol":  "UDP",
		"endpoint":  fl.endpoint.String(),
		"reason":    string(fl.reason),
		"bytesUp":   fl.up.Load(),
		"bytesDown": fl.down.Load(),
		"duration":  time.Since(fl.start).Round(time.Microsecond).String(),
		"cause":     cause,
	}).Info("UDP flow closed")
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
