package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
)

// udpExchange sends msg from c and returns the reply.
func udpExchange(t *testing.T, c *net.UDPConn, msg []byte) []byte {
	t.Helper()
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 70000)
	n, err := c.Read(buf)
	if err != nil {
		t.Fatalf("no reply to %d-byte datagram: %v", len(msg), err)
	}
	return buf[:n]
}

func dialUDP(t *testing.T, addr string) *net.UDPConn {
	t.Helper()
	ra, err := net.ResolveUDPAddr("udp4", addr)
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.DialUDP("udp4", nil, ra)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// frontend returns the IPv4 frontend of the service ns/name as of the last
// sync.
func (h *harness) frontend(name string) config.Frontend {
	h.t.Helper()
	fe, ok := h.p.Lookup(config.ServicePortName{Namespace: "ns", Name: name}, 4, config.KindAll)
	if !ok {
		h.t.Fatalf("no frontend for %s", name)
	}
	return fe
}

func TestUDPRoundRobinAndLargeDatagrams(t *testing.T) {
	h := startProxier(t, Config{})
	h.apply(svc("dns", config.UDP, udpBackend(t, "a"), udpBackend(t, "b")))
	seen := map[string]int{}
	for i := 0; i < 4; i++ {
		c := dialUDP(t, h.addr("dns")) // a new client port: a new flow
		reply := udpExchange(t, c, []byte("q"))
		name, _, _ := strings.Cut(string(reply), ":")
		seen[name]++
		// The same flow keeps its endpoint.
		if again := udpExchange(t, c, []byte("q2")); !strings.HasPrefix(string(again), name+":") {
			t.Fatalf("flow moved from %s: %q", name, again)
		}
	}
	if seen["a"] != 2 || seen["b"] != 2 {
		t.Fatalf("flows spread %v, want 2 each", seen)
	}
	big := bytes.Repeat([]byte("x"), 65000) // the classic 4 KiB buffer truncated these
	c := dialUDP(t, h.addr("dns"))
	reply := udpExchange(t, c, big)
	if _, payload, _ := bytes.Cut(reply, []byte(":")); !bytes.Equal(payload, big) {
		t.Fatalf("large datagram came back as %d bytes, want %d", len(payload), len(big))
	}
}

// A reply must leave from the address the datagram arrived on: here the
// listener is bound to 0.0.0.0 and the client talks to 127.0.0.2, and its
// connected socket drops anything from another address.
func TestUDPReplyFromArrivalAddress(t *testing.T) {
	h := startProxier(t, Config{BindAddress: netip4("0.0.0.0")})
	h.apply(svc("dns", config.UDP, udpBackend(t, "a")))
	c := dialUDP(t, fmt.Sprintf("127.0.0.2:%d", h.port("dns")))
	if reply := udpExchange(t, c, []byte("hi")); string(reply) != "a:hi" {
		t.Fatalf("reply %q", reply)
	}
}

func TestUDPFlowExpires(t *testing.T) {
	h := startProxier(t, Config{UDPTimeout: time.Second})
	h.apply(svc("dns", config.UDP, udpBackend(t, "a")))
	c := dialUDP(t, h.addr("dns"))
	udpExchange(t, c, []byte("q"))
	if n, _ := h.p.UDPFlows(h.frontend("dns")); n != 1 {
		t.Fatalf("%d flows after one exchange, want 1", n)
	}
	waitFor(t, "flow expiry", func() bool { n, _ := h.p.UDPFlows(h.frontend("dns")); return n == 0 })
	waitFor(t, "flow log line", func() bool { return len(h.logs.Find("UDP flow closed")) == 1 })
	f := h.logs.Find("UDP flow closed")[0]
	if f["cause"] != dataplane.CauseIdleTimeout.String() || f["bytesUp"] != int64(1) || f["bytesDown"] != int64(3) {
		t.Fatalf("flow line %v", f)
	}
	// A new datagram from the same client opens a new flow.
	if reply := udpExchange(t, c, []byte("again")); string(reply) != "a:again" {
		t.Fatalf("reply %q", reply)
	}
}

func TestUDPFlowTableBounded(t *testing.T) {
	h := startProxier(t, Config{UDPMaxFlows: 3})
	h.apply(svc("dns", config.UDP, udpBackend(t, "a")))
	var clients []*net.UDPConn
	for i := 0; i < 5; i++ {
		c := dialUDP(t, h.addr("dns"))
		udpExchange(t, c, []byte("q"))
		clients = append(clients, c)
	}
	active, evicted := h.p.UDPFlows(h.frontend("dns"))
	if active != 3 || evicted != 2 {
		t.Fatalf("active=%d evicted=%d, want 3 and 2", active, evicted)
	}
	// The newest clients kept their flows; an evicted one gets a new flow.
	if reply := udpExchange(t, clients[0], []byte("back")); string(reply) != "a:back" {
		t.Fatalf("reply %q", reply)
	}
	if _, evicted := h.p.UDPFlows(h.frontend("dns")); evicted != 3 {
		t.Fatalf("evicted=%d after a returning client, want 3", evicted)
	}
}

// A UDP service port without endpoints answers a datagram with an ICMP port
// unreachable, as kube-proxy's REJECT does: the client's read fails with
// ECONNREFUSED at once instead of waiting out its timeout. An endpoint that
// appears serves from the sync that brought it.
func TestUDPNoEndpointsRefuses(t *testing.T) {
	h := startProxier(t, Config{})
	h.apply(svc("dns", config.UDP))
	c := dialUDP(t, h.addr("dns"))
	expectUDPRefused(t, c)
	h.apply(svc("dns", config.UDP, udpBackend(t, "a")))
	if reply := udpExchange(t, c, []byte("q")); string(reply) != "a:q" {
		t.Fatalf("after an endpoint appeared: %q", reply)
	}
}

// expectUDPRefused sends a datagram on c and expects the read to fail with
// ECONNREFUSED (an ICMP port unreachable), within a bound.
func expectUDPRefused(t *testing.T, c *net.UDPConn) {
	t.Helper()
	if _, err := c.Write([]byte("q")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 10)); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("a datagram to %v: %v, want ECONNREFUSED", c.RemoteAddr(), err)
	}
}

