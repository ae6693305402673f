package proxy

import (
	"math/rand/v2"
	"testing"
)

// The index of UDP servers by flow count always names the fullest, through
// random opens, closes, servers leaving and coming back: eviction finds it
// without looking at every server.
func TestUDPIndexKnowsTheFullest(t *testing.T) {
	b := newDescriptorBudget(1 << 16)
	servers := make([]*udpServer, 50)
	flows := map[*udpServer]int{}
	open := map[*udpServer]bool{}
	for i := range servers {
		servers[i] = &udpServer{}
		b.addUDP(servers[i])
		open[servers[i]] = true
	}
	r := rand.New(rand.NewPCG(1, 2))
	for step := 0; step < 200000; step++ {
		u := servers[r.IntN(len(servers))]
		switch op := r.IntN(100); {
		case op < 55:
			b.flowOpened(u)
			if open[u] {
				flows[u]++
			}
		case op < 99:
			if flows[u] > 0 || !open[u] {
				b.flowClosed(u)
				if open[u] {
					flows[u]--
				}
			}
		case open[u]:
			b.removeUDP(u) // closing: its flows close later, out of the index
			open[u], flows[u] = false, 0
		default:
			b.addUDP(u)
			open[u] = true
		}
		most := 0
		for s, n := range flows {
			if open[s] {
				most = max(most, n)
			}
		}
		if b.most != most {
			t.Fatalf("step %d: index says the fullest holds %d, it holds %d", step, b.most, most)
		}
		if most > 0 {
			for s := range b.byCount[most] {
				if flows[s] != most || !open[s] {
					t.Fatalf("step %d: a server of %d flows listed among those of %d", step, flows[s], most)
				}
			}
		}
	}
}
