package main

// A node is one proxy's own network namespace, linked to the control
// plane's namespace by a veth pair:
//
//	control plane netns (API server on every address)
//	  └─ veth 10.250.I.1/30 ── 10.250.I.2/30 node netns I
//	       lo: the node's address 10.250.255.1 (the Node's InternalIP),
//	           Service addresses 10.96.0.0/16 and the pod range
//	           10.244.0.0/16 are local routes: a connection without rules
//	           is refused at once; one DNATed by kube-proxy to any
//	           endpoint lands on the bulk backend (0.0.0.0:8081)
//	       backends A (10.244.0.1:8080) and B (10.244.0.2:8080): the
//	           probes' endpoints; the node's own servers (node tax)
//
// Every node has the same addresses, backends and servers, so the proxies
// are measured the same way; only one node exists at a time.

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

// The proxies a run can measure (-proxies).
const (
	ours        = "kube-userspace-proxy"
	kubeNft     = "kube-proxy-nftables"
	kubeIptable = "kube-proxy-iptables"
	// kube-proxy's iptables mode on the legacy iptables backend (the x_tables
	// binaries first in its PATH, as its image's iptables-wrapper picks them
	// on a host whose rules are legacy): the iptables-nft of Debian 12 took
	// from minutes to beyond 15 minutes to restore 160 000 rules here.
	kubeLegacy = "kube-proxy-iptables-legacy"
)

// allProxies is every proxy a run can measure, in the default order.
var allProxies = []string{ours, kubeNft, kubeIptable, kubeLegacy}

// nodeIP is the node's address in every node's namespace, the Node's
// InternalIP.
const nodeIP = "10.250.255.1"

// bulkPort is the endpoints' port of the bulk Services: a listener on
// every address of the pod range.
const bulkPort = 8081

// node is one proxy's namespace and the processes the bench started in it.
type node struct {
	b          *bench
	ns         string
	proxy      string
	kubeconfig string
	http       *http.Client
	procs      []running
}

// newNode makes the i-th node for proxy, with its backends and servers up.
func (b *bench) newNode(ctx context.Context, i int, proxy string) (*node, error) {
	n := &node{b: b, ns: fmt.Sprintf("%s-n%d", b.ns, i), proxy: proxy}
	up, down := fmt.Sprintf("kcbup%d", i), fmt.Sprintf("kcbdn%d", i)
	apiAddr, nodeAddr := fmt.Sprintf("10.250.%d.1", i), fmt.Sprintf("10.250.%d.2", i)
	in := func(args ...string) []string { return append([]string{"ip", "netns", "exec", n.ns}, args...) }
	for _, c := range [][]string{
		{"ip", "netns", "add", n.ns},
		in("ip", "link", "set", "lo", "up"),
		{"ip", "-n", b.ns, "link", "add", up, "type", "veth", "peer", "name", down, "netns", n.ns},
		{"ip", "-n", b.ns, "addr", "add", apiAddr + "/30", "dev", up},
		{"ip", "-n", b.ns, "link", "set", up, "up"},
		in("ip", "addr", "add", nodeAddr+"/30", "dev", down),
		in("ip", "link", "set", down, "up"),
		in("ip", "link", "add", "pods", "type", "veth", "peer", "name", "pods-peer"),
		in("ip", "addr", "add", "10.244.0.1/16", "dev", "pods"),
		in("ip", "addr", "add", "10.244.0.2/16", "dev", "pods"),
		in("ip", "link", "set", "pods", "up"),
		in("ip", "link", "set", "pods-peer", "up"),
		in("ip", "addr", "add", nodeIP+"/32", "dev", "lo"),
		// Service addresses are local (as in progbench): a connection to
		// one without rules is refused at once instead of timing out, so
		// the 2 ms polling sees when rules appear and go.
		in("ip", "route", "add", "local", "10.96.0.0/16", "dev", "lo"),
		// The pod range is local too: kube-proxy's DNAT to any endpoint
		// reaches the bulk backend.
		in("ip", "route", "add", "local", "10.244.0.0/16", "dev", "lo"),
	} {
		if err := b.sh(c...); err != nil {
			n.close()
			return nil, err
		}
	}
	n.kubeconfig = filepath.Join(b.tmp, fmt.Sprintf("node%d.kubeconfig", i))
	if err := cluster.WriteKubeconfig(n.kubeconfig, strings.Replace(b.cp.URL, "127.0.0.1", apiAddr, 1), b.cp.AdminToken); err != nil {
		n.close()
		return nil, err
	}
	dial := cluster.DialContextIn(n.ns)
	// Short connect attempts: a SYN sent before the rule exists would wait
	// for its retransmission (1 s) and hide when the change landed.
	n.http = &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			ctx, cancel := context.WithTimeout(ctx, attempt)
			defer cancel()
			return dial(ctx, network, addr)
		}}}
	backend := filepath.Join(b.o.bin, "backend")
	for _, args := range [][]string{
		{backend, "--name", "A", "--tcp", "10.244.0.1:8080", "--udp", ""},
		{backend, "--name", "B", "--tcp", "10.244.0.2:8080", "--udp", ""},
		{backend, "--name", "bulk", "--tcp", fmt.Sprintf("0.0.0.0:%d", bulkPort), "--udp", ""},
	} {
		if _, err := n.start(io.Discard, pinned(serverCPU, args)...); err != nil {
			n.close()
			return nil, err
		}
	}
	if err := n.startTaxServers(); err != nil {
		n.close()
		return nil, err
	}
	for _, addr := range []string{"10.244.0.1:8080", "10.244.0.2:8080", fmt.Sprintf("10.244.9.9:%d", bulkPort)} {
		if err := b.until(ctx, 10*time.Second, func() bool { return n.accepts(addr) }); err != nil {
			n.close()
			return nil, fmt.Errorf("node %s: backend %s not up: %w", n.ns, addr, err)
		}
	}
	return n, nil
}

