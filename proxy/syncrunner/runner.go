// Package syncrunner paces the sync goroutine, as kube-proxy's
// async.BoundedFrequencyRunner paces its syncRunner: a token bucket that
// lets a burst of syncs through and then one per minimum period, the
// periodic check, a retry after a failed rule write, and a retry with
// back-off of frontends that could not open.
//
// It owns its timers and its bucket; the sync goroutine owns the loop that
// selects on its channels and calls Wait before each sync. It imports
// nothing of this project.
package syncrunner

import (
	"context"
	"time"

	"golang.org/x/time/rate"
)

// Burst is how many syncs may follow each other without waiting for the
// minimum period: two, so that a Service and then its EndpointSlice (two
// events, two States) are both served at once.
const Burst = 2

// DefaultPeriod is the periodic check's period when none is given.
const DefaultPeriod = 30 * time.Second

// Runner is the sync goroutine's clocks. Its methods are for that one
// goroutine.
type Runner struct {
	period  *time.Ticker // the periodic check (or verifying sync) of the rules
	retry   *time.Timer  // after a failed rule write
	retryIn time.Duration
	// reopen tries again listeners or NodePorts that could not be opened:
	// soon, then less often while they fail.
	reopen             *time.Timer
	reopenIn, reopenAt time.Duration // the next wait, and the first
	periodLen          time.Duration
	limiter            *rate.Limiter
}

// New returns the runner of a sync goroutine that syncs at most once per
// minPeriod on average (0: no limit) and checks every period
// (DefaultPeriod when 0). Stop it when the goroutine ends.
func New(minPeriod, period time.Duration) *Runner {
	if period <= 0 {
		period = DefaultPeriod
	}
	limit := rate.Inf
	if minPeriod > 0 {
		limit = rate.Every(minPeriod)
	}
	r := &Runner{period: time.NewTicker(period), retry: time.NewTimer(time.Hour), reopen: time.NewTimer(time.Hour),
		retryIn: max(minPeriod, time.Second), reopenAt: max(minPeriod, time.Second), periodLen: period,
		limiter: rate.NewLimiter(limit, Burst)}
	r.retry.Stop()
	r.reopen.Stop()
	r.reopenIn = r.reopenAt
	return r
}

// Period fires every period: the periodic check of the rules.
func (r *Runner) Period() <-chan time.Time { return r.period.C }

// Retry fires once after RetryWrite.
func (r *Runner) Retry() <-chan time.Time { return r.retry.C }

// Reopen fires once after a sync that Failing said left frontends failing.
func (r *Runner) Reopen() <-chan time.Time { return r.reopen.C }

// RetryWrite arms Retry after a failed rule write: the minimum period
// later, at least a second.
func (r *Runner) RetryWrite() { r.retry.Reset(r.retryIn) }

// Failing arms Reopen after a sync that left frontends failing (some),
// waiting twice as long after each such sync in a row, up to the period;
// a sync with none resets the wait.
func (r *Runner) Failing(some bool) {
	if !some {
		r.reopenIn = r.reopenAt
		return
	}
	r.reopen.Reset(r.reopenIn)
	r.reopenIn = min(2*r.reopenIn, r.periodLen)
}

// Wait waits for the bucket's next token: a lone change, or a Service and
// then its slice, syncs at once; under churn syncs come at most once per
// minimum period on average. It returns ctx's error if ctx ends first.
func (r *Runner) Wait(ctx context.Context) error { return r.limiter.Wait(ctx) }

// Stop stops the timers.
func (r *Runner) Stop() {
	r.period.Stop()
	r.retry.Stop()
	r.reopen.Stop()
}
