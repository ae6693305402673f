package dataplane

import (
	"bytes"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"
)

// goid is the calling goroutine's number, from its stack trace's header
// ("goroutine 7 [running]:"): which goroutine ran a job.
func goid() int {
	buf := make([]byte, 64)
	buf = buf[:runtime.Stack(buf, false)]
	f := bytes.Fields(bytes.TrimPrefix(buf, []byte("goroutine ")))
	n, _ := strconv.Atoi(string(f[0]))
	return n
}

// ranOn collects the goroutines jobs ran on.
type ranOn struct {
	mu  sync.Mutex
	ids map[int]bool
}

func (r *ranOn) job(fn func()) func() {
	return func() {
		r.mu.Lock()
		if r.ids == nil {
			r.ids = map[int]bool{}
		}
		r.ids[goid()] = true
		r.mu.Unlock()
		fn()
	}
}

func (r *ranOn) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.ids)
}

func (w *workers) idleCount() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.idle)
}

func TestWorkersReuseRetireStop(t *testing.T) {
	w := &workers{maxIdle: 500 * time.Millisecond} // long enough to observe parked workers on a loaded machine
	stop, done := make(chan struct{}), make(chan struct{})
	go func() { w.Run(stop); close(done) }()

	// Sequential jobs reuse one parked worker.
	var on ranOn
	for i := 0; i < 5; i++ {
		ran := make(chan struct{})
		w.Go(on.job(func() { close(ran) }))
		<-ran
		waitFor(t, "worker parked", func() bool { return w.idleCount() == 1 })
	}
	if n := on.count(); n != 1 {
		t.Fatalf("5 sequential jobs ran on %d goroutines, want 1", n)
	}

	// Concurrent jobs get a worker each; none waits for another.
	var wg sync.WaitGroup
	release := make(chan struct{})
	for i := 0; i < 3; i++ {
		wg.Add(1)
		w.Go(on.job(func() { defer wg.Done(); <-release }))
	}
	close(release)
	wg.Wait()
	waitFor(t, "three workers parked", func() bool { return w.idleCount() == 3 })
	if n := on.count(); n != 3 {
		t.Fatalf("3 concurrent jobs after one parked worker: %d goroutines in all, want 3", n)
	}

	// At most maxParked wait; the others end.
	w.mu.Lock()
	w.maxParked = 2
	w.mu.Unlock()
	release = make(chan struct{})
	for i := 0; i < 4; i++ {
		wg.Add(1)
		w.Go(func() { defer wg.Done(); <-release })
	}
	close(release)
	wg.Wait()
	waitFor(t, "two workers parked", func() bool { return w.idleCount() == 2 })
	time.Sleep(20 * time.Millisecond) // a third would show up now
	if n := w.idleCount(); n > 2 {
		t.Fatalf("%d workers parked, want at most 2", n)
	}

	// Idle workers are retired after maxIdle.
	waitFor(t, "idle workers retired", func() bool { return w.idleCount() == 0 })

	// Stop waits for a busy worker; Go after stop still runs its job.
	busy := make(chan struct{})
	w.Go(func() { <-busy })
	close(stop)
	select {
	case <-done:
		t.Fatal("Run returned while a worker was busy")
	case <-time.After(20 * time.Millisecond):
	}
	close(busy)
	<-done
	ran := make(chan struct{})
	w.Go(func() { close(ran) })
	<-ran
}
