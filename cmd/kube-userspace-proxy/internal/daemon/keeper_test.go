package daemon

import (
	"strings"
	"testing"
	"time"
)

func TestKeeperArgs(t *testing.T) {
	for _, tc := range []struct {
		args   []string
		hang   time.Duration
		daemon string
		err    bool
	}{
		{[]string{"--kubeconfig", "k"}, defaultHangTimeout, "--kubeconfig k", false},
		{[]string{"--hang-timeout", "10s", "--", "--kubeconfig", "k"}, 10 * time.Second, "--kubeconfig k", false},
		{[]string{"--hang-timeout=1m", "--manifests", "m"}, time.Minute, "--manifests m", false},
		{[]string{"--hang-timeout", "1s"}, 0, "", true},
		{[]string{"--hang-timeout=soon"}, 0, "", true},
	} {
		hang, daemon, err := keeperArgs(tc.args)
		if (err != nil) != tc.err || hang != tc.hang || strings.Join(daemon, " ") != tc.daemon {
			t.Errorf("keeperArgs(%q) = %v %q %v", tc.args, hang, daemon, err)
		}
	}
}
