package balance

import (
	"net/netip"
	"testing"
	"time"
)

func eps(ss ...string) []netip.AddrPort {
	var out []netip.AddrPort
	for _, s := range ss {
		out = append(out, netip.MustParseAddrPort(s))
	}
	return out
}

type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time          { return c.t }
func (c *fakeClock) advance(d time.Duration) { c.t = c.t.Add(d) }

func newTestRR() (*Balancer, *fakeClock) {
	clk := &fakeClock{t: time.Unix(1000, 0)}
	rr := New(SchedRoundRobin)
	rr.now = clk.now
	return rr, clk
}

var (
	clientA = netip.MustParseAddr("192.0.2.1")
	clientB = netip.MustParseAddr("192.0.2.2")
)

func TestRoundRobinNoEndpoints(t *testing.T) {
	rr, _ := newTestRR()
	if _, _, ok := rr.Pick(clientA, 0); ok {
		t.Fatal("Pick with no endpoints returned one")
	}
	rr.Update(eps("10.0.0.1:80"), 0, OutlierConfig{}, "")
	rr.Update(nil, 0, OutlierConfig{}, "")
	if _, _, ok := rr.Pick(clientA, 0); ok {
		t.Fatal("Pick after endpoints were removed returned one")
	}
}

func TestRoundRobinSpreadsEvenly(t *testing.T) {
	rr, _ := newTestRR()
	rr.Update(eps("10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"), 0, OutlierConfig{}, "")
	counts := map[netip.AddrPort]int{}
	var prev netip.AddrPort
	for i := 0; i < 300; i++ {
		ep, why, ok := rr.Pick(clientA, 0)
		if !ok || why != ReasonRoundRobin {
			t.Fatalf("pick %d: ok=%v why=%v", i, ok, why)
		}
		if ep == prev {
			t.Fatalf("pick %d: %s twice in a row", i, ep)
		}
		prev = ep
		counts[ep]++
	}
	for ep, n := range counts {
		if n != 100 {
			t.Errorf("%s got %d of 300 picks, want 100", ep, n)
		}
	}
}

func TestAffinityPinsAndExpires(t *testing.T) {
	rr, clk := newTestRR()
	rr.Update(eps("10.0.0.1:80", "10.0.0.2:80"), 10*time.Second, OutlierConfig{}, "")
	first, why, _ := rr.Pick(clientA, 0)
	if why != ReasonRoundRobin {
		t.Fatalf("first pick reason %s", why)
	}
	for i := 0; i < 5; i++ {
		clk.advance(9 * time.Second) // each use refreshes the pin
		ep, why, _ := rr.Pick(clientA, 0)
		if ep != first || why != ReasonAffinity {
			t.Fatalf("use %d: got %s (%s), want %s by affinity", i, ep, why, first)
		}
	}
	other, _, _ := rr.Pick(clientB, 0)
	if other == first {
		t.Fatalf("client B got the same endpoint %s; round-robin should move on", other)
	}
	clk.advance(10 * time.Second)
	if _, why, _ := rr.Pick(clientA, 0); why != ReasonRoundRobin {
		t.Fatalf("after the timeout the pin should be gone, got reason %s", why)
	}
}

