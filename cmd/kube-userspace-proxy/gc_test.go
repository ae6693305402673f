package main

import (
	"io"
	"runtime"
	"testing"

	"github.com/sirupsen/logrus"
)

// The target follows the live heap with a band between the thresholds: a
// heap that hovers at one threshold does not flip it back and forth.
func TestGCTargetFollowsTheLiveHeap(t *testing.T) {
	log := logrus.New()
	log.SetOutput(io.Discard)
	var live uint64
	var sets []int
	tu := &gcTuner{live: func() uint64 { return live }, set: func(p int) { sets = append(sets, p) }, current: gcSmallPercent, log: log}
	steps := []struct {
		live uint64
		want int
	}{
		{4 << 20, 100},         // a few Services
		{40 << 20, 100},        // in the band, from below: stays
		{65 << 20, 50},         // 10k Services
		{40 << 20, 50},         // in the band, from above: stays
		{gcBigHeap, 50},        // at the threshold
		{gcSmallHeap - 1, 100}, // shrunk
		{gcSmallHeap, 100},
	}
	for i, s := range steps {
		live = s.live
		tu.tune()
		if tu.current != s.want {
			t.Fatalf("step %d: live %d MiB: GOGC %d, want %d", i, s.live>>20, tu.current, s.want)
		}
	}
	if len(sets) != 2 || sets[0] != 50 || sets[1] != 100 {
		t.Fatalf("set %v, want [50 100]: only changes are set", sets)
	}
	runtime.GC()
	if liveHeap() == 0 {
		t.Fatal("the runtime reports no live heap")
	}
}
