package dataplane

import (
	"math/rand/v2"
	"testing"
)

// The index of UDP servers by flow count always names the fullest, through
// random opens, closes, servers leaving and coming back: eviction finds it
// without looking at every server.
func TestUDPIndexKnowsTheFullest(t *testing.T) {
	b := newDescriptorBudget(1 << 16)
	servers := make([]*fakeHolder, 50)
	flows := map[*fakeHolder]int{}
	open := map[*fakeHolder]bool{}
	for i := range servers {
		servers[i] = &fakeHolder{}
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
			for h := range b.byCount[most] {
				if s := h.(*fakeHolder); flows[s] != most || !open[s] {
					t.Fatalf("step %d: a server of %d flows listed among those of %d", step, flows[s], most)
				}
			}
		}
	}
}

// fakeHolder is a flow holder of the test's own: its flows, oldest first.
type fakeHolder struct{ flows []*fakeFlow }

func (h *fakeHolder) oldestFlow() evictable {
	if len(h.flows) == 0 {
		return nil
	}
	return h.flows[0]
}

type fakeFlow struct {
	h       *fakeHolder
	seen    int64
	evicted bool
	gone    bool // it ended meanwhile: evict fails, and it leaves its holder
}

func (f *fakeFlow) lastUsed() int64 { return f.seen }

func (f *fakeFlow) evict() bool {
	f.h.flows = f.h.flows[1:]
	f.evicted = !f.gone
	return !f.gone
}

// Past the UDP share the budget evicts the least recently used flow of the
// fullest holder; between equals, the older flow; a victim that ended
// meanwhile has it pick again; a share not exceeded evicts nothing.
func TestEvictionPicksTheFullestsOldest(t *testing.T) {
	for _, tc := range []struct {
		name   string
		counts []int     // flows per holder
		seen   [][]int64 // each holder's oldest flows, oldest first
		gone   int       // the holder whose oldest flow ended meanwhile; -1: none
		share  int
		victim [2]int // holder and flow evicted; -1: none
	}{
		{"the fullest", []int{3, 5, 2}, [][]int64{{1}, {9}, {1}}, -1, 9, [2]int{1, 0}},
		{"equals: the older", []int{4, 4}, [][]int64{{7}, {3}}, -1, 7, [2]int{1, 0}},
		{"the older ended: pick again", []int{4, 4}, [][]int64{{7}, {3, 8}}, 1, 7, [2]int{0, 0}},
		{"within the share", []int{1, 2}, [][]int64{{1}, {1}}, -1, 3, [2]int{-1, -1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newDescriptorBudget(1 << 16)
			b.udpCap = tc.share
			holders := make([]*fakeHolder, len(tc.counts))
			for i, n := range tc.counts {
				h := &fakeHolder{}
				for _, s := range tc.seen[i] {
					h.flows = append(h.flows, &fakeFlow{h: h, seen: s})
				}
				if i == tc.gone {
					h.flows[0].gone = true
				}
				holders[i] = h
				b.addUDP(h)
				for range n {
					b.flowOpened(h)
				}
			}
			all := [][]*fakeFlow{}
			for _, h := range holders {
				all = append(all, append([]*fakeFlow(nil), h.flows...))
			}
			b.evictForNew()
			for i, flows := range all {
				for j, f := range flows {
					if want := tc.victim == [2]int{i, j}; f.evicted != want {
						t.Errorf("holder %d flow %d (last used %d): evicted %v, want %v", i, j, f.seen, f.evicted, want)
					}
				}
			}
		})
	}
}
