package iptables

import (
	"context"
	"fmt"
	"time"

	"github.com/sirupsen/logrus"
)

// Check compares the rules in the kernel with those last written, without
// holding up Sync: it reads them (iptables-save, 1.2 s at 10k service ports)
// while changes go on being synced, and when they differ — someone flushed
// or edited our chains or jumps — marks the family so that the next Sync
// rewrites it, and returns true (the caller then asks for a sync). A Sync
// that wrote meanwhile makes the comparison moot: it is skipped, and the
// next Check looks again.
func (r *Rules) Check(ctx context.Context) (drift bool, err error) {
	for _, f := range r.families {
		if ctx.Err() != nil {
			return drift, ctx.Err()
		}
		r.mu.Lock()
		seq, want := r.writes[f.fam], r.shown[f.fam]
		r.mu.Unlock()
		if seq%2 == 1 || want == nil {
			continue // being written, or unknown: the next Sync rewrites it anyway
		}
		start := time.Now()
		live, jumps, err := f.live(ctx, true)
		if err != nil {
			return drift, fmt.Errorf("IPv%d: %w", f.fam, err)
		}
		same := jumps && live.Same(want)
		r.mu.Lock()
		moot := r.writes[f.fam] != seq
		r.mu.Unlock()
		r.log.WithFields(logrus.Fields{"family": f.fam, "took": time.Since(start).String(), "same": same, "moot": moot}).Debug("Rules checked")
		if !same && !moot {
			f.drifted.Store(true)
			drift = true
		}
	}
	return drift, nil
}
