package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The benchmarks stop on a figure that is not a number in its sane range
// (a renamed JSON field, a failed measurement), instead of printing 0.00× or
// inf× and passing: first the check itself, then make bench-smoke's script
// with a load generator that answers nonsense.
func TestBenchStopsOnABrokenMeasurement(t *testing.T) {
	record := func(metric, value string) (string, error) {
		cmd := exec.Command("bash", "-c", `. test/bench/results.sh; results=$(mktemp); record "$1" proxy "$2"`, "bash", metric, value)
		cmd.Dir = repoRoot
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	for _, c := range []struct {
		metric, value string
		ok            bool
	}{
		{"cps", "3012", true}, {"tput_128K", "9.87", true}, {"idle_kib_1000", "-0.4", true},
		{"cps", "", false}, {"cps", "0", false}, {"tput_128K", "0.00", false}, {"p99", "inf", false}, {"rps", "12,5", false},
	} {
		out, err := record(c.metric, c.value)
		if (err == nil) != c.ok || (!c.ok && !strings.Contains(out, "the measurement broke")) {
			t.Errorf("record %s %q: %v %q", c.metric, c.value, err, out)
		}
	}

	requireRoot(t)
	fake := t.TempDir()
	bins := []string{"kube-userspace-proxy", "backend"}
	if basicKernel && !realBasicKernel {
		bins = append(bins, "kube-userspace-proxy.real") // behind the basic kernel's wrapper
	}
	for _, b := range bins {
		data, err := os.ReadFile(filepath.Join(binDir, b))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(fake, b), data, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// A load generator whose output lost its field.
	if err := os.WriteFile(filepath.Join(fake, "loadgen"), []byte("#!/bin/sh\necho '{\"persecond\":3000,\"count\":9000}'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("bash", "test/bench/bench.sh")
	cmd.Dir = repoRoot
	cmd.Env = append(os.Environ(), "SMOKE=1", "PATHS=proxy", "TESTS=cps", "BIN="+fake)
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "the figure cps of proxy is '', not a number") {
		t.Fatalf("bench.sh with a broken load generator: %v\n%s", err, tail(string(out), 3000))
	}
}
