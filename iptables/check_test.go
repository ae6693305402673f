package iptables

import (
	"context"
	"errors"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

func TestRulesetSame(t *testing.T) {
	base := func() *Ruleset {
		return &Ruleset{
			Nat:    map[string][]string{"KUP-A": {"r1", "r2", "r3"}, "KUP-B": {}},
			Filter: map[string][]string{"KUP-F": {"f1"}},
		}
	}
	for _, tc := range []struct {
		name string
		edit func(*Ruleset)
		same bool
	}{
		{"identical", func(*Ruleset) {}, true},
		{"another order", func(rs *Ruleset) { rs.Nat["KUP-A"] = []string{"r3", "r1", "r2"} }, true},
		{"an empty chain read as nil", func(rs *Ruleset) { rs.Nat["KUP-B"] = nil }, true},
		{"a rule missing", func(rs *Ruleset) { rs.Nat["KUP-A"] = []string{"r1", "r2"} }, false},
		{"a rule changed", func(rs *Ruleset) { rs.Nat["KUP-A"] = []string{"r1", "r2", "rX"} }, false},
		{"a rule added", func(rs *Ruleset) { rs.Nat["KUP-A"] = append(rs.Nat["KUP-A"], "r4") }, false},
		{"a chain missing", func(rs *Ruleset) { delete(rs.Nat, "KUP-B") }, false},
		{"a chain added", func(rs *Ruleset) { rs.Filter["KUP-G"] = nil }, false},
		{"a chain renamed", func(rs *Ruleset) { rs.Filter["KUP-G"] = rs.Filter["KUP-F"]; delete(rs.Filter, "KUP-F") }, false},
		{"a rule in the other table", func(rs *Ruleset) { rs.Filter["KUP-F"] = []string{"r1"} }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			live := base()
			tc.edit(live)
			if got := live.Same(base()); got != tc.same {
				t.Errorf("live.Same(want) = %v, want %v", got, tc.same)
			}
			if got := base().Same(live); got != tc.same {
				t.Errorf("want.Same(live) = %v, want %v", got, tc.same)
			}
		})
	}
}

