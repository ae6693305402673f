package daemon

import (
	"bytes"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/internal/options"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
)

// --park-idle-after 0 turns parking off: proxy.Config says so with a
// negative duration (its zero is the default).
func TestParkIdleAfterZeroMeansNever(t *testing.T) {
	for flag, want := range map[string]time.Duration{"0": -1, "250ms": 250 * time.Millisecond} {
		o, err := options.Parse([]string{"--manifests", "x", "--park-idle-after", flag}, &bytes.Buffer{})
		if err != nil {
			t.Fatal(err)
		}
		if got := parkIdleAfter(o.ParkIdleAfter); got != want {
			t.Errorf("--park-idle-after %s: proxy.Config.ParkIdleAfter %v, want %v", flag, got, want)
		}
	}
	if o, err := options.Parse([]string{"--manifests", "x"}, &bytes.Buffer{}); err != nil || o.ParkIdleAfter != dataplane.DefaultParkIdleAfter {
		t.Errorf("default --park-idle-after %v (%v), want %v", o.ParkIdleAfter, err, dataplane.DefaultParkIdleAfter)
	}
	if _, err := options.Parse([]string{"--manifests", "x", "--park-idle-after", "-1s"}, &bytes.Buffer{}); err == nil {
		t.Error("a negative --park-idle-after was accepted")
	}
}
