// Command runtimetail reads two scrapes of the daemon's /metrics, taken before
// and after a benchmark run, and prints what the Go runtime did in between as
// one line of JSON: how long runnable goroutines waited for a thread (the
// p99, p99.9 and the highest bucket of
// kube_userspace_proxy_go_sched_latency_seconds, buckets a power of two
// apart), how long the collector stopped the world
// (kube_userspace_proxy_go_gc_pause_seconds: total and the highest bucket),
// how many collections ran, and the bytes and objects allocated per
// operation when -ops says how many the run did.
//
//	runtimetail -before a.prom -after b.prom -ops 10000
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

type tail struct {
	SchedP99us    float64 `json:"schedP99us"`
	SchedP999us   float64 `json:"schedP999us"`
	SchedMaxUs    float64 `json:"schedMaxUs"`
	Wakeups       float64 `json:"wakeups"`
	GCCycles      float64 `json:"gcCycles"`
	PauseTotalUs  float64 `json:"pauseTotalUs"`
	PauseMaxUs    float64 `json:"pauseMaxUs"`
	AllocBytesOp  float64 `json:"allocBytesPerOp"`
	AllocObjectOp float64 `json:"allocObjectsPerOp"`
}

func main() {
	before := flag.String("before", "", "scrape of /metrics before the run")
	after := flag.String("after", "", "scrape of /metrics after the run")
	ops := flag.Float64("ops", 0, "operations the run did (for the allocations per operation)")
	flag.Parse()
	a, err := read(*before)
	if err != nil {
		fail(err)
	}
	b, err := read(*after)
	if err != nil {
		fail(err)
	}
	t, err := between(a, b, *ops)
	if err != nil {
		fail(err)
	}
	out, _ := json.Marshal(t)
	fmt.Println(string(out))
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "runtimetail:", err)
	os.Exit(1)
}

func read(path string) (map[string]*dto.MetricFamily, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(f)
	if err != nil {
		return nil, fmt.Errorf("parsing %s: %w", path, err)
	}
	return families, nil
}

// between is what happened from scrape a to scrape b.
func between(a, b map[string]*dto.MetricFamily, ops float64) (tail, error) {
	var t tail
	sched, err := histogramDelta(a, b, "kube_userspace_proxy_go_sched_latency_seconds")
	if err != nil {
		return t, err
	}
	t.Wakeups = sched.count()
	t.SchedP99us = sched.quantile(0.99) * 1e6
	t.SchedP999us = sched.quantile(0.999) * 1e6
	t.SchedMaxUs = sched.quantile(1) * 1e6
	pauses, err := histogramDelta(a, b, "kube_userspace_proxy_go_gc_pause_seconds")
	if err != nil {
		return t, err
	}
	t.PauseTotalUs = pauses.sum() * 1e6
	t.PauseMaxUs = pauses.quantile(1) * 1e6
	cycles, err := counterDelta(a, b, "go_gc_cycles_total_gc_cycles_total")
	if err != nil {
		return t, err
	}
	t.GCCycles = cycles
	if ops > 0 {
		bytes, err := counterDelta(a, b, "go_gc_heap_allocs_bytes_total")
		if err != nil {
			return t, err
		}
		objects, err := counterDelta(a, b, "go_gc_heap_allocs_objects_total")
		if err != nil {
			return t, err
		}
		t.AllocBytesOp, t.AllocObjectOp = bytes/ops, objects/ops
	}
	return t, nil
}

func single(families map[string]*dto.MetricFamily, name string) (*dto.Metric, error) {
	f, ok := families[name]
	if !ok || len(f.GetMetric()) != 1 {
		return nil, fmt.Errorf("the scrape has no single series %s", name)
	}
	return f.GetMetric()[0], nil
}

func counterDelta(a, b map[string]*dto.MetricFamily, name string) (float64, error) {
	ma, err := single(a, name)
	if err != nil {
		return 0, err
	}
	mb, err := single(b, name)
	if err != nil {
		return 0, err
	}
	return mb.GetCounter().GetValue() - ma.GetCounter().GetValue(), nil
}

// buckets are a histogram's observations between two scrapes: counts[i]
// observations at most upper[i] (not cumulative).
type buckets struct {
	upper  []float64
	counts []float64
	total  float64 // the sum of the observations
}

func histogramDelta(a, b map[string]*dto.MetricFamily, name string) (buckets, error) {
	ma, err := single(a, name)
	if err != nil {
		return buckets{}, err
	}
	mb, err := single(b, name)
	if err != nil {
		return buckets{}, err
	}
	ha, hb := ma.GetHistogram(), mb.GetHistogram()
	if len(ha.GetBucket()) != len(hb.GetBucket()) {
		return buckets{}, fmt.Errorf("%s: the two scrapes have different buckets", name)
	}
	var d buckets
	var prevA, prevB uint64
	for i, bb := range hb.GetBucket() {
		ba := ha.GetBucket()[i]
		d.upper = append(d.upper, bb.GetUpperBound())
		d.counts = append(d.counts, float64((bb.GetCumulativeCount()-prevB)-(ba.GetCumulativeCount()-prevA)))
		prevA, prevB = ba.GetCumulativeCount(), bb.GetCumulativeCount()
	}
	d.upper = append(d.upper, math.Inf(1))
	d.counts = append(d.counts, float64((hb.GetSampleCount()-prevB)-(ha.GetSampleCount()-prevA)))
	d.total = hb.GetSampleSum() - ha.GetSampleSum()
	return d, nil
}

func (d buckets) count() float64 {
	var n float64
	for _, c := range d.counts {
		n += c
	}
	return n
}

func (d buckets) sum() float64 { return d.total }

// quantile is the upper bound of the bucket holding the q-th observation
// (q = 1: the highest non-empty bucket), 0 without observations. The last
// bucket's bound is infinite: the one below it is returned instead.
func (d buckets) quantile(q float64) float64 {
	n := d.count()
	if n == 0 {
		return 0
	}
	rank := math.Ceil(q * n)
	var seen float64
	for i, c := range d.counts {
		seen += c
		if seen >= rank && c > 0 {
			if math.IsInf(d.upper[i], 1) && i > 0 {
				return d.upper[i-1]
			}
			return d.upper[i]
		}
	}
	return d.upper[len(d.upper)-1]
}