func netip4(s string) netip.Addr { return netip.MustParseAddr(s) }

// IPv6: the datagram reaches the endpoint over a connected socket and the
// reply leaves from the address the client sent to (IPV6_PKTINFO).
func TestUDPIPv6(t *testing.T) {
	c6, err := net.ListenUDP("udp6", &net.UDPAddr{IP: net.IPv6loopback})
	if err != nil {
		t.Skipf("no IPv6 loopback here: %v", err)
	}
	backend := serveUDPEcho(t, c6, "v6")
	h := startProxier(t, Config{BindAddress: netip.IPv6Unspecified()})
	sp := svc("dns6", config.UDP, backend)
	sp.ClusterIPs = []netip.Addr{netip.MustParseAddr("fd00::10")}
	h.apply(sp)
	port := h.p.ListenPort(sp.Name, 6, config.KindAll)
	if port == 0 {
		t.Fatal("no IPv6 listener")
	}
	c, err := net.DialUDP("udp6", nil, &net.UDPAddr{IP: net.IPv6loopback, Port: port})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, msg := range []string{"q1", "q2", strings.Repeat("x", 9000)} {
		if reply := udpExchange(t, c, []byte(msg)); string(reply) != "v6:"+msg {
			t.Fatalf("reply %.20q…, want %.20q…", reply, "v6:"+msg)
		}
	}
}

// An empty datagram is a datagram: it is relayed, and so is its reply.
func TestUDPEmptyDatagram(t *testing.T) {
	h := startProxier(t, Config{})
	h.apply(svc("dns", config.UDP, udpBackend(t, "a")))
	c := dialUDP(t, h.addr("dns"))
	if reply := udpExchange(t, c, nil); string(reply) != "a:" {
		t.Fatalf("reply %q, want %q", reply, "a:")
	}
}