// close stops the node's processes and removes its namespace (and so the
// veth pair).
func (n *node) close() {
	for _, p := range n.procs {
		_ = p.cmd.Process.Kill()
		<-p.done
	}
	n.procs = nil
	_ = exec.Command("ip", "netns", "del", n.ns).Run()
}

// CPUs of the pinned parts (the node tax, and the backends always): the
// node's servers and the proxy on the first, clients on the last.
var serverCPU, clientCPU = 0, runtime.NumCPU() - 1

func pinned(cpu int, args []string) []string {
	return append([]string{"taskset", "-c", strconv.Itoa(cpu)}, args...)
}

// start runs args in the node's namespace.
func (n *node) start(out io.Writer, args ...string) (*exec.Cmd, error) {
	r, err := startIn(n.ns, out, args...)
	if err != nil {
		return nil, err
	}
	n.procs = append(n.procs, r)
	return r.cmd, nil
}

func (n *node) exited(cmd *exec.Cmd) <-chan struct{} {
	for _, r := range n.procs {
		if r.cmd == cmd {
			return r.done
		}
	}
	return nil
}

// startIn starts args in the namespace ns (ip netns exec and taskset exec
// them: the pid is the program's).
func startIn(ns string, out io.Writer, args ...string) (running, error) {
	cmd := exec.Command("ip", append([]string{"netns", "exec", ns}, args...)...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	// Pdeathsig fires when the thread that started the process exits, not
	// the process: the thread is held, locked, until the process is gone
	// (a thread a goroutine locks and leaves, as setns code does, would
	// otherwise take the daemon with it).
	started := make(chan error, 1)
	done := make(chan struct{})
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		_ = cmd.Wait()
		close(done)
	}()
	if err := <-started; err != nil {
		return running{}, err
	}
	return running{cmd, done}, nil
}

// running is a started process and a channel closed once it has exited.
type running struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// run runs args in the node's namespace to the end.
func (n *node) run(args ...string) (string, error) {
	out, err := exec.Command("ip", append([]string{"netns", "exec", n.ns}, args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// proc is a proxy under measurement: its log lines as they come, its
// memory and CPU from /proc.
type proc struct {
	cmd    *exec.Cmd
	mu     sync.Mutex
	seen   []string
	peakKB atomic.Int64
	stop   chan struct{}
}

// startProxy starts the node's proxy against the control plane.
func (n *node) startProxy() (*proc, error) {
	b := n.b
	var args []string
	switch n.proxy {
	case ours:
		args = []string{filepath.Join(b.o.bin, "kube-userspace-proxy"), "--kubeconfig", n.kubeconfig, "--hostname-override", "node",
			"--metrics-bind-address", "127.0.0.1:10249", "--healthz-bind-address", "127.0.0.1:10256"}
		if b.o.profile != "" || b.o.heap != "" || b.o.startProf != "" {
			args = append(args, "--profiling")
		}
		if b.o.logLevel != "" {
			args = append(args, "--log-level", b.o.logLevel)
		}
		if b.o.minPeriod != "" {
			args = append(args, "--min-sync-period", b.o.minPeriod)
		}
	case kubeNft, kubeIptable, kubeLegacy:
		// As the conformance lab runs it; --conntrack-max-per-core=0
		// leaves the machine-wide conntrack table size alone (it is not
		// per namespace). Everything else is kube-proxy's default.
		mode := "iptables"
		if n.proxy == kubeNft {
			mode = "nftables"
		}
		args = []string{b.kubeProxy, "--kubeconfig", n.kubeconfig, "--hostname-override", "node",
			"--proxy-mode", mode, "--conntrack-max-per-core=0",
			"--metrics-bind-address", "127.0.0.1:10249", "--healthz-bind-address", "127.0.0.1:10256", "--v=2"}
		if n.proxy == kubeLegacy {
			dir, err := b.legacyPath()
			if err != nil {
				return nil, err
			}
			// env execs kube-proxy: the pid stays the program's.
			args = append([]string{"env", "PATH=" + dir + ":" + os.Getenv("PATH")}, args...)
		}
	default:
		return nil, fmt.Errorf("unknown proxy %q", n.proxy)
	}
	pr, pw := io.Pipe()
	logFile, err := os.Create(filepath.Join(b.tmp, fmt.Sprintf("%s-%d.log", n.proxy, len(n.procs))))
	if err != nil {
		return nil, err
	}
	cmd, err := n.start(io.MultiWriter(pw, logFile), args...)
	if err != nil {
		logFile.Close()
		return nil, err
	}
	p := &proc{cmd: cmd, stop: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			p.mu.Lock()
			p.seen = append(p.seen, sc.Text())
			p.mu.Unlock()
		}
	}()
	go func() { // the peak of RSS, sampled: VmHWM counts the whole life
		t := time.NewTicker(50 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				if kb := p.status("VmRSS"); kb > p.peakKB.Load() {
					p.peakKB.Store(kb)
				}
			case <-p.stop:
				return
			}
		}
	}()
	go func() {
		<-n.exited(cmd)
		p.mu.Lock()
		p.seen = append(p.seen, fmt.Sprintf("(%s exited: %v)", n.proxy, cmd.ProcessState))
		p.mu.Unlock()
		pw.Close()
		logFile.Close()
		close(p.stop)
	}()
	return p, nil
}

// kill kills p with -9 and waits until it is gone.
func (n *node) kill(p *proc) {
	_ = p.cmd.Process.Kill()
	<-n.exited(p.cmd)
}

// cleanup removes the rules the node's proxy left (its own --cleanup).
func (n *node) cleanup() error {
	bin := n.b.kubeProxy
	if n.proxy == ours {
		bin = filepath.Join(n.b.o.bin, "kube-userspace-proxy")
	}
	_, err := n.run(bin, "--cleanup")
	return err
}

func (p *proc) wait(ctx context.Context, text string, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		p.mu.Lock()
		found := slices.ContainsFunc(p.seen, func(l string) bool { return strings.Contains(l, text) })
		p.mu.Unlock()
		if found {
			return nil
		}
		select {
		case <-p.stop:
			return fmt.Errorf("the proxy exited before %q:\n%s", text, p.tail())
		case <-time.After(5 * time.Millisecond):
		}
	}
	return fmt.Errorf("no %q within %s:\n%s", text, limit, p.tail())
}

