package daemon

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
	tu := &gcTuner{live: func() uint64 { return live }, set: func(p int) { sets = append(sets, p) }, current: gcSmallPercent, log: log,
		heap: readHeap, collect: func() { t.Fatal("collected without a quiet proxier") }}
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

func TestCollectNowWhenHalfTheHeadroomIsUsed(t *testing.T) {
	const mib = 1 << 20
	for _, tc := range []struct {
		name    string
		h       gcHeap
		percent int
		want    bool
	}{
		{"a small heap's target", gcHeap{live: 10 * mib, objects: 14 * mib, goal: 15 * mib}, gcSmallPercent, false},
		{"a quarter used", gcHeap{live: 64 * mib, objects: 72 * mib, goal: 96 * mib}, gcBigPercent, false},
		{"half used", gcHeap{live: 64 * mib, objects: 80 * mib, goal: 96 * mib}, gcBigPercent, true},
		{"most used", gcHeap{live: 64 * mib, objects: 95 * mib, goal: 96 * mib}, gcBigPercent, true},
		{"just swept below the live figure", gcHeap{live: 64 * mib, objects: 60 * mib, goal: 96 * mib}, gcBigPercent, false},
		{"no headroom reported", gcHeap{live: 64 * mib, objects: 80 * mib, goal: 0}, gcBigPercent, false},
	} {
		if got := collectNow(tc.h, tc.percent); got != tc.want {
			t.Errorf("%s: collectNow(%+v, %d) = %v, want %v", tc.name, tc.h, tc.percent, got, tc.want)
		}
	}
}

// The tuner collects a big heap only while the proxier is quiet, and not
// after the runtime collected by itself within the last period.
func TestTunerCollectsOnlyWhenQuiet(t *testing.T) {
	log := logrus.New()
	log.SetOutput(io.Discard)
	const mib = 1 << 20
	heap := gcHeap{live: 64 * mib, objects: 90 * mib, goal: 96 * mib, cycles: 7}
	collected := 0
	tu := &gcTuner{live: func() uint64 { return heap.live }, set: func(int) {}, current: gcSmallPercent, log: log,
		heap: func() gcHeap { return heap }, collect: func() { collected++; heap.cycles++; heap.objects = heap.live }}
	tu.tune() // the target becomes the big heap's; no quiet function yet
	if collected != 0 {
		t.Fatal("collected before the proxier was there to say it is quiet")
	}
	quiet := false
	tu.whenQuiet(func() bool { return quiet })
	tu.tune()
	if collected != 0 {
		t.Fatal("collected while the proxier was busy")
	}
	quiet = true
	tu.tune()
	if collected != 1 {
		t.Fatalf("collected %d times while quiet with the headroom used, want 1", collected)
	}
	tu.tune()
	if collected != 1 {
		t.Fatal("collected again with the headroom free")
	}
	// The runtime collects by itself and the heap fills again within one
	// period: a heap cycling that fast is left to it.
	heap.cycles++
	heap.objects = 90 * mib
	tu.tune()
	if collected != 1 {
		t.Fatal("collected a heap the runtime had just collected")
	}
	tu.tune()
	if collected != 2 {
		t.Fatalf("collected %d times, want 2: a period without the runtime's own collection", collected)
	}
}
