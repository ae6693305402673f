package syncrunner

import (
	"context"
	"testing"
	"time"
)

// The reopen wait doubles with every failing sync in a row, up to the
// period, and starts again after a sync without failures.
func TestFailingBacksOff(t *testing.T) {
	for _, tc := range []struct {
		name              string
		minPeriod, period time.Duration
		steps             []bool
		want              time.Duration // the wait the next failing sync arms
	}{
		{"first", 0, time.Minute, nil, time.Second},
		{"doubles", 0, time.Minute, []bool{true, true, true}, 8 * time.Second},
		{"capped at the period", 0, 10 * time.Second, []bool{true, true, true, true, true}, 10 * time.Second},
		{"reset by a good sync", 0, time.Minute, []bool{true, true, false}, time.Second},
		{"at least the minimum period", 5 * time.Second, time.Minute, []bool{true}, 10 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := New(tc.minPeriod, tc.period)
			defer r.Stop()
			for _, some := range tc.steps {
				r.Failing(some)
			}
			if r.reopenIn != tc.want {
				t.Fatalf("next wait %v, want %v", r.reopenIn, tc.want)
			}
		})
	}
}

// A burst of two goes through at once; the third waits for the minimum
// period's token (refused at once when its context ends sooner).
func TestWaitLetsABurstThrough(t *testing.T) {
	r := New(time.Hour, time.Hour)
	defer r.Stop()
	for i := range Burst {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := r.Wait(ctx); err != nil {
			t.Fatalf("sync %d of the burst waited: %v", i, err)
		}
		cancel()
	}
	// A deadline sooner than the next token: Wait refuses at once.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := r.Wait(ctx); err == nil {
		t.Fatal("the sync after the burst did not wait for the minimum period")
	}
	unlimited := New(0, time.Hour)
	defer unlimited.Stop()
	for i := range 10 * Burst {
		if err := unlimited.Wait(context.Background()); err != nil {
			t.Fatalf("sync %d without a minimum period: %v", i, err)
		}
	}
}

// Retry and Reopen fire once they are armed, and not before.
func TestTimersFireWhenArmed(t *testing.T) {
	r := New(0, time.Hour)
	defer r.Stop()
	select {
	case <-r.Retry():
		t.Fatal("Retry fired unarmed")
	case <-r.Reopen():
		t.Fatal("Reopen fired unarmed")
	default:
	}
	r.retryIn, r.reopenIn = time.Millisecond, time.Millisecond
	r.RetryWrite()
	r.Failing(true)
	deadline := time.After(10 * time.Second)
	for _, c := range []<-chan time.Time{r.Retry(), r.Reopen()} {
		select {
		case <-c:
		case <-deadline:
			t.Fatal("an armed timer did not fire within 10 s")
		}
	}
}
