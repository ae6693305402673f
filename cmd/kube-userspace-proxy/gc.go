package main

import (
	"context"
	"os"
	"runtime/debug"
	"runtime/metrics"
	"time"

	"github.com/sirupsen/logrus"
)

// The garbage collector's target follows the live heap. Go's default
// (GOGC=100) lets a heap grow by as much again as survived the last
// collection. At 10 000 Services the live heap is ~65 MB, mostly long-lived
// (the informers' caches, the model, a listener and balancer per service
// port), and 50 keeps the daemon under 150 MiB. A small heap, though, is
// collected twice as often at 50 for no memory worth saving: with a few
// Services every connection's garbage then cost 10 % more CPU per
// connection and 6-8 % fewer connections/s (make bench-floor, cps A/B runs).
// So: 100 while the live heap is small, 50 once it is big, with a band
// between so that a heap at the threshold does not flip the target.
const (
	gcSmallPercent = 100
	gcBigPercent   = 50          // as Prometheus sets 75, for the same reason
	gcBigHeap      = 48 << 20    // live bytes from which the target is gcBigPercent
	gcSmallHeap    = 32 << 20    // live bytes under which it is gcSmallPercent again
	gcTunePeriod   = time.Second // a 10k start reaches its steady heap in 2-3 s; a read costs µs
)

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
}

func (t *gcTuner) tune() {
	live := t.live()
	if next := gcTarget(live, t.current); next != t.current {
		t.set(next)
		t.log.WithFields(logrus.Fields{"GOGC": next, "liveHeapMiB": live >> 20}).Debug("Garbage collector target changed")
		t.current = next
	}
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
// GOGC is in the environment, which then wins; the channel is closed when
// it is done.
func tuneGC(ctx context.Context, log logrus.FieldLogger, period time.Duration) <-chan struct{} {
	done := make(chan struct{})
	if v, set := os.LookupEnv("GOGC"); set {
		log.WithField("GOGC", v).Debug("Garbage collector target from the environment")
		close(done)
		return done
	}
	t := &gcTuner{live: liveHeap, set: func(p int) { debug.SetGCPercent(p) }, current: gcSmallPercent, log: log}
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
	return done
}
