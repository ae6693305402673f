// Package e2e runs the real daemon binary with real iptables inside network
// namespaces that each test creates and deletes (see test/lab/lab.sh for the
// topology). It never touches the root namespace's rules.
package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

var (
	binDir   string // built daemon and backend
	repoRoot string
	labSeq   atomic.Int64
	// basicKernel: the second leg (KUP_E2E_KERNEL=basic, make test): the
	// daemon runs as on a kernel without netfilter extras — no optional
	// match (--iptables-basic-only), no conntrack netlink (a seccomp
	// filter, test/cmd/basickernel), the legacy iptables binaries — and
	// each test passes or asserts the degraded behaviour docs/iptables.md
	// states. KUP_E2E_KERNEL=basic-real is the same on a kernel that lacks
	// those modules itself (docs/iptables.md, "Tested as a target"): only
	// the legacy binaries are put first, nothing is switched off.
	basicKernel     = strings.HasPrefix(os.Getenv("KUP_E2E_KERNEL"), "basic")
	realBasicKernel = os.Getenv("KUP_E2E_KERNEL") == "basic-real"
)

func TestMain(m *testing.M) {
	// go test runs a test binary in its package's folder (and
	// test/realkernel.sh does the same), whatever -trimpath did to the
	// binary's own idea of its source.
	wd, err := os.Getwd()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	repoRoot = filepath.Join(wd, "..", "..")
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if os.Geteuid() != 0 {
		return m.Run() // every test skips (or fails under KUP_REQUIRE_ROOT_TESTS)
	}
	dir, err := os.MkdirTemp("", "kup-e2e-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	binDir = dir
	if err := placeBinaries(dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if basicKernel {
		if err := installBasicKernel(dir); err != nil {
			fmt.Fprintf(os.Stderr, "KUP_E2E_KERNEL=basic: %v\n", err)
			return 1
		}
	}
	return m.Run()
}

// placeBinaries builds the daemon, its crash-on-demand build and the
// backend into dir, or copies them from KUP_E2E_BIN_DIR: binaries built
// beforehand, for a VM whose own go build would take long
// (test/realkernel.sh).
func placeBinaries(dir string) error {
	builds := []struct{ out, tags, pkg string }{
		{"kube-userspace-proxy", "", "./cmd/kube-userspace-proxy"},
		{"backend", "", "./test/backend"},
		// Crashes on demand, for the keeper's tests (cmd/…/crashtest.go).
		{"kube-userspace-proxy-crashtest", "crashtest", "./cmd/kube-userspace-proxy"},
	}
	for _, b := range builds {
		if pre := os.Getenv("KUP_E2E_BIN_DIR"); pre != "" {
			data, err := os.ReadFile(filepath.Join(pre, b.out))
			if err == nil {
				err = os.WriteFile(filepath.Join(dir, b.out), data, 0o755)
			}
			if err != nil {
				return fmt.Errorf("KUP_E2E_BIN_DIR: %w", err)
			}
			continue
		}
		cmd := cluster.GoCommand(repoRoot, "build", "-tags", b.tags, "-o", filepath.Join(dir, b.out), b.pkg)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("building %s: %w\n%s", b.pkg, err, out)
		}
	}
	return nil
}

// seenOK says whether a backend that saw got saw what the test wants:
// want itself, or on the basic kernel (no conntrack netlink, so no source
// NAT) one of the node's addresses where want is a client's — the degraded
// behaviour docs/iptables.md states.
func seenOK(got, want string) bool {
	return got == want || basicKernel && !labNodeAddrs[want] && labNodeAddrs[got]
}

// labNodeAddrs are the node's addresses in the lab (test/lab/lab.sh).
var labNodeAddrs = map[string]bool{"10.251.19.1": true, "fd00:251::1": true, "192.168.50.1": true, "fd00:50::1": true,
	"192.168.60.1": true, "fd00:60::1": true}

// installBasicKernel puts test/cmd/basickernel in front of the daemon's
// binaries in dir (each NAME becomes NAME.real) and the legacy iptables
// binaries first in PATH, for this process and every command it runs.
func installBasicKernel(dir string) error {
	if realBasicKernel {
		return legacyFirst(dir)
	}
	wrapper := filepath.Join(dir, "basickernel")
	cmd := cluster.GoCommand(repoRoot, "build", "-o", wrapper, "./test/cmd/basickernel")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("building the wrapper: %v\n%s", err, out)
	}
	body, err := os.ReadFile(wrapper)
	if err != nil {
		return err
	}
	for _, name := range []string{"kube-userspace-proxy", "kube-userspace-proxy-crashtest"} {
		bin := filepath.Join(dir, name)
		if err := os.Rename(bin, bin+".real"); err != nil {
			return err
		}
		if err := os.WriteFile(bin, body, 0o755); err != nil {
			return err
		}
	}
	return legacyFirst(dir)
}

