package balance

import (
	"fmt"
	"net/netip"
	"testing"
	"time"
)

func newSched(t *testing.T, sched string, addrs ...string) *Balancer {
	t.Helper()
	b := New(sched)
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
	if b := New("wrr"); b.Scheduler() != SchedRoundRobin {
		t.Fatalf("scheduler %q for an unknown name", b.Scheduler())
	}
}

// A pick, on every new connection, allocates nothing, with outlier detection on.
func TestPickAllocatesNothing(t *testing.T) {
	for _, sched := range []string{SchedRoundRobin, SchedLeastConn, SchedSourceHash, SchedRandom} {
		b := New(sched)
		b.Update(eps("10.0.0.1:80", "10.0.0.2:80"), 0, DefaultOutlier, sched)
		if n := testing.AllocsPerRun(1000, func() { ep, _, _ := b.Pick(clientA, 0); b.Done(ep) }); n != 0 {
			t.Errorf("%s: %v allocations per pick", sched, n)
		}
	}
}
