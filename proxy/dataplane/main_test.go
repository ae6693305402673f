package dataplane

import (
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testutil.WaitFor(t, what, 10*time.Second, 10*time.Millisecond, cond)
}