// The daemon's UDP flows together stay within their share of the descriptor
// budget: past it a new flow evicts the least recently used flow of the
// Service port holding the most, so that a flood on one Service (many
// source ports) leaves the other's flows in place, and two busy ones end
// with a fair share each.
func TestUDPFlowsShareOneBudget(t *testing.T) {
	h := startProxier(t, Config{FileLimit: 200}) // reserve 64, UDP share 68
	h.apply(svc("quiet", config.UDP, udpBackend(t, "a")), svc("flood", config.UDP, udpBackend(t, "b")))
	share := h.p.dp.Budget().UDPShare
	open := func(name string, n int) {
		for i := 0; i < n; i++ {
			c := dialUDP(t, h.addr(name))
			udpExchange(t, c, []byte("q"))
		}
	}
	open("quiet", 10)
	open("flood", 3*share)
	quiet, quietEvicted := h.p.UDPFlows(h.frontend("quiet"))
	flood, _ := h.p.UDPFlows(h.frontend("flood"))
	if quiet != 10 || quietEvicted != 0 || flood != share-10 {
		t.Fatalf("quiet %d (evicted %d), flood %d: want the flood to evict only its own flows", quiet, quietEvicted, flood)
	}
	// Both busy: each ends with about half.
	open("quiet", share)
	quiet, _ = h.p.UDPFlows(h.frontend("quiet"))
	flood, _ = h.p.UDPFlows(h.frontend("flood"))
	if quiet+flood != share || quiet-flood > 1 || flood-quiet > 1 {
		t.Fatalf("quiet %d, flood %d of a share of %d: want a fair share each", quiet, flood, share)
	}
	if got := h.p.dp.Budget().UDPFlows; got != int64(share) {
		t.Fatalf("budget counts %d flows, want %d", got, share)
	}
}

// A burst of one client's datagrams, written back to back, is drained in
// batches and sent on in GSO sends both ways: every datagram and every
// reply arrives whole and in order, and the flow counts their bytes. Two
// clients' bursts interleaved keep to their own flows.
func TestUDPBurstsArriveWholeAndInOrder(t *testing.T) {
	h := startProxier(t, Config{})
	h.apply(svc("burst", config.UDP, udpBackend(t, "a")))
	// 2 × 24 datagrams of 1 000 B (about 2.3 KiB each in a socket buffer)
	// fit the test backend's and clients' default receive buffers.
	const burst, size = 24, 1000
	clients := []*net.UDPConn{dialUDP(t, h.addr("burst")), dialUDP(t, h.addr("burst"))}
	payload := func(c, round, i int) []byte {
		b := bytes.Repeat([]byte{byte('A' + c)}, size)
		copy(b, fmt.Sprintf("%d/%d/%d/", c, round, i))
		return b
	}
	for round := 0; round < 3; round++ {
		for i := 0; i < burst; i++ {
			for c, conn := range clients {
				if _, err := conn.Write(payload(c, round, i)); err != nil {
					t.Fatal(err)
				}
			}
		}
		buf := make([]byte, 70000)
		for c, conn := range clients {
			_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			for i := 0; i < burst; i++ {
				n, err := conn.Read(buf)
				if err != nil {
					t.Fatalf("client %d round %d: reply %d of %d missing: %v", c, round, i, burst, err)
				}
				if want := append([]byte("a:"), payload(c, round, i)...); !bytes.Equal(buf[:n], want) {
					t.Fatalf("client %d round %d: reply %d is %q…, want %q…", c, round, i, buf[:min(n, 16)], want[:16])
				}
			}
		}
	}
	for _, conn := range clients {
		conn.Close()
	}
	h.apply() // the flows end with the service port
	waitFor(t, "both flows logged", func() bool { return len(h.logs.Find("UDP flow closed")) == 2 })
	for _, f := range h.logs.Find("UDP flow closed") {
		if up, down := f["bytesUp"].(int64), f["bytesDown"].(int64); up != 3*burst*size || down != 3*burst*(size+2) {
			t.Fatalf("flow counted %d bytes up and %d down, want %d and %d", up, down, 3*burst*size, 3*burst*(size+2))
		}
	}
}
