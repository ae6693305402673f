package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

// keeper runs the daemon of h under its keeper (kube-userspace-proxy
// keep), from the build that crashes on demand.
func (h *handoverLab) keeper() *Proc {
	h.t.Helper()
	h.AdminSocket = filepath.Join(h.t.TempDir(), "admin.sock")
	p := h.Start("node", append([]string{filepath.Join(binDir, "kube-userspace-proxy-crashtest"), "keep", "--log-level", "debug",
		"--admin-socket", h.AdminSocket, "--handover-socket", h.socket}, h.args...)...)
	h.t.Cleanup(func() {
		if h.t.Failed() {
			h.t.Logf("the keeper's log:\n%s", tail(p.Output(), 6000))
		}
	})
	return p
}

// workerOf is the pid of the keeper's worker (its one child), once it
// has one other than not.
func workerOf(t *testing.T, keeper *Proc, not int) int {
	t.Helper()
	pid := keeper.Cmd.Process.Pid
	var worker int
	waitFor(t, "the keeper's worker", func() bool {
		// Each thread's children: the keeper's Go runtime starts a
		// worker from whichever thread it runs on.
		files, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
		var f []string
		for _, file := range files {
			b, _ := os.ReadFile(file)
			f = append(f, strings.Fields(string(b))...)
		}
		if len(f) != 1 {
			return false
		}
		worker, _ = strconv.Atoi(f[0])
		return worker != not
	})
	return worker
}

// countIn counts the lines of p's output with s.
func countIn(p *Proc, s string) int { return strings.Count(p.Output(), s) }

// crashFails checks the load's failures against the crashes at crashedAt:
// a connection begun before a crash may be cut by it (its sockets died
// with the worker: a reset or an EOF within a second); every other
// connection must have been answered — none refused, none cut.
func crashFails(t *testing.T, ld *load, crashedAt []time.Time) {
	t.Helper()
	ld.mu.Lock()
	defer ld.mu.Unlock()
	cut := 0
	for i, e := range ld.errs {
		owned := false
		for _, at := range crashedAt {
			if ld.errStart[i].Before(at) && ld.errAt[i].After(at) && ld.errAt[i].Before(at.Add(time.Second)) && !strings.Contains(e, "refused") {
				owned = true
			}
		}
		if owned {
			cut++
			continue
		}
		t.Errorf("a connection failed across a crash: %s (begun %s)", e, ld.errStart[i].Format("15:04:05.000"))
	}
	t.Logf("%d connections, %d cut in the dead worker", ld.tries.Load(), cut)
}

// The worker crashes — kill -9, a Go panic, the OOM killer — under 40 new
// connections a second: the keeper starts another at once on the sockets
// it kept, nothing is refused, every connection begun after the crash is
// answered (it waited in the listener's backlog), and the keeper names
// each cause. The OOM kill is made in a memory cgroup of its own.
func TestKeeperRestartsACrashedWorker(t *testing.T) {
	h := newHandoverLab(t)
	k := h.keeper()
	waitFor(t, "the ClusterIP", func() bool { return strings.HasPrefix(h.Curl("client", "http://10.96.0.10/"), "pod") })
	waitFor(t, "the worker's sockets kept", func() bool { return strings.Contains(k.Output(), "Kept: a keeper holds") })
	ld := startLoad(h.Lab, "10.96.0.10:80")
	var crashedAt []time.Time
	worker := workerOf(t, k, 0)
	for i, c := range []struct {
		name, cause string
		crash       func(pid int)
	}{
		{"kill -9", "signal: killed", func(pid int) { _ = syscall.Kill(pid, syscall.SIGKILL) }},
		{"a panic", "panic: crashtest: a panic injected by SIGUSR1", func(pid int) { _ = syscall.Kill(pid, syscall.SIGUSR1) }},
		{"the OOM killer", "signal: killed", func(pid int) { oomKill(t, pid) }},
	} {
		time.Sleep(500 * time.Millisecond) // load before the crash
		crashedAt = append(crashedAt, time.Now())
		c.crash(worker)
		testutil.WaitFor(t, "the keeper to start another worker after "+c.name, 20*time.Second, 10*time.Millisecond, func() bool {
			return countIn(k, "The worker died; starting another") == i+1
		})
		if line := grepLines(k.Output(), "The worker died"); !strings.Contains(strings.Split(line, "\n")[i], c.cause) {
			t.Errorf("after %s the keeper says %q, want the cause %q", c.name, strings.Split(line, "\n")[i], c.cause)
		}
		worker = workerOf(t, k, worker)
		waitFor(t, "the new worker serving after "+c.name, func() bool {
			return countIn(k, "Took over: the predecessor serves nothing more") == i+1
		})
		t.Logf("%s: serving again %v after the crash", c.name, time.Since(crashedAt[i]).Round(time.Millisecond))
	}
	time.Sleep(500 * time.Millisecond) // load after the last restart
	ld.end()
	crashFails(t, ld, crashedAt)
}

// oomKill moves pid into a memory cgroup of 200 MiB of its own and has it
// allocate until the kernel's OOM killer ends it.
func oomKill(t *testing.T, pid int) {
	t.Helper()
	root := "/sys/fs/cgroup/memory"
	if _, err := os.Stat(filepath.Join(root, "memory.limit_in_bytes")); err != nil {
		if os.Getenv("KUP_REQUIRE_ROOT_TESTS") != "" {
			t.Fatalf("no cgroup v1 memory controller at %s: %v", root, err)
		}
		_ = syscall.Kill(pid, syscall.SIGKILL) // the crash the test needs, without the OOM killer
		t.Logf("no cgroup v1 memory controller (%v): killed with -9 instead", err)
		return
	}
	cg := filepath.Join(root, fmt.Sprintf("kup-oom-%d", pid))
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Empty once the process is gone.
		testutil.WaitFor(t, "the OOM cgroup empty", 10*time.Second, 50*time.Millisecond, func() bool { return os.Remove(cg) == nil })
	})
	for _, w := range []struct{ file, v string }{{"memory.limit_in_bytes", "209715200"}, {"memory.memsw.limit_in_bytes", "209715200"}, {"cgroup.procs", strconv.Itoa(pid)}} {
		err := os.WriteFile(filepath.Join(cg, w.file), []byte(w.v), 0o644)
		if err != nil && w.file != "memory.memsw.limit_in_bytes" { // without swap accounting: no such file
			t.Fatalf("%s: %v", w.file, err)
		}
	}
	_ = syscall.Kill(pid, syscall.SIGUSR2)
	testutil.WaitFor(t, "the OOM killer", 20*time.Second, 10*time.Millisecond, func() bool {
		b, err := os.ReadFile(filepath.Join(cg, "memory.oom_control"))
		return err == nil && strings.Contains(string(b), "oom_kill 1")
	})
}
