package main

import (
	"strconv"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

func parse(t *testing.T, text string) map[string]*dto.MetricFamily {
	t.Helper()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	f, err := parser.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func scrape(sched [4]int, schedSum float64, gcPause [4]int, gcSum float64, cycles, bytes, objects float64) string {
	var b strings.Builder
	hist := func(name string, c [4]int, sum float64) {
		b.WriteString("# TYPE " + name + " histogram\n")
		cum := 0
		for i, le := range []string{"1e-06", "1e-05", "0.001"} {
			cum += c[i]
			b.WriteString(name + `_bucket{le="` + le + `"} ` + itoa(cum) + "\n")
		}
		cum += c[3]
		b.WriteString(name + `_bucket{le="+Inf"} ` + itoa(cum) + "\n")
		b.WriteString(name + "_sum " + ftoa(sum) + "\n" + name + "_count " + itoa(cum) + "\n")
	}
	hist("kube_userspace_proxy_go_sched_latency_seconds", sched, schedSum)
	hist("kube_userspace_proxy_go_gc_pause_seconds", gcPause, gcSum)
	for name, v := range map[string]float64{"go_gc_cycles_total_gc_cycles_total": cycles,
		"go_gc_heap_allocs_bytes_total": bytes, "go_gc_heap_allocs_objects_total": objects} {
		b.WriteString("# TYPE " + name + " counter\n" + name + " " + ftoa(v) + "\n")
	}
	return b.String()
}

func itoa(i int) string     { return strconv.Itoa(i) }
func ftoa(f float64) string { return strconv.FormatFloat(f, 'g', -1, 64) }

func TestBetweenTwoScrapes(t *testing.T) {
	// Before: 10 wake-ups ≤ 1 µs. After: 990 more ≤ 1 µs, 18 ≤ 10 µs
	// and 2 ≤ 1 ms; one GC pause ≤ 10 µs and one ≤ 1 ms, 2 cycles.
	a := parse(t, scrape([4]int{10, 0, 0, 0}, 0.00001, [4]int{}, 0, 5, 1000, 10))
	b := parse(t, scrape([4]int{1000, 18, 2, 0}, 0.0021, [4]int{0, 1, 1, 0}, 0.0005, 7, 201000, 1010))
	got, err := between(a, b, 100)
	if err != nil {
		t.Fatal(err)
	}
	want := tail{SchedP99us: 10, SchedP999us: 1000, SchedMaxUs: 1000, Wakeups: 1010, GCCycles: 2,
		PauseTotalUs: 500, PauseMaxUs: 1000, AllocBytesOp: 2000, AllocObjectOp: 10}
	if !near(got, want) {
		t.Errorf("got %+v\nwant %+v", got, want)
	}
}

func near(a, b tail) bool {
	d := func(x, y float64) bool { return x-y < 1e-6 && y-x < 1e-6 }
	return d(a.SchedP99us, b.SchedP99us) && d(a.SchedP999us, b.SchedP999us) && d(a.SchedMaxUs, b.SchedMaxUs) &&
		d(a.Wakeups, b.Wakeups) && d(a.GCCycles, b.GCCycles) && d(a.PauseTotalUs, b.PauseTotalUs) &&
		d(a.PauseMaxUs, b.PauseMaxUs) && d(a.AllocBytesOp, b.AllocBytesOp) && d(a.AllocObjectOp, b.AllocObjectOp)
}