func (p *proc) tail() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.seen[max(0, len(p.seen)-20):], "\n")
}

func (p *proc) status(field string) int64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb
		}
	}
	return 0
}

func (p *proc) rss() int64 { return p.status("VmRSS") }
func (p *proc) peak() int64 {
	p.peakKB.Store(max(p.peakKB.Load(), p.rss()))
	v := p.peakKB.Load()
	p.peakKB.Store(p.rss()) // the next peak is measured from here
	return v
}

// cpu is the proxy's user+system CPU time so far, in seconds.
func (p *proc) cpu() float64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	st := string(data)
	f := strings.Fields(st[strings.LastIndexByte(st, ')')+2:])
	u, _ := strconv.ParseFloat(f[11], 64)
	s, _ := strconv.ParseFloat(f[12], 64)
	return (u + s) / 100 // clock ticks (USER_HZ)
}

// attempt bounds one connection attempt of a probe: the resolution of the
// latencies measured.
const attempt = 20 * time.Millisecond

// accepts reports whether a TCP connection to addr (in the node) is
// accepted: a listener (ours) or an endpoint (kube-proxy's DNAT) serves it.
func (n *node) accepts(addr string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), attempt)
	defer cancel()
	c, err := cluster.DialContextIn(n.ns)(ctx, "tcp", addr)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// syncedSince says whether the node's proxy finished a sync after t: its
// kubeproxy_sync_proxy_rules_last_timestamp_seconds (kube-proxy's metric,
// and ours by the same name) is at or after t.
func (n *node) syncedSince(t time.Time) bool {
	c := &http.Client{Timeout: time.Second, Transport: &http.Transport{DialContext: cluster.DialContextIn(n.ns)}}
	resp, err := c.Get("http://127.0.0.1:10249/metrics")
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") {
			continue
		}
		f := strings.Fields(line)
		if v, err := strconv.ParseFloat(f[len(f)-1], 64); err == nil && v >= float64(t.UnixNano())/1e9 {
			return true
		}
	}
	return false
}

// answer is the name of the backend that answers http://addr/, or "".
func (n *node) answer(addr string) string {
	resp, err := n.http.Get("http://" + addr + "/")
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	name, _, _ := strings.Cut(string(body), " ")
	return name
}

// legacyPath is a directory whose iptables, ip6tables and their -save and
// -restore are the legacy (x_tables) binaries, for kubeLegacy's PATH.
func (b *bench) legacyPath() (string, error) {
	multi, err := exec.LookPath("xtables-legacy-multi")
	if err != nil {
		return "", fmt.Errorf("%s needs the legacy iptables binaries (Debian: iptables): %w", kubeLegacy, err)
	}
	dir := filepath.Join(b.tmp, "legacy-bin")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	for _, name := range []string{"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore"} {
		link := filepath.Join(dir, name)
		if _, err := os.Lstat(link); err == nil {
			continue
		}
		if err := os.Symlink(multi, link); err != nil {
			return "", err
		}
	}
	return dir, nil
}
