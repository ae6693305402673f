package proxy

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

func newSched(t *testing.T, sched string, addrs ...string) *EndpointBalancer {
	t.Helper()
	b := NewBalancer(sched)
	b.Update(eps(addrs...), 0, OutlierConfig{}, sched)
	return b
}

// lc sends a new connection to the endpoint with the fewest active ones.
func TestLeastConnections(t *testing.T) {
	b := newSched(t, SchedLeastConn, "10.0.0.1:80", "10.0.0.2:80")
	first, why, _ := b.Pick(clientA, 0)
	if why != ReasonLeastConn {
		t.Fatalf("reason %q", why)
	}
	second, _, _ := b.Pick(clientA, 0)
	if second == first {
		t.Fatalf("both picks went to %v while it held a connection", first)
	}
	// first ends its connection: it is now the less busy one.
	b.Done(first)
	for i := 0; i < 3; i++ {
		if ep, _, _ := b.Pick(clientB, 0); i == 0 && ep != first {
			t.Fatalf("picked %v, want the idle %v", ep, first)
		}
	}
	for _, h := range b.Health() {
		if h.Active != 2 {
			t.Fatalf("health %+v: want 2 active each", b.Health())
		}
	}
}

// sh keeps a client on its endpoint across balancers (a restart, another
// node) and when another endpoint goes; removing one of N moves only its
// clients, about 1/N of all.
func TestSourceHashIsConsistent(t *testing.T) {
	var all []string
	for i := 1; i <= 10; i++ {
		all = append(all, fmt.Sprintf("10.0.0.%d:80", i))
	}
	one, other := newSched(t, SchedSourceHash, all...), newSched(t, SchedSourceHash, all...)
	fewer := newSched(t, SchedSourceHash, all[1:]...) // 10.0.0.1 gone
	const clients = 20000
	moved, onGone := 0, 0
	perEndpoint := map[netip.AddrPort]int{}
	for i := 0; i < clients; i++ {
		c := netip.AddrFrom4([4]byte{100, byte(i >> 16), byte(i >> 8), byte(i)})
		a, why, _ := one.Pick(c, 0)
		if why != ReasonSourceHash {
			t.Fatalf("reason %q", why)
		}
		perEndpoint[a]++
		if b, _, _ := other.Pick(c, 0); b != a {
			t.Fatalf("client %v: %v on one balancer, %v on another", c, a, b)
		}
		gone := a == netip.MustParseAddrPort(all[0])
		if gone {
			onGone++
		}
		if f, _, _ := fewer.Pick(c, 0); f != a {
			moved++
			if !gone {
				t.Fatalf("client %v moved from %v to %v although its endpoint stayed", c, a, f)
			}
		}
	}
	if moved != onGone {
		t.Fatalf("%d clients moved, %d were on the removed endpoint", moved, onGone)
	}
	if frac := float64(moved) / clients; frac < 0.07 || frac > 0.13 {
		t.Fatalf("removing 1 of 10 endpoints moved %.3f of the clients, want about 0.1", frac)
	}
	for ep, n := range perEndpoint {
		if n < clients/10*7/10 || n > clients/10*13/10 {
			t.Fatalf("%v got %d of %d clients: uneven (%v)", ep, n, clients, perEndpoint)
		}
	}
}

func TestRandomSpreads(t *testing.T) {
	b := newSched(t, SchedRandom, "10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80")
	seen := map[netip.AddrPort]int{}
	for i := 0; i < 300; i++ {
		ep, why, _ := b.Pick(clientA, 0)
		if why != ReasonRandom {
			t.Fatalf("reason %q", why)
		}
		seen[ep]++
	}
	for ep, n := range seen {
		if n < 50 {
			t.Fatalf("%v picked %d of 300 times: %v", ep, n, seen)
		}
	}
	if len(seen) != 3 {
		t.Fatalf("picked only %v", seen)
	}
}

// Every scheduler skips drained and ejected endpoints; affinity pins to a
// drained endpoint move; with everything drained there is nothing to pick.
func TestSchedulersSkipDrainedAndEjected(t *testing.T) {
	for _, sched := range []string{SchedRoundRobin, SchedLeastConn, SchedSourceHash, SchedRandom} {
		t.Run(sched, func(t *testing.T) {
			b, _ := newTestRR()
			addrs := eps("10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80")
			b.Update(addrs, time.Hour, testOutlier, sched)
			if !b.SetDrained(addrs[0], true) || b.SetDrained(netip.MustParseAddrPort("10.9.9.9:80"), true) {
				t.Fatal("SetDrained: known endpoint refused or unknown accepted")
			}
			b.Report(addrs[1], true)
			b.Report(addrs[1], true) // ejected
			for i := 0; i < 20; i++ {
				c := netip.AddrFrom4([4]byte{192, 0, 2, byte(i)})
				if ep, _, _ := b.Pick(c, 0); ep != addrs[2] {
					t.Fatalf("client %v picked %v, want the one endpoint in rotation %v", c, ep, addrs[2])
				}
			}
			b.SetDrained(addrs[0], false)
			b.SetDrained(addrs[2], true)
			// clientA's pin (addrs[2]) is drained: it moves.
			if ep, _, _ := b.Pick(netip.AddrFrom4([4]byte{192, 0, 2, 0}), 0); ep != addrs[0] {
				t.Fatalf("pinned to a drained endpoint: picked %v, want %v", ep, addrs[0])
			}
			for _, a := range addrs {
				b.SetDrained(a, true)
			}
			if ep, _, ok := b.Pick(clientB, 0); ok {
				t.Fatalf("everything drained, yet picked %v", ep)
			}
		})
	}
}

