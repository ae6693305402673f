package daemon

import (
	"math"
	"runtime/metrics"

	"github.com/prometheus/client_golang/prometheus"
)

// runtimeTailCollector exports the Go runtime's two histograms that say
// whether the process, not the network, delayed a ready connection: how long
// a runnable goroutine waited for a thread (/sched/latencies:seconds) and how
// long the collector stopped the world (/sched/pauses/total/gc:seconds). The
// Prometheus client exports both too, but in buckets ten times apart, too
// coarse to say which share of a millisecond tail they explain; these
// buckets are powers of two from 1 µs to 131 ms.
type runtimeTailCollector struct {
	samples []metrics.Sample
	descs   []*prometheus.Desc
	bounds  []float64 // the buckets' upper bounds, seconds
}

func newRuntimeTailCollector() *runtimeTailCollector {
	c := &runtimeTailCollector{
		samples: []metrics.Sample{{Name: "/sched/latencies:seconds"}, {Name: "/sched/pauses/total/gc:seconds"}},
		descs: []*prometheus.Desc{
			prometheus.NewDesc("kube_userspace_proxy_go_sched_latency_seconds",
				"Time goroutines spent runnable before running (Go runtime/metrics /sched/latencies:seconds).", nil, nil),
			prometheus.NewDesc("kube_userspace_proxy_go_gc_pause_seconds",
				"Stop-the-world pauses of the garbage collector (Go runtime/metrics /sched/pauses/total/gc:seconds).", nil, nil),
		},
	}
	for b := 1e-6; b < 0.2; b *= 2 { // to 131 ms
		c.bounds = append(c.bounds, b)
	}
	return c
}

func (c *runtimeTailCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
}

func (c *runtimeTailCollector) Collect(ch chan<- prometheus.Metric) {
	metrics.Read(c.samples)
	for i, s := range c.samples {
		if s.Value.Kind() != metrics.KindFloat64Histogram {
			continue // a runtime without the metric
		}
		count, sum, buckets := c.rebucket(s.Value.Float64Histogram())
		ch <- prometheus.MustNewConstHistogram(c.descs[i], count, sum, buckets)
	}
}

// rebucket folds a runtime histogram into c.bounds: each runtime bucket
// counts under the first bound at or above its upper edge, so a bucket's
// count is never below the truth. The sum is estimated from each runtime
// bucket's middle (the runtime keeps no sum).
func (c *runtimeTailCollector) rebucket(h *metrics.Float64Histogram) (uint64, float64, map[float64]uint64) {
	cumulative := make(map[float64]uint64, len(c.bounds))
	perBound := make([]uint64, len(c.bounds))
	var count uint64
	var sum float64
	for i, n := range h.Counts {
		if n == 0 {
			continue
		}
		lo, hi := h.Buckets[i], h.Buckets[i+1]
		count += n
		switch {
		case math.IsInf(hi, 1):
			sum += float64(n) * lo
		case !math.IsInf(lo, -1):
			sum += float64(n) * (lo + hi) / 2
		}
		for j, b := range c.bounds {
			if hi <= b {
				perBound[j] += n
				break
			}
		}
	}
	var running uint64
	for j, b := range c.bounds {
		running += perBound[j]
		cumulative[b] = running
	}
	return count, sum, cumulative
}