// TestCheckDumpRunsNiced: the periodic check's iptables-save runs at a low
// CPU priority, a rule write's own read at the normal one.
func TestCheckDumpRunsNiced(t *testing.T) {
	dir := t.TempDir()
	save := filepath.Join(dir, "save")
	// The priority is set just after the process starts: wait (up to 10 s)
	// for it when asked to, then print it.
	script := "#!/bin/sh\n" +
		"if [ \"$WAIT_FOR_NICE\" = 1 ]; then i=0; while [ \"$(nice)\" = 0 ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i+1)); done; fi\n" +
		"echo \"# nice $(nice)\"\n"
	if err := os.WriteFile(save, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	f := &family{fam: 4, save: save}
	t.Setenv("WAIT_FOR_NICE", "1")
	out, err := f.dump(context.Background(), "nat", true)
	if err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(out) != "# nice 10" {
		t.Errorf("background dump printed %q, want %q", out, "# nice 10")
	}
	t.Setenv("WAIT_FOR_NICE", "0")
	if out, err = f.dump(context.Background(), "nat", false); err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(out) != "# nice 0" {
		t.Errorf("foreground dump printed %q, want %q", out, "# nice 0")
	}
}

// stuckCommand writes a script that records its PID and then never ends,
// as an iptables-restore stuck in the kernel or on a lock would.
func stuckCommand(t *testing.T) (bin, pidFile string) {
	dir := t.TempDir()
	bin, pidFile = filepath.Join(dir, "stuck"), filepath.Join(dir, "pid")
	script := "#!/bin/sh\necho $$ > " + pidFile + "\nexec sleep 600\n"
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return bin, pidFile
}

// gone waits (up to 10 s) for the process whose PID is in pidFile to be
// gone; it fails the test if it is not.
func gone(t *testing.T, pidFile string) {
	t.Helper()
	data, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatalf("the command never ran: %v", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for syscall.Kill(pid, 0) == nil {
		if time.Now().After(deadline) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("process %d still runs", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestStuckRestoreIsKilled: a write whose iptables-restore never ends
// fails after the family's timeout, saying so, and the process is gone.
func TestStuckRestoreIsKilled(t *testing.T) {
	bin, pidFile := stuckCommand(t)
	f := &family{fam: 4, restore: bin, timeout: 300 * time.Millisecond}
	start := time.Now()
	err := f.run(context.Background(), f.restore, []string{"-w", "--noflush"}, "*nat\nCOMMIT\n")
	took := time.Since(start)
	if err == nil || !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "killed, not done after 300ms") {
		t.Fatalf("err = %v, want one that says the restore was killed after 300ms", err)
	}
	// The bound is the timeout and the wait for its output (waitDelay),
	// with room for a loaded machine; the command itself would take 600 s.
	if took > 300*time.Millisecond+waitDelay+5*time.Second {
		t.Fatalf("the write returned after %v", took)
	}
	gone(t, pidFile)
}

// TestStoppedWriteIsNoFailure: a diff write whose iptables-restore is
// stopped by its context (shutdown, handover) ends at once, counts no
// restore failure, warns of none and attempts no full rewrite (the log
// says it was stopped: TestHungRuleWrite).
func TestStoppedWriteIsNoFailure(t *testing.T) {
	bin, pidFile := stuckCommand(t)
	f := &family{fam: 4, restore: bin, save: bin, features: allFeatures, jumpsOK: true, timeout: time.Minute}
	f.installed = &Ruleset{Nat: map[string][]string{}, Filter: map[string][]string{}}
	log := logrus.New()
	log.SetOutput(io.Discard)
	warnings := &countHook{}
	log.AddHook(warnings)
	restores := counterValue(t, restoreFailures.WithLabelValues("IPv4"))
	partial := counterValue(t, partialRestoreFailures.WithLabelValues("IPv4"))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // ends the watcher below if the restore never ran
	go func() {
		for ctx.Err() == nil { // cancel once the restore runs
			if _, err := os.Stat(pidFile); err == nil {
				cancel()
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	sp := &config.ServicePort{Name: config.ServicePortName{Namespace: "ns", Name: "a"}, Protocol: config.TCP, Port: 80,
		ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.1")}}
	fes := []config.Frontend{{Service: sp, Kind: config.KindAll, Family: 4, Protocol: config.TCP, Listen: netip.MustParseAddrPort("0.0.0.0:45001")}}
	_, _, err := f.sync(ctx, fes, RenderOptions{}, false, nil, log)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want the cancellation", err)
	}
	if warnings.warnings != 0 || f.installed != nil {
		t.Fatalf("%d warnings, installed %v: want none and the records dropped", warnings.warnings, f.installed)
	}
	if d := counterValue(t, restoreFailures.WithLabelValues("IPv4")) - restores; d != 0 {
		t.Fatalf("%v restore failures counted", d)
	}
	if d := counterValue(t, partialRestoreFailures.WithLabelValues("IPv4")) - partial; d != 0 {
		t.Fatalf("%v partial restore failures counted", d)
	}
	gone(t, pidFile)
}

// counterValue is c's value.
func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var d dto.Metric
	if err := c.Write(&d); err != nil {
		t.Fatal(err)
	}
	return d.GetCounter().GetValue()
}

// TestShutdownKillsAStuckSave: the periodic check's iptables-save ends when
// its context does (shutdown), long before the timeout.
func TestShutdownKillsAStuckSave(t *testing.T) {
	bin, pidFile := stuckCommand(t)
	f := &family{fam: 4, save: bin} // the default timeout: a minute
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, _, err := f.live(ctx, true)
		errc <- err
	}()
	for { // until it runs
		if _, err := os.Stat(pidFile); err == nil {
			break
		}
		select {
		case err := <-errc:
			t.Fatalf("the check ended before it was stopped: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	cancel()
	select {
	case err := <-errc:
		if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "killed") {
			t.Fatalf("err = %v, want one that says the save was killed", err)
		}
	case <-time.After(waitDelay + 10*time.Second):
		t.Fatal("the check did not end within 11 s of its context")
	}
	gone(t, pidFile)
}
