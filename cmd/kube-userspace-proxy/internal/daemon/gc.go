package daemon

import (
	"context"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"
)

// The garbage collector's target follows the live heap. Go's default
// (GOGC=100) lets a heap grow by as much again as survived the last
// collection: a big live heap (thousands of Services: the informers'
// caches, the model, a listener and balancer per service port) is kept in
// check at 50, while a small one is collected twice as often at 50 for no
// memory worth saving, at a cost per connection. So: 100 while the live
// heap is small, 50 once it is big, with a band between so that a heap at
// the threshold does not flip the target (docs/benchmarks-history.md, The
// figures behind the code).
const (
	gcSmallPercent = 100
	gcBigPercent   = 50          // as Prometheus sets 75, for the same reason
	gcBigHeap      = 48 << 20    // live bytes from which the target is gcBigPercent
	gcSmallHeap    = 32 << 20    // live bytes under which it is gcSmallPercent again
	gcTunePeriod   = time.Second // a start reaches its steady heap in seconds; a read is cheap
	gcQuietFor     = 500 * time.Millisecond
)

// A collection of a big heap takes tens of milliseconds and slows what runs
// meanwhile. Left to the runtime it starts when an allocation crosses the
// goal, which is when the daemon works: with many Services a lone add often
// shares its sync and its rule write with one. So once the proxier has been quiet for a
// while and half of the heap's headroom is used, the tuner collects: the
// next collection is then half a cycle of allocation away, later than the
// next change in all but a churn (when changes merge anyway). It at most
// doubles how often a big heap is collected, and only while quiet; a heap
// the runtime collected within the last tune period (connections' garbage
// cycling it) is left to the runtime.

// gcHeap is the heap as the runtime reports it: live bytes as of the last
// collection, the bytes of objects now (live and not yet swept), the goal
// at which the next collection starts, and the collections so far.
type gcHeap struct{ live, objects, goal, cycles uint64 }

// collectNow reports whether a quiet daemon should collect its heap now:
// a big heap (the target for one) with half of its headroom used.
func collectNow(h gcHeap, percent int) bool {
	return percent == gcBigPercent && h.goal > h.live && h.objects >= h.live && h.objects-h.live >= (h.goal-h.live)/2
}

// gcTarget is the target for a live heap of live bytes, given the current one.
func gcTarget(live uint64, current int) int {
	switch {
	case live >= gcBigHeap:
		return gcBigPercent
	case live < gcSmallHeap:
		return gcSmallPercent
	}
	return current
}

// gcTuner sets the collector's target from the live heap; live and set are
// the runtime's (fields so that a test can stand in).
type gcTuner struct {
	live    func() uint64
	set     func(percent int)
	current int
	log     logrus.FieldLogger
	// quiet reports whether the proxier has done nothing for gcQuietFor
	// (nil until it exists); heap and collect are the runtime's.
	quiet   atomic.Pointer[func() bool]
	heap    func() gcHeap
	collect func()
	cycles  uint64 // collections as of the last tune
}

func (t *gcTuner) tune() {
	live := t.live()
	if next := gcTarget(live, t.current); next != t.current {
		t.set(next)
		t.log.WithFields(logrus.Fields{"GOGC": next, "liveHeapMiB": live >> 20}).Debug("Garbage collector target changed")
		t.current = next
	}
	h := t.heap()
	cycled := h.cycles != t.cycles
	t.cycles = h.cycles
	if quiet := t.quiet.Load(); quiet != nil && !cycled && collectNow(h, t.current) && (*quiet)() {
		start := time.Now()
		t.collect()
		t.cycles = t.heap().cycles
		t.log.WithFields(logrus.Fields{"took": time.Since(start).String(), "heapMiB": h.objects >> 20, "goalMiB": h.goal >> 20}).Debug("Collected while quiet")
	}
}

// whenQuiet lets the tuner collect while quiet() holds (Proxier.Quiet).
func (t *gcTuner) whenQuiet(quiet func() bool) { t.quiet.Store(&quiet) }

// readHeap reads the heap's figures from the runtime.
func readHeap() gcHeap {
	samples := []metrics.Sample{{Name: "/gc/heap/live:bytes"}, {Name: "/memory/classes/heap/objects:bytes"},
		{Name: "/gc/heap/goal:bytes"}, {Name: "/gc/cycles/total:gc-cycles"}}
	metrics.Read(samples)
	var v [4]uint64
	for i, s := range samples {
		if s.Value.Kind() == metrics.KindUint64 {
			v[i] = s.Value.Uint64()
		}
	}
	return gcHeap{live: v[0], objects: v[1], goal: v[2], cycles: v[3]}
}

// liveHeap reads the live heap as of the last collection.
func liveHeap() uint64 {
	sample := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	metrics.Read(sample)
	if sample[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return sample[0].Value.Uint64()
}

// tuneGC tunes the collector's target every period until ctx ends, unless
// GOGC is in the environment, which then wins (and nothing is collected
// while quiet either); the channel is closed when it is done.
func tuneGC(ctx context.Context, log logrus.FieldLogger, period time.Duration) (*gcTuner, <-chan struct{}) {
	done := make(chan struct{})
	t := &gcTuner{live: liveHeap, set: func(p int) { debug.SetGCPercent(p) }, current: gcSmallPercent, log: log,
		heap: readHeap, collect: runtime.GC}
	if v, set := os.LookupEnv("GOGC"); set {
		log.WithField("GOGC", v).Debug("Garbage collector target from the environment")
		close(done)
		return t, done
	}
	debug.SetGCPercent(gcSmallPercent)
	go func() {
		defer close(done)
		tick := time.NewTicker(period)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				t.tune()
			}
		}
	}()
	return t, done
}
