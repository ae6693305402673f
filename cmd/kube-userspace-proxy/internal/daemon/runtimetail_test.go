package daemon

import (
	"math"
	"runtime/metrics"
	"testing"
)

func TestRuntimeTailRebucket(t *testing.T) {
	c := newRuntimeTailCollector()
	h := &metrics.Float64Histogram{
		Buckets: []float64{math.Inf(-1), 0, 1e-6, 3e-6, 5e-3, math.Inf(1)},
		Counts:  []uint64{0, 5, 2, 1, 1},
	}
	count, sum, cumulative := c.rebucket(h)
	if count != 9 {
		t.Errorf("count %d, want 9", count)
	}
	for bound, want := range map[float64]uint64{1e-6: 5, 2e-6: 5, 4e-6: 7, 4.096e-3: 7, 8.192e-3: 8, c.bounds[len(c.bounds)-1]: 8} {
		if got := cumulative[bound]; got != want {
			t.Errorf("≤ %g s: %d, want %d", bound, got, want)
		}
	}
	// 5 × 0.5 µs + 2 × 2 µs + 1 × 2.5 ms + 1 × 5 ms (the open bucket's lower edge).
	if want := 5*0.5e-6 + 2*2e-6 + 2.5015e-3 + 5e-3; math.Abs(sum-want) > 1e-12 {
		t.Errorf("sum %g, want %g", sum, want)
	}
	if last := c.bounds[len(c.bounds)-1]; last < 0.1 || c.bounds[0] != 1e-6 {
		t.Errorf("bounds run from %g to %g s, want 1 µs to over 100 ms", c.bounds[0], last)
	}
}