// The classic proxier kept the TTL it saw first; here a changed timeout applies
// to existing pins, whatever came first.
func TestAffinityTimeoutChangeApplies(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(rr *Balancer)
	}{
		{"endpoints first, then affinity", func(rr *Balancer) {
			rr.Update(eps("10.0.0.1:80", "10.0.0.2:80"), 0, OutlierConfig{}, "")
			rr.Update(eps("10.0.0.1:80", "10.0.0.2:80"), time.Hour, OutlierConfig{}, "")
		}},
		{"affinity first, then endpoints", func(rr *Balancer) {
			rr.Update(nil, time.Hour, OutlierConfig{}, "")
			rr.Update(eps("10.0.0.1:80", "10.0.0.2:80"), time.Hour, OutlierConfig{}, "")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rr, clk := newTestRR()
			tc.setup(rr)
			pinned, _, _ := rr.Pick(clientA, 0)
			clk.advance(30 * time.Minute)
			if ep, why, _ := rr.Pick(clientA, 0); ep != pinned || why != ReasonAffinity {
				t.Fatalf("within 1h: got %s (%s), want %s", ep, why, pinned)
			}
			rr.Update(eps("10.0.0.1:80", "10.0.0.2:80"), 5*time.Second, OutlierConfig{}, "") // TTL lowered
			clk.advance(6 * time.Second)
			if _, why, _ := rr.Pick(clientA, 0); why == ReasonAffinity {
				t.Fatal("pin outlived the lowered timeout")
			}
			rr.Update(eps("10.0.0.1:80", "10.0.0.2:80"), time.Hour, OutlierConfig{}, "") // raised again
			pinned, _, _ = rr.Pick(clientA, 0)
			clk.advance(10 * time.Minute)
			if ep, why, _ := rr.Pick(clientA, 0); ep != pinned || why != ReasonAffinity {
				t.Fatalf("raised timeout not honoured: %s (%s)", ep, why)
			}
			rr.Update(eps("10.0.0.1:80", "10.0.0.2:80"), 0, OutlierConfig{}, "") // affinity off
			if got := rr.Affinities(); len(got) != 0 {
				t.Fatalf("affinity off but pins remain: %v", got)
			}
		})
	}
}

func TestAffinityDroppedForRemovedEndpoint(t *testing.T) {
	rr, _ := newTestRR()
	rr.Update(eps("10.0.0.1:80", "10.0.0.2:80"), time.Hour, OutlierConfig{}, "")
	pinned, _, _ := rr.Pick(clientA, 0)
	var remaining netip.AddrPort
	for _, ep := range eps("10.0.0.1:80", "10.0.0.2:80") {
		if ep != pinned {
			remaining = ep
		}
	}
	rr.Update([]netip.AddrPort{remaining}, time.Hour, OutlierConfig{}, "")
	if len(rr.Affinities()) != 0 {
		t.Fatalf("pin to removed endpoint %s kept: %v", pinned, rr.Affinities())
	}
	if ep, _, _ := rr.Pick(clientA, 0); ep != remaining {
		t.Fatalf("got %s, want %s", ep, remaining)
	}
	// An unrelated endpoint change keeps pins to endpoints that stay.
	rr.Update(eps(remaining.String(), "10.0.0.3:80"), time.Hour, OutlierConfig{}, "")
	if ep, why, _ := rr.Pick(clientA, 0); ep != remaining || why != ReasonAffinity {
		t.Fatalf("pin lost on unrelated change: %s (%s)", ep, why)
	}
}

func TestRetryBypassesAndRepinsAffinity(t *testing.T) {
	rr, _ := newTestRR()
	rr.Update(eps("10.0.0.1:80", "10.0.0.2:80"), time.Hour, OutlierConfig{}, "")
	first, _, _ := rr.Pick(clientA, 0)
	retry, why, _ := rr.Pick(clientA, 1)
	if retry == first || why != ReasonRetry {
		t.Fatalf("retry returned %s (%s); want the other endpoint", retry, why)
	}
	if ep, why, _ := rr.Pick(clientA, 0); ep != retry || why != ReasonAffinity {
		t.Fatalf("after a retry the client should be pinned to %s, got %s (%s)", retry, ep, why)
	}
}

func TestSweepDropsIdlePins(t *testing.T) {
	rr, clk := newTestRR()
	rr.Update(eps("10.0.0.1:80"), time.Second, OutlierConfig{}, "")
	for i := 0; i < 100; i++ {
		rr.Pick(netip.AddrFrom4([4]byte{192, 0, 2, byte(i)}), 0)
	}
	clk.advance(2 * time.Minute)
	rr.Pick(clientA, 0) // triggers the sweep
	rr.mu.Lock()
	n := len(rr.pins)
	rr.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d pins after sweep, want 1", n)
	}
}