func TestUnknownSchedulerIsRoundRobin(t *testing.T) {
	if KnownScheduler("wrr") || !KnownScheduler("") || !KnownScheduler("sh") {
		t.Fatal("KnownScheduler")
	}
	if b := NewBalancer("wrr"); b.Scheduler() != SchedRoundRobin {
		t.Fatalf("scheduler %q for an unknown name", b.Scheduler())
	}
}

// holdConn opens a connection through the proxy, reads the backend's name
// and keeps the connection open until the test ends (or close is called).
func holdConn(t *testing.T, addr string) (name string, c net.Conn) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(line), c
}

// lc with real held connections: new connections go to the less busy backend.
func TestLeastConnectionsHeld(t *testing.T) {
	h := startProxier(t, Config{})
	sp := svc("lc", config.TCP, tcpBackend(t, "a"), tcpBackend(t, "b"))
	sp.Scheduler = SchedLeastConn
	h.apply(sp)
	held := map[string][]net.Conn{}
	for i := 0; i < 4; i++ {
		name, c := holdConn(t, h.addr("lc"))
		held[name] = append(held[name], c)
	}
	if len(held["a"]) != 2 || len(held["b"]) != 2 {
		t.Fatalf("4 held connections spread %d/%d, want 2/2", len(held["a"]), len(held["b"]))
	}
	for _, c := range held["a"] {
		c.Close()
	}
	fe := h.frontend("lc")
	waitFor(t, "a's connections to end", func() bool {
		for _, hl := range h.p.EndpointHealth(fe) {
			if hl.Active != map[bool]int{true: 0, false: 2}[hl.Endpoint == sp.Endpoints[0].Addr] {
				return false
			}
		}
		return true
	})
	for i := 0; i < 2; i++ {
		if name, _ := holdConn(t, h.addr("lc")); name != "a" {
			t.Fatalf("new connection %d went to %q while a had 0-1 connections and b 2", i, name)
		}
	}
}

// A drained endpoint gets no new connection while its open one goes on;
// undoing the drain gives it connections again.
func TestDrainByHand(t *testing.T) {
	h := startProxier(t, Config{})
	a, b := tcpBackend(t, "a"), tcpBackend(t, "b")
	h.apply(svc("dr", config.TCP, a, b))
	var open net.Conn
	for open == nil {
		if name, c := holdConn(t, h.addr("dr")); name == "a" {
			open = c
		}
	}
	name := config.ServicePortName{Namespace: "ns", Name: "dr"}
	active, err := h.p.Drain(name, a, true)
	if err != nil || active != 1 {
		t.Fatalf("drain: %d active, %v; want 1", active, err)
	}
	for i := 0; i < 6; i++ {
		if got := fetchName(t, h.addr("dr")); got != "b" {
			t.Fatalf("connection %d reached %q while a is drained", i, got)
		}
	}
	fmt.Fprintf(open, "still here\n") // the open connection goes on
	r := bufio.NewReader(open)
	if line, err := r.ReadString('\n'); err != nil || line != "still here\n" {
		t.Fatalf("the drained endpoint's open connection: %q %v", line, err)
	}
	if _, err := h.p.Drain(name, netip.MustParseAddrPort("10.9.9.9:1"), true); !errors.Is(err, ErrUnknownEndpoint) {
		t.Fatalf("draining an unknown endpoint: %v", err)
	}
	if _, err := h.p.Drain(name, a, false); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for i := 0; i < 4; i++ {
		seen[fetchName(t, h.addr("dr"))] = true
	}
	if !seen["a"] {
		t.Fatal("after the drain was undone, a got no connection")
	}
}

// A pick, on every new connection, allocates nothing, with outlier detection on.
func TestPickAllocatesNothing(t *testing.T) {
	for _, sched := range []string{SchedRoundRobin, SchedLeastConn, SchedSourceHash, SchedRandom} {
		b := NewBalancer(sched)
		b.Update(eps("10.0.0.1:80", "10.0.0.2:80"), 0, DefaultOutlier, sched)
		if n := testing.AllocsPerRun(1000, func() { ep, _, _ := b.Pick(clientA, 0); b.Done(ep) }); n != 0 {
			t.Errorf("%s: %v allocations per pick", sched, n)
		}
	}
}

// Unknown annotation values are warned about once, when they appear, not at
// every sync.
func TestUnknownAnnotationsWarnedOnce(t *testing.T) {
	h := startProxier(t, Config{})
	sp := svc("odd", config.TCP, tcpBackend(t, "a"))
	sp.Scheduler, sp.ProxyProtocol, sp.OutlierDetection = "wrr", "v9", "maybe"
	h.apply(sp)
	again := svc("odd", config.TCP, tcpBackend(t, "b")) // endpoints change, annotations stay
	again.Scheduler, again.ProxyProtocol, again.OutlierDetection = "wrr", "v9", "maybe"
	h.apply(again)
	for _, msg := range []string{"Unknown scheduler (want rr, lc, sh or random); using rr",
		"Unknown PROXY protocol version (want v1 or v2); no header is sent",
		`Unknown value (want "on" or "off"); outlier detection stays on`} {
		if n := len(h.logs.Find(msg)); n != 1 {
			t.Errorf("%q logged %d times, want once", msg, n)
		}
	}
	if got := fetchName(t, h.addr("odd")); got != "b" {
		t.Fatalf("reached %q", got)
	}
}