// legacyFirst puts the legacy iptables binaries first in PATH, for this
// process and every command it runs, through links in dir.
func legacyFirst(dir string) error {
	legacy := filepath.Join(dir, "legacy")
	if err := os.Mkdir(legacy, 0o755); err != nil {
		return err
	}
	for _, fam := range []string{"iptables", "ip6tables"} {
		for _, suffix := range []string{"", "-save", "-restore"} {
			target, err := exec.LookPath(fam + "-legacy" + suffix)
			if err != nil {
				return fmt.Errorf("the legacy iptables binaries are needed: %w", err)
			}
			if err := os.Symlink(target, filepath.Join(legacy, fam+suffix)); err != nil {
				return err
			}
		}
	}
	return os.Setenv("PATH", legacy+string(os.PathListSeparator)+os.Getenv("PATH"))
}

// requireRoot skips a test that needs root, or fails it when CI demands
// that root tests run.
func requireRoot(t *testing.T) {
	t.Helper()
	testutil.RequireRoot(t, "it creates network namespaces and iptables rules inside them")
}

// Lab is one set of namespaces: node, pod1, pod2, client, ext.
type Lab struct {
	t      *testing.T
	prefix string

	// AdminSocket is the last daemon's admin socket.
	AdminSocket string

	mu    sync.Mutex
	procs []*exec.Cmd
	// nodeOut are the outputs of the processes started in the node
	// namespace (daemons among them): on the basic kernel, rules carry no
	// Service names and countRules finds a Service's by its listener ports.
	nodeOut []*testutil.Buffer
}

// NewLab builds the topology of test/lab/lab.sh and removes it when the test
// ends, whatever happened.
func NewLab(t *testing.T) *Lab {
	t.Helper()
	requireRoot(t)
	// The test's first TempDir registers the removal of its temporary
	// folder; made before l.down is registered, that removal runs after
	// the lab is down (cleanups run last registered first), when no
	// daemon of the lab still makes its sockets and logs in there.
	_ = t.TempDir()
	l := &Lab{t: t, prefix: fmt.Sprintf("kt%d-%d", os.Getpid()%100000, labSeq.Add(1))}
	t.Cleanup(l.down)
	if out, err := l.script("lab_up"); err != nil {
		t.Fatalf("lab_up: %v\n%s", err, out)
	}
	return l
}

func (l *Lab) script(fn string) ([]byte, error) {
	cmd := exec.Command("bash", "-c", ". test/lab/lab.sh && "+fn)
	cmd.Dir = repoRoot
	cmd.Env = append(os.Environ(), "LAB="+l.prefix)
	return cmd.CombinedOutput()
}

func (l *Lab) down() {
	l.mu.Lock()
	procs := l.procs
	l.procs = nil
	l.mu.Unlock()
	for _, p := range procs {
		if p.ProcessState == nil {
			// The whole process group: servers that fork (nginx's
			// workers) would otherwise keep running, and keep the
			// output pipe that Wait drains.
			_ = syscall.Kill(-p.Process.Pid, syscall.SIGKILL)
			_ = p.Process.Kill()
			_ = p.Wait()
		}
	}
	if out, err := l.script("lab_down"); err != nil {
		l.t.Logf("lab_down: %v\n%s", err, out)
	}
}

// NS returns the full name of a lab namespace.
func (l *Lab) NS(name string) string { return l.prefix + "-" + name }

