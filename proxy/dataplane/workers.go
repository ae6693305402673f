package dataplane

import (
	"sync"
	"time"
)

// workers runs per-connection functions on goroutines that outlive one
// connection. A fresh goroutine starts with a small stack and grows it, by
// copying, on its way through a dial and a copy; a parked worker keeps its
// grown stack. Workers idle for longer than maxIdle exit, so a burst
// leaves no lasting goroutines behind, and at most maxParked wait at a time,
// so that a storm of short connections leaves no pile of parked stacks.
//
// Go never blocks: with no idle worker it starts a new one.
type workers struct {
	maxIdle   time.Duration
	maxParked int // 0: no limit

	mu      sync.Mutex
	idle    []*worker // most recently parked last
	stopped bool
	running sync.WaitGroup
}

type worker struct {
	run      chan func() // capacity 1; nil asks the worker to exit
	parkedAt time.Time
}

// Go runs fn on an idle worker or a new goroutine (a plain one once the
// pool is stopped).
func (w *workers) Go(fn func()) {
	w.mu.Lock()
	if w.stopped {
		w.mu.Unlock()
		go fn()
		return
	}
	if n := len(w.idle); n > 0 {
		wk := w.idle[n-1] // the most recently used: its stack is warm
		w.idle = w.idle[:n-1]
		w.mu.Unlock()
		wk.run <- fn
		return
	}
	w.running.Add(1)
	w.mu.Unlock()
	go w.loop(fn)
}

func (w *workers) loop(fn func()) {
	defer w.running.Done()
	wk := &worker{run: make(chan func(), 1)}
	for fn != nil {
		fn()
		w.mu.Lock()
		if w.stopped || (w.maxParked > 0 && len(w.idle) >= w.maxParked) {
			w.mu.Unlock()
			return
		}
		wk.parkedAt = time.Now()
		w.idle = append(w.idle, wk)
		w.mu.Unlock()
		fn = <-wk.run
	}
}

// Run retires workers idle for longer than maxIdle until stop is closed,
// then stops every worker and waits for them: the owner closes stop only
// once nothing calls Go any more (all listeners closed and connections done).
func (w *workers) Run(stop <-chan struct{}) {
	t := time.NewTicker(w.maxIdle)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			w.retire(time.Now().Add(-w.maxIdle), false)
		case <-stop:
			w.retire(time.Time{}, true)
			w.running.Wait()
			return
		}
	}
}

// retire ends the workers parked before cutoff, or all of them when stopping.
func (w *workers) retire(cutoff time.Time, stopping bool) {
	w.mu.Lock()
	n := 0
	for n < len(w.idle) && (stopping || w.idle[n].parkedAt.Before(cutoff)) {
		n++
	}
	old := append([]*worker(nil), w.idle[:n]...)
	w.idle = append(w.idle[:0], w.idle[n:]...)
	if stopping {
		w.stopped = true
	}
	w.mu.Unlock()
	for _, wk := range old {
		wk.run <- nil
	}
}
