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
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
)

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
	sp.Scheduler = balance.SchedLeastConn
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