// Exec runs a command in a namespace and returns its combined output.
func (l *Lab) Exec(ns string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", l.NS(ns)}, args...)...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// MustExec is Exec that fails the test on error.
func (l *Lab) MustExec(ns string, args ...string) string {
	l.t.Helper()
	out, err := l.Exec(ns, args...)
	if err != nil {
		l.t.Fatalf("%s: %v: %v\n%s", ns, args, err, out)
	}
	return out
}

// Proc is a background process in a namespace.
type Proc struct {
	Cmd *exec.Cmd
	out *testutil.Buffer
}

func (p *Proc) Output() string { return p.out.String() }

// Start runs a command in the background in a namespace until the test ends.
func (l *Lab) Start(ns string, args ...string) *Proc {
	l.t.Helper()
	cmd := exec.Command("ip", append([]string{"netns", "exec", l.NS(ns)}, args...)...)
	buf := &testutil.Buffer{}
	cmd.Stdout, cmd.Stderr = buf, buf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	// A child that outlives the process (a forked worker) must not hold
	// Wait forever on the output pipe.
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		l.t.Fatalf("start %v: %v", args, err)
	}
	l.mu.Lock()
	l.procs = append(l.procs, cmd)
	if ns == "node" {
		l.nodeOut = append(l.nodeOut, buf)
	}
	l.mu.Unlock()
	return &Proc{Cmd: cmd, out: buf}
}

// Backends starts the lab's two pods: HTTP and UDP on 8080, named pod1 and pod2.
func (l *Lab) Backends() {
	for _, pod := range []string{"pod1", "pod2"} {
		l.Start(pod, filepath.Join(binDir, "backend"), "--name", pod, "--tcp", ":8080", "--udp", ":8080")
	}
	// Over IPv6 too: a first dial that waits on neighbour discovery there
	// times out, and the endpoint is ejected for longer than a test waits.
	for _, ip := range []string{"10.251.19.12", "10.251.19.8", "[fd00:251::12]", "[fd00:251::8]"} {
		waitFor(l.t, "backend "+ip, func() bool {
			_, err := l.Exec("node", "curl", "-s", "-g", "--max-time", "2", "http://"+ip+":8080/")
			return err == nil
		})
	}
}

// Daemon runs kube-userspace-proxy in the node namespace, its admin and
// handover sockets in the test's own folder (the default paths are the
// machine's, shared by every lab's daemon) unless args name a handover
// socket.
func (l *Lab) Daemon(args ...string) *Proc {
	l.t.Helper()
	l.AdminSocket = filepath.Join(l.t.TempDir(), "admin.sock")
	own := []string{filepath.Join(binDir, "kube-userspace-proxy"), "--log-level", "debug", "--admin-socket", l.AdminSocket}
	if !hasFlag(args, "--handover-socket") {
		own = append(own, "--handover-socket", filepath.Join(l.t.TempDir(), "handover.sock"))
	}
	return l.Start("node", append(own, args...)...)
}

func hasFlag(args []string, flag string) bool {
	for _, a := range args {
		if a == flag || strings.HasPrefix(a, flag+"=") {
			return true
		}
	}
	return false
}

// Curl fetches url from a namespace and returns the body, or "" on failure.
func (l *Lab) Curl(ns, url string) string {
	out, err := l.Exec(ns, "curl", "-s", "-g", "--max-time", "3", url)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(out)
}

// UDP sends one datagram with nc from a namespace and returns the reply. nc
// connects its socket, so a reply from any other address than the one it
// sent to is dropped: a reply proves the source address was right.
func (l *Lab) UDP(ns, host, port, msg string) string {
	return l.udpExchange(ns, host, port, msg, "-w", "2")
}

// UDPFrom is UDP from a fixed source port of the client namespace, waiting
// up to 1 s: a resolver, syslog or game client that keeps its port keeps its
// conntrack entry.
func (l *Lab) UDPFrom(srcPort int, host, port, msg string) string {
	return l.udpExchange("client", host, port, msg, "-p", strconv.Itoa(srcPort), "-w", "1")
}

func (l *Lab) udpExchange(ns, host, port, msg string, ncArgs ...string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	args := append(append([]string{"netns", "exec", l.NS(ns), "nc", "-u"}, ncArgs...), host, port)
	cmd := exec.CommandContext(ctx, "ip", args...)
	cmd.Stdin = strings.NewReader(msg)
	out, _ := cmd.Output()
	return strings.TrimSpace(string(out))
}

// waitFor polls cond until it holds or 20 s pass.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testutil.WaitFor(t, what, 20*time.Second, 50*time.Millisecond, cond)
}
