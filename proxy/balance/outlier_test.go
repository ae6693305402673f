package balance

import (
	"net/netip"
	"testing"
	"time"
)

var testOutlier = OutlierConfig{ConsecutiveFailures: 2, BaseEjectionTime: 10 * time.Second, MaxEjectionTime: 25 * time.Second}

// picks returns how often each endpoint is picked in n fresh picks.
func picks(rr *Balancer, n int) map[netip.AddrPort]int {
	out := map[netip.AddrPort]int{}
	for i := 0; i < n; i++ {
		ep, _, _ := rr.Pick(clientA, 0)
		out[ep]++
	}
	return out
}

func TestOutlierEjectsAfterFailuresInARow(t *testing.T) {
	rr, clk := newTestRR()
	a, b := netip.MustParseAddrPort("10.0.0.1:80"), netip.MustParseAddrPort("10.0.0.2:80")
	rr.Update([]netip.AddrPort{a, b}, 0, testOutlier, "")
	if d, _ := rr.Report(b, true); d != 0 {
		t.Fatalf("ejected after one failure (for %v), want two in a row", d)
	}
	rr.Report(b, false) // a success in between resets the count
	rr.Report(b, true)
	if got := picks(rr, 4); got[b] != 2 {
		t.Fatalf("one failure after a success: picks %v, want b still in rotation", got)
	}
	d, _ := rr.Report(b, true)
	if d != 10*time.Second {
		t.Fatalf("second failure in a row: ejected for %v, want the base 10s", d)
	}
	if got := picks(rr, 6); got[b] != 0 || got[a] != 6 {
		t.Fatalf("while ejected: picks %v, want every one on a", got)
	}
	h := rr.Health()
	if len(h) != 2 || h[1].Endpoint != b || h[1].EjectedUntil == nil || !h[1].EjectedUntil.Equal(clk.t.Add(10*time.Second)) {
		t.Fatalf("health %+v, want b ejected until +10s", h)
	}
	// Failures of connections picked before the ejection do not extend it.
	if d, _ := rr.Report(b, true); d != 0 {
		t.Fatalf("a late failure re-ejected b for %v", d)
	}
	// Time up: b is back and its next connection is the probe; a failed
	// probe ejects it at once, for twice the base; then the max caps it.
	clk.advance(10 * time.Second)
	if got := picks(rr, 4); got[b] != 2 {
		t.Fatalf("after the ejection: picks %v, want b back in rotation", got)
	}
	if d, _ := rr.Report(b, true); d != 20*time.Second {
		t.Fatalf("failed probe: ejected for %v, want 20s", d)
	}
	clk.advance(20 * time.Second)
	if d, _ := rr.Report(b, true); d != 25*time.Second {
		t.Fatalf("third ejection: %v, want the max 25s", d)
	}
	clk.advance(25 * time.Second)
	// A successful probe returns it for good and resets the multiplier.
	if _, recovered := rr.Report(b, false); !recovered {
		t.Fatal("a success after an ejection did not report the recovery")
	}
	rr.Report(b, true)
	if d, _ := rr.Report(b, true); d != 10*time.Second {
		t.Fatalf("after a recovery: ejected for %v, want the base again", d)
	}
}

// Never eject all: with every endpoint ejected, picks go on as if none were.
func TestOutlierAllEjectedPicksAnyway(t *testing.T) {
	rr, _ := newTestRR()
	all := eps("10.0.0.1:80", "10.0.0.2:80")
	rr.Update(all, 0, testOutlier, "")
	for _, ep := range all {
		rr.Report(ep, true)
		rr.Report(ep, true)
	}
	seen := map[netip.AddrPort]bool{}
	for i := 0; i < 4; i++ {
		ep, why, ok := rr.Pick(clientA, 0)
		if !ok || why != ReasonAllEjected {
			t.Fatalf("pick %d: %v %q %v, want an endpoint, reason %q", i, ep, why, ok, ReasonAllEjected)
		}
		seen[ep] = true
	}
	if len(seen) != 2 {
		t.Fatalf("all ejected: picks went to %v only, want round-robin over both", seen)
	}
}

// An affinity pin to an ejected endpoint moves; readiness stays authoritative
// (an endpoint removed and added back starts healthy, others keep their
// health across updates).
func TestOutlierMovesPinsAndKeepsHealthAcrossUpdates(t *testing.T) {
	rr, _ := newTestRR()
	a, b, c := netip.MustParseAddrPort("10.0.0.1:80"), netip.MustParseAddrPort("10.0.0.2:80"), netip.MustParseAddrPort("10.0.0.3:80")
	rr.Update([]netip.AddrPort{a, b}, time.Hour, testOutlier, "")
	pinned, _, _ := rr.Pick(clientA, 0)
	rr.Report(pinned, true)
	rr.Report(pinned, true)
	ep, why, _ := rr.Pick(clientA, 0)
	if ep == pinned || why != ReasonRoundRobin {
		t.Fatalf("pinned to ejected %v: picked %v (%s), want the other endpoint, freshly picked", pinned, ep, why)
	}
	if again, why, _ := rr.Pick(clientA, 0); again != ep || why != ReasonAffinity {
		t.Fatalf("re-pinned to %v, then picked %v (%s)", ep, again, why)
	}
	// An endpoint added keeps the others' health.
	rr.Update([]netip.AddrPort{a, b, c}, time.Hour, testOutlier, "")
	for _, h := range rr.Health() {
		if (h.Endpoint == pinned) != (h.EjectedUntil != nil) {
			t.Fatalf("after adding %v: health %+v, want only %v ejected", c, rr.Health(), pinned)
		}
	}
	// Removed and back: a new endpoint as far as health goes.
	rr.Update([]netip.AddrPort{ep, c}, time.Hour, testOutlier, "")
	rr.Update([]netip.AddrPort{a, b, c}, time.Hour, testOutlier, "")
	for _, h := range rr.Health() {
		if h.EjectedUntil != nil {
			t.Fatalf("health %+v: the removed endpoint came back ejected", rr.Health())
		}
	}
}

func TestOutlierOff(t *testing.T) {
	rr, _ := newTestRR()
	all := eps("10.0.0.1:80", "10.0.0.2:80")
	rr.Update(all, 0, OutlierConfig{}, "")
	for i := 0; i < 10; i++ {
		if d, _ := rr.Report(all[0], true); d != 0 {
			t.Fatal("ejected with detection off")
		}
	}
	if got := picks(rr, 4); got[all[0]] != 2 {
		t.Fatalf("picks %v, want round-robin", got)
	}
	// Turned on later: counting starts then.
	rr.Update(all, 0, testOutlier, "")
	rr.Report(all[0], true)
	if d, _ := rr.Report(all[0], true); d == 0 {
		t.Fatal("not ejected after detection was turned on")
	}
}
