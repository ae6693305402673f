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
func (h *handoverLab) keeper(keepFlags ...string) *Proc {
	h.t.Helper()
	h.AdminSocket = filepath.Join(h.t.TempDir(), "admin.sock")
	args := append(append([]string{filepath.Join(binDir, "kube-userspace-proxy-crashtest"), "keep"}, keepFlags...),
		"--log-level", "debug", "--admin-socket", h.AdminSocket, "--handover-socket", h.socket)
	p := h.Start("node", append(args, h.args...)...)
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

// crash is one worker's end as a test saw it: from the moment the test
// made it crash to the moment its death was seen. The two are apart when
// the death takes time: a worker the OOM killer is coming for serves on,
// allocating, for a second or more.
type crash struct{ began, died time.Time }

// crashAt is a crash whose death is at once (kill -9).
func crashAt(at time.Time) crash { return crash{began: at, died: at} }

// crashFails checks the load's failures against crashes: a connection
// begun before a worker died may be cut by its death (its sockets died
// with the worker: a reset or an EOF within a second of it); every other
// connection must have been answered — none refused, none cut.
func crashFails(t *testing.T, ld *load, crashes []crash) {
	t.Helper()
	ld.mu.Lock()
	defer ld.mu.Unlock()
	cut := 0
	for i, e := range ld.errs {
		owned := false
		for _, c := range crashes {
			if ld.errStart[i].Before(c.died) && ld.errAt[i].After(c.began) && ld.errAt[i].Before(c.died.Add(time.Second)) &&
				!strings.Contains(e, "refused") {
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
	var crashes []crash
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
		began := time.Now()
		c.crash(worker)
		testutil.WaitFor(t, "the keeper to start another worker after "+c.name, 20*time.Second, 10*time.Millisecond, func() bool {
			return countIn(k, "The worker died; starting another") == i+1
		})
		crashes = append(crashes, crash{began: began, died: time.Now()})
		if line := grepLines(k.Output(), "The worker died"); !strings.Contains(strings.Split(line, "\n")[i], c.cause) {
			t.Errorf("after %s the keeper says %q, want the cause %q", c.name, strings.Split(line, "\n")[i], c.cause)
		}
		worker = workerOf(t, k, worker)
		waitFor(t, "the new worker serving after "+c.name, func() bool {
			return countIn(k, "Took over: the predecessor serves nothing more") == i+1
		})
		t.Logf("%s: serving again %v after the crash", c.name, time.Since(began).Round(time.Millisecond))
	}
	time.Sleep(500 * time.Millisecond) // load after the last restart
	ld.end()
	crashFails(t, ld, crashes)
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
	for _, w := range []struct{ file, v string }{{"memory.limit_in_bytes", "209715200"}, {"memory.memsw.limit_in_bytes", "209715200"},
		{"cgroup.procs", strconv.Itoa(pid)}} {
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

// crashes is how many TestKeeperManyCrashes makes (KUP_CRASHES overrides).
func crashes() int {
	if n, err := strconv.Atoi(os.Getenv("KUP_CRASHES")); err == nil && n > 0 {
		return n
	}
	return 100
}

// procUsage is a process's descriptors and resident memory.
func procUsage(t *testing.T, pid int) (fds, rssKiB int) {
	t.Helper()
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			fmt.Sscanf(strings.TrimSpace(v), "%d", &rssKiB)
		}
	}
	return len(entries), rssKiB
}

// keeperGoroutines is the goroutine count of the keeper's last restart line.
func keeperGoroutines(k *Proc) int {
	lines := strings.Split(grepLines(k.Output(), "keeperGoroutines="), "\n")
	_, v, _ := strings.Cut(lines[len(lines)-1], "keeperGoroutines=")
	n, _ := strconv.Atoi(strings.Fields(v + " ")[0])
	return n
}

// 100 crashes in a row (kill -9 of each worker once it serves) under 40 new
// connections a second: nothing refused or cut but what a dead worker had
// begun; the keeper is the same process throughout, and its descriptors,
// goroutines and memory are the same after the last crash as after the
// first.
func TestKeeperManyCrashes(t *testing.T) {
	h := newHandoverLab(t)
	k := h.keeper()
	waitFor(t, "the ClusterIP", func() bool { return strings.HasPrefix(h.Curl("client", "http://10.96.0.10/"), "pod") })
	ld := startLoad(h.Lab, "10.96.0.10:80")
	var made []crash
	var firstFDs, firstRSS, firstGoroutines int
	worker := workerOf(t, k, 0)
	n := crashes()
	for i := 1; i <= n; i++ {
		waitFor(t, "the worker serving", func() bool { return countIn(k, "Took over: the predecessor serves nothing more") == i-1 })
		made = append(made, crashAt(time.Now()))
		_ = syscall.Kill(worker, syscall.SIGKILL)
		worker = workerOf(t, k, worker)
		if i == 1 {
			waitFor(t, "the first restart", func() bool { return countIn(k, "The worker died") == 1 })
			firstFDs, firstRSS = procUsage(t, k.Cmd.Process.Pid)
			firstGoroutines = keeperGoroutines(k)
		}
	}
	waitFor(t, "the last worker serving", func() bool { return countIn(k, "Took over: the predecessor serves nothing more") == n })
	ld.end()
	crashFails(t, ld, made)
	fds, rss := procUsage(t, k.Cmd.Process.Pid)
	goroutines := keeperGoroutines(k)
	t.Logf("%d crashes; the keeper after the first: %d descriptors, %d goroutines, %d KiB; after the last: %d, %d, %d KiB",
		n, firstFDs, firstGoroutines, firstRSS, fds, goroutines, rss)
	if fds > firstFDs+2 || goroutines > firstGoroutines+2 {
		t.Errorf("the keeper grew: descriptors %d → %d, goroutines %d → %d", firstFDs, fds, firstGoroutines, goroutines)
	}
	if rss > firstRSS*3/2+4<<10 {
		t.Errorf("the keeper's memory grew from %d KiB to %d KiB", firstRSS, rss)
	}
	if k.Cmd.ProcessState != nil {
		t.Error("the keeper ended")
	}
}

// The keeper killed with -9 (in the DaemonSet that ends the container):
// the worker serves on until it is stopped; stopped, the rules stay and
// the next start serves, as a restart without a keeper does.
func TestKeeperKilled(t *testing.T) {
	h := newHandoverLab(t)
	// Its output to a file, as a container's goes to the runtime's log
	// (a pipe through the test would close with the keeper, and the
	// worker, which writes to it too, would die of SIGPIPE).
	logFile := filepath.Join(t.TempDir(), "keeper.log")
	h.AdminSocket = filepath.Join(t.TempDir(), "admin.sock")
	k := h.Start("node", append([]string{"sh", "-c", `exec "$0" "$@" >>` + logFile + ` 2>&1`, filepath.Join(binDir, "kube-userspace-proxy-crashtest"), "keep",
		"--admin-socket", h.AdminSocket, "--handover-socket", h.socket}, h.args...)...)
	t.Cleanup(func() {
		if t.Failed() {
			b, _ := os.ReadFile(logFile)
			t.Logf("the keeper's and its worker's log:\n%s", tail(string(b), 6000))
		}
	})
	waitFor(t, "the ClusterIP", func() bool { return strings.HasPrefix(h.Curl("client", "http://10.96.0.10/"), "pod") })
	worker := workerOf(t, k, 0)
	_ = k.Cmd.Process.Kill()
	_ = k.Cmd.Wait()
	for i := range 10 {
		if got := h.Curl("client", "http://10.96.0.10/"); !strings.HasPrefix(got, "pod") {
			t.Fatalf("request %d with the keeper gone: %q", i, got)
		}
	}
	// It logs on (its stderr is not a pipe through the keeper) and syncs:
	// a Service added is served.
	base, err := os.ReadFile(h.manifest)
	if err != nil {
		t.Fatal(err)
	}
	writeManifest(t, h.manifest, string(base)+localService())
	waitFor(t, "the Service added with the keeper gone", func() bool { return strings.HasPrefix(h.Curl("ext", "http://203.0.113.13/"), "pod") })
	if err := syscall.Kill(worker, 0); err != nil {
		t.Fatalf("the worker is gone: %v", err)
	}
	_ = syscall.Kill(worker, syscall.SIGTERM)
	waitFor(t, "the worker's end", func() bool { return syscall.Kill(worker, 0) != nil })
	next := h.daemon()
	testutil.WaitFor(t, "serving after the next start", 3*time.Second, 20*time.Millisecond, func() bool {
		return strings.HasPrefix(h.Curl("client", "http://10.96.0.10/"), "pod")
	})
	_ = next
}

// A handover between two keepers' workers (a DaemonSet's rollout: the new
// pod beside the old): the new worker takes over from the old one, the
// old keeper lets its sockets go and, stopped, ends with its worker
// without starting another; a crash of the new worker is then its own
// keeper's to mend. A held connection survives both.
func TestKeeperHandover(t *testing.T) {
	h := newHandoverLab(t)
	oldK := h.keeper()
	waitFor(t, "the ClusterIP", func() bool { return strings.HasPrefix(h.Curl("client", "http://10.96.0.10/"), "pod") })
	held := dialKeepAlive(t, h.Lab, "10.96.0.10:80")
	ld := startLoad(h.Lab, "10.96.0.10:80")
	newK := h.keeper()
	waitFor(t, "the new worker serving", func() bool { return countIn(newK, "Took over: the predecessor serves nothing more") == 1 })
	_ = oldK.Cmd.Process.Signal(syscall.SIGTERM)
	if err := oldK.Cmd.Wait(); err != nil {
		t.Errorf("the old keeper on SIGTERM: %v", err)
	}
	if strings.Contains(oldK.Output(), "The worker died") {
		t.Errorf("the old keeper took its worker's end for a crash:\n%s", grepLines(oldK.Output(), "worker"))
	}
	if pod, err := held.get(); err != nil || !strings.HasPrefix(pod, "pod") {
		t.Fatalf("the held connection after the handover: %q %v", pod, err)
	}
	crashedAt := time.Now()
	_ = syscall.Kill(workerOf(t, newK, 0), syscall.SIGKILL)
	waitFor(t, "the new keeper's restart", func() bool { return countIn(newK, "Took over: the predecessor serves nothing more") == 2 })
	time.Sleep(300 * time.Millisecond)
	ld.end()
	crashFails(t, ld, []crash{crashAt(crashedAt)})
}

// A worker that hangs (stopped: its sync goroutine answers nothing) is
// killed by its keeper once it has been silent for --hang-timeout, well
// before a liveness probe would restart the container, and replaced on
// the sockets kept.
func TestKeeperKillsAHungWorker(t *testing.T) {
	h := newHandoverLab(t)
	k := h.keeper("--hang-timeout", "6s", "--")
	waitFor(t, "the ClusterIP", func() bool { return strings.HasPrefix(h.Curl("client", "http://10.96.0.10/"), "pod") })
	worker := workerOf(t, k, 0)
	// Its first heartbeat (which gives the keeper every pick state) arms
	// the watch.
	waitFor(t, "the worker's first heartbeat", func() bool { return countIn(k, "Gave the keeper the pick states changed") > 0 })
	stoppedAt := time.Now()
	_ = syscall.Kill(worker, syscall.SIGSTOP)
	testutil.WaitFor(t, "the keeper's verdict", 20*time.Second, 50*time.Millisecond, func() bool {
		return strings.Contains(k.Output(), "The worker hangs")
	})
	waitFor(t, "the next worker serving", func() bool { return countIn(k, "Took over: the predecessor serves nothing more") == 1 })
	if line := grepLines(k.Output(), "The worker died"); !strings.Contains(line, "hung (no sign of life for 6s)") {
		t.Errorf("the restart does not name the hang: %s", line)
	}
	t.Logf("stopped worker replaced %v after it stopped", time.Since(stoppedAt).Round(time.Millisecond))
	if got := h.Curl("client", "http://10.96.0.10/"); !strings.HasPrefix(got, "pod") {
		t.Fatalf("after the hung worker was replaced: %q", got)
	}
}

// What decides future picks survives a crash as it survives a handover,
// as the keeper last had it: a drain set by hand on the dead worker holds
// in the next, and clients pinned by ClientIP affinity keep their
// endpoint.
func TestKeeperKeepsPickState(t *testing.T) {
	h := newHandoverLab(t)
	writeManifest(t, h.manifest, pickStateManifest())
	k := h.keeper()
	pinned := setPickState(t, h)
	// A heartbeat after the drain gives it (or gave it already): traffic
	// meanwhile makes sure one comes with something to give.
	gave := countIn(k, "Gave the keeper the pick states changed")
	waitFor(t, "the drain given to the keeper", func() bool {
		h.Curl("client", "http://10.96.0.10/")
		return countIn(k, "Gave the keeper the pick states changed") > gave
	})
	_ = syscall.Kill(workerOf(t, k, 0), syscall.SIGKILL)
	waitFor(t, "the next worker serving", func() bool { return countIn(k, "Took over: the predecessor serves nothing more") == 1 })
	checkPickState(t, h, pinned, "the crash")
}
