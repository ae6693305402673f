// Command handoverbench measures a handover (docs/operations.md, Upgrades):
// a daemon serving N ClusterIP service ports and carrying C live
// connections, a successor started beside it. It reports how long the
// successor takes from its start to serving (the old one let go), how long
// the live connections take to move, and the accept pause: the slowest
// connection of a prober that opens one every millisecond through a
// ClusterIP meanwhile, against its median before the handover. Every live
// connection must still echo afterwards.
//
// The node runs as a kubeadm node runs us, local-traffic detection on
// (--cluster-cidr): the clients are a pod of the node and the echo server
// another, routed through the node, so that the backend sees the client's
// address on most connections; every fifth Service has the annotation that
// keeps the node's, so a share of them go through the plain dial.
//
// It needs root. It creates its own network namespaces (the node, which
// it re-runs itself inside, a client pod and a backend pod) and deletes
// them at the end (also when interrupted).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

func main() {
	sizes := flag.String("n", "1000,10000", "comma-separated service port counts")
	conns := flag.String("c", "5000", "live connections per size (comma-separated, one per size or one for all)")
	daemon := flag.String("daemon", "bin/kube-userspace-proxy", "the daemon binary")
	runs := flag.Int("runs", 3, "runs per size; the median is reported, with the range")
	crash := flag.Bool("crash", false, "instead of a handover, kill -9 the serving process of a daemon run under its keeper (kube-userspace-proxy keep) and measure its restart")
	inner := flag.Bool("inner", false, "internal: already inside the namespace")
	flag.StringVar(&pods, "pods", "", "internal: the pods' namespaces' prefix")
	flag.Parse()
	if !*inner {
		os.Exit(outer())
	}
	// The live connections' two ends and the echo server's are ours.
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err == nil {
		lim.Cur = lim.Max
		_ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim)
	}
	ns := strings.Split(*sizes, ",")
	cs := strings.Split(*conns, ",")
	if *crash {
		fmt.Println("| service ports | live connections (cut by the crash) | kill -9 → serving | a fresh start → serving | longest wait of a new connection (− median before) | new connections refused | cut |")
		fmt.Println("|---:|---:|---:|---:|---:|---:|---:|")
	} else {
		fmt.Println("| service ports | live connections (backend sees the client / the node) | successor start → serving | connections moved in | accept pause (slowest connect during − median before) | connections failed |")
		fmt.Println("|---:|---:|---:|---:|---:|---:|")
	}
	for i, f := range ns {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			fatal(err)
		}
		c, err := strconv.Atoi(strings.TrimSpace(cs[min(i, len(cs)-1)]))
		if err != nil {
			fatal(err)
		}
		var all []result
		for r := 0; r < *runs; r++ {
			measureRun := measure
			if *crash {
				measureRun = measureCrash
			}
			res, err := measureRun(*daemon, n, c)
			if err != nil {
				fatal(err)
			}
			if *crash {
				fmt.Fprintf(os.Stderr, "n=%d c=%d run %d: serving %v after kill -9 (a fresh start %v), longest wait %v (median connect %v), %d refused, %d failed, %d live cut\n",
					n, c, r+1, res.serving, res.fresh, res.pause, res.median, res.refused, res.failed, res.cutLive)
			} else {
				fmt.Fprintf(os.Stderr, "n=%d c=%d (%d seeing the client, %d the node) run %d: serving after %v, connections moved in %v, pause %v (median connect %v), %d failed\n",
					n, c, res.seesClient, res.seesNode, r+1, res.serving, res.moved, res.pause, res.median, res.failed)
			}
			all = append(all, res)
		}
		worst := func(f func(r result) int) int {
			return f(slices.MaxFunc(all, func(a, b result) int { return f(a) - f(b) }))
		}
		if *crash {
			fmt.Printf("| %d | %d (%d) | %s | %s | %s | %d | %d |\n", n, c, worst(func(r result) int { return r.cutLive }),
				spread(all, func(r result) time.Duration { return r.serving }),
				spread(all, func(r result) time.Duration { return r.fresh }),
				spread(all, func(r result) time.Duration { return r.pause }),
				worst(func(r result) int { return r.refused }), worst(func(r result) int { return r.failed - r.refused }))
			continue
		}
		fmt.Printf("| %d | %d (%d / %d) | %s | %s | %s | %d |\n", n, c, all[0].seesClient, all[0].seesNode,
			spread(all, func(r result) time.Duration { return r.serving }),
			spread(all, func(r result) time.Duration { return r.moved }),
			spread(all, func(r result) time.Duration { return r.pause }),
			worst(func(r result) int { return r.failed }))
	}
}

type result struct {
	serving, moved, pause, median time.Duration
	failed                        int
	// The live connections whose backend saw the client pod, and the
	// node.
	seesClient, seesNode int
	// -crash: a fresh start's time to serve, the probes refused (of
	// failed), the live connections cut.
	fresh            time.Duration
	refused, cutLive int
}

func spread(rs []result, f func(result) time.Duration) string {
	v := make([]time.Duration, len(rs))
	for i, r := range rs {
		v[i] = f(r)
	}
	slices.Sort(v)
	ms := func(d time.Duration) string { return strconv.FormatFloat(float64(d)/1e6, 'f', 1, 64) }
	if len(v) == 1 {
		return ms(v[0]) + " ms"
	}
	return fmt.Sprintf("%s ms (%s–%s)", ms(v[len(v)/2]), ms(v[0]), ms(v[len(v)-1]))
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "handoverbench:", err)
	os.Exit(1)
}

// The lab: the node (10.250.1.1 towards the client pod 10.250.1.2,
// 10.250.2.1 towards the backend pod 10.250.2.2), the pods in the
// cluster CIDR, each pod's default route through the node.
const (
	clusterCIDR = "10.250.0.0/16"
	clientIP    = "10.250.1.2"
	backendIP   = "10.250.2.2"
	echoAddr    = backendIP + ":9000"
	// The proxy port range: room beside 10 000 listeners for the source
	// NAT's ports of the live connections and of the prober's 1 000
	// connections a second; the node's own ephemeral ports above it.
	proxyPortRange = "33000-59999"
)

// pods is the prefix of the pods' namespaces (-pods), set by outer.
var pods string

func clientNS() string  { return pods + "-client" }
func backendNS() string { return pods + "-backend" }

// outer creates the namespaces, runs itself inside the node's and removes
// them.
func outer() int {
	ns := fmt.Sprintf("kuphandover-%d", os.Getpid())
	pods = ns
	for _, n := range []string{ns, clientNS(), backendNS()} {
		if out, err := exec.Command("ip", "netns", "add", n).CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "handoverbench: ip netns add (needs root): %v %s\n", err, out)
			return 1
		}
		defer exec.Command("ip", "netns", "del", n).Run()
	}
	in := func(n string, args ...string) []string { return append([]string{"ip", "netns", "exec", n}, args...) }
	for _, args := range [][]string{
		in(ns, "ip", "link", "set", "lo", "up"),
		in(ns, "ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth1"),
		in(ns, "ip", "addr", "add", "10.250.0.1/24", "dev", "eth0"),
		in(ns, "ip", "link", "set", "eth0", "up"),
		in(ns, "ip", "link", "set", "eth1", "up"),
		in(ns, "ip", "route", "add", "default", "via", "10.250.0.2"),
		in(ns, "ip", "route", "add", "local", "10.96.0.0/16", "dev", "lo"),
		in(ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"),
		in(ns, "sysctl", "-qw", "net.ipv4.ip_local_port_range=60000 64999"),
		in(ns, "ip", "link", "add", "vc", "type", "veth", "peer", "name", "eth0", "netns", clientNS()),
		in(ns, "ip", "addr", "add", "10.250.1.1/24", "dev", "vc"),
		in(ns, "ip", "link", "set", "vc", "up"),
		in(ns, "ip", "link", "add", "vb", "type", "veth", "peer", "name", "eth0", "netns", backendNS()),
		in(ns, "ip", "addr", "add", "10.250.2.1/24", "dev", "vb"),
		in(ns, "ip", "link", "set", "vb", "up"),
		in(clientNS(), "ip", "link", "set", "lo", "up"),
		in(clientNS(), "ip", "addr", "add", clientIP+"/24", "dev", "eth0"),
		in(clientNS(), "ip", "link", "set", "eth0", "up"),
		in(clientNS(), "ip", "route", "add", "default", "via", "10.250.1.1"),
		// The prober closes 1 000 connections a second to one address: its
		// ports would all sit in TIME_WAIT within seconds, and its
		// connects fail with EADDRNOTAVAIL — the bench's shortage, not
		// the proxy's.
		in(clientNS(), "sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"),
		in(clientNS(), "sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65000"),
		in(backendNS(), "ip", "link", "set", "lo", "up"),
		in(backendNS(), "ip", "addr", "add", backendIP+"/24", "dev", "eth0"),
		in(backendNS(), "ip", "link", "set", "eth0", "up"),
		in(backendNS(), "ip", "route", "add", "default", "via", "10.250.2.1"),
		// The same for the node's dials to the echo server, which close
		// first: their ports come round every few seconds.
		in(ns, "sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"),
	} {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "handoverbench: %v: %v %s\n", args, err, out)
			return 1
		}
	}
	self, _ := os.Executable()
	cmd := exec.Command("ip", append([]string{"netns", "exec", ns, self, "-inner", "-pods", pods}, os.Args[1:]...)...)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "handoverbench:", err)
		return 1
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			return 1
		}
		return 0
	case <-sig:
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
		return 130
	}
}

func clusterIP(i int) string { return fmt.Sprintf("10.96.%d.%d", i/250, i%250+1) }

// nodeSource says whether Service i keeps the node's address at its
// backend (every fifth, by the annotation).
func nodeSource(i int) bool { return i%5 == 0 }

func manifests(n int) string {
	var b strings.Builder
	for i := 0; i < n; i++ {
		annotations := ""
		if nodeSource(i) {
			annotations = ", annotations: {kube-userspace-proxy.io/backend-source-address: node}"
		}
		fmt.Fprintf(&b, `---
apiVersion: v1
kind: Service
metadata: {name: s%[1]d, namespace: bench%[4]s}
spec: {clusterIP: %[2]s, ports: [{port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: s%[1]d, namespace: bench, labels: {kubernetes.io/service-name: s%[1]d}}
addressType: IPv4
ports: [{port: 9000}]
endpoints: [{addresses: [%[3]s]}]
`, i, clusterIP(i), backendIP, annotations)
	}
	return b.String()
}

// echoServer echoes every connection on the backend pod's port 9000 and
// counts whose address it saw.
type echoServer struct {
	ln             net.Listener
	client, others atomic.Int64
}

func startEcho() (*echoServer, error) {
	e := &echoServer{}
	err := cluster.InNetns(backendNS(), func() error {
		var err error
		e.ln, err = net.Listen("tcp", echoAddr)
		return err
	})
	if err != nil {
		return nil, err
	}
	go func() {
		for {
			c, err := e.ln.Accept()
			if err != nil {
				return
			}
			if c.RemoteAddr().(*net.TCPAddr).IP.String() == clientIP {
				e.client.Add(1)
			} else {
				e.others.Add(1)
			}
			// Not io.Copy(c, c): TCPConn.ReadFrom splices through a pipe
			// held for the whole connection, two descriptors more each.
			go func() {
				defer c.Close()
				_, _ = io.CopyBuffer(struct{ io.Writer }{c}, struct{ io.Reader }{c}, make([]byte, 512))
			}()
		}
	}()
	return e, nil
}

// proc is a daemon and its log.
type proc struct {
	cmd *exec.Cmd
	mu  sync.Mutex
	log strings.Builder
}

func (p *proc) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.log.Write(b)
}

func (p *proc) has(s string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Contains(p.log.String(), s)
}

func start(daemon, dir string, port int, keep bool) (*proc, error) {
	p := &proc{}
	var args []string
	if keep {
		args = []string{"keep"}
	}
	p.cmd = exec.Command(daemon, append(args, "--manifests", filepath.Join(dir, "m.yaml"), "--min-sync-period", "0",
		"--handover-socket", filepath.Join(dir, "run", "handover.sock"), "--admin-socket", filepath.Join(dir, fmt.Sprintf("admin-%d.sock", port)),
		"--shutdown-grace", "1s", "--tcp-idle-timeout", "0", "--cluster-cidr", clusterCIDR, "--proxy-port-range", proxyPortRange)...)
	p.cmd.Stdout, p.cmd.Stderr = p, p
	return p, p.cmd.Start()
}

func (p *proc) stop() {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	_ = p.cmd.Wait()
}

func waitUntil(d time.Duration, what string, cond func() bool) error {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: not within %v", what, d)
		}
		time.Sleep(2 * time.Millisecond)
	}
	return nil
}

// exchange is one echo on c.
func exchange(c net.Conn) error {
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		return err
	}
	b := make([]byte, 4)
	if _, err := io.ReadFull(c, b); err != nil {
		return err
	}
	if string(b) != "ping" {
		return errors.New("wrong echo")
	}
	return nil
}

func measure(daemon string, n, c int) (result, error) {
	var res result
	lab, err := serving(daemon, n, c, false)
	defer lab.close()
	if err != nil {
		return res, err
	}
	old, live := lab.daemon, lab.live
	res.seesClient, res.seesNode = lab.seesClient, lab.seesNode
	dir := lab.dir

	pr := startProber(clusterIP(n/2+1) + ":80") // a Service whose backend sees the client
	time.Sleep(time.Second)                     // the prober's baseline
	t0 := time.Now()
	next, err := start(daemon, dir, 2, false)
	if err != nil {
		pr.stop()
		return res, err
	}
	defer next.stop()
	err = waitUntil(2*time.Minute, "the successor serving", func() bool { return next.has("Took over: the predecessor serves nothing more") })
	res.serving = time.Since(t0)
	if err == nil {
		err = waitUntil(2*time.Minute, "the connections moved", func() bool { return next.has("Adopted the predecessor's connections") })
		res.moved = time.Since(t0) - res.serving
	}
	time.Sleep(time.Second)
	probes := pr.stop()
	if err != nil {
		return res, fmt.Errorf("%w\nold:\n%s\nnew:\n%s", err, old.log.String(), next.log.String())
	}
	tally(&res, probes, t0)
	for i, l := range live {
		if err := exchange(l); err != nil {
			return res, fmt.Errorf("live connection %d after the handover: %w", i, err)
		}
	}
	return res, nil
}

// benchLab is a daemon serving n service ports, under its keeper or not,
// and c live connections through it.
type benchLab struct {
	dir                  string
	echo                 *echoServer
	daemon               *proc
	fresh                time.Duration // its start → serving
	live                 []net.Conn
	seesClient, seesNode int // the live connections' backends saw the client pod, or the node
}

// serving starts a benchLab; close it whatever the error.
func serving(daemon string, n, c int, keep bool) (*benchLab, error) {
	l := &benchLab{}
	var err error
	if l.dir, err = os.MkdirTemp("", "handoverbench"); err != nil {
		return l, err
	}
	if err := os.WriteFile(filepath.Join(l.dir, "m.yaml"), []byte(manifests(n)), 0o644); err != nil {
		return l, err
	}
	if l.echo, err = startEcho(); err != nil {
		return l, err
	}
	started := time.Now()
	if l.daemon, err = start(daemon, l.dir, 1, keep); err != nil {
		return l, err
	}
	reachable := func(i int) bool {
		conn, err := dialClient(clusterIP(i)+":80", time.Second)
		if err != nil {
			return false
		}
		defer conn.Close()
		return exchange(conn) == nil
	}
	if err := waitUntil(2*time.Minute, "serving", func() bool { return reachable(n-1) && reachable(0) }); err != nil {
		return l, err
	}
	l.fresh = time.Since(started)
	l.echo.client.Store(0)
	l.echo.others.Store(0)
	l.live, err = dialLive(n, c)
	l.seesClient, l.seesNode = int(l.echo.client.Load()), int(l.echo.others.Load())
	return l, err
}

// close stops everything the lab started and removes what the daemon
// put on the node.
func (l *benchLab) close() {
	for _, c := range l.live {
		c.Close()
	}
	if l.daemon != nil {
		l.daemon.stop()
		_ = exec.Command(l.daemon.cmd.Path, "--cleanup").Run()
	}
	if l.echo != nil {
		l.echo.ln.Close()
	}
	if l.dir != "" {
		os.RemoveAll(l.dir)
	}
}

// measureCrash is measure's -crash: a daemon serving n service ports under
// its keeper, c live connections, and its serving process killed with -9
// while the prober opens a connection every millisecond.
func measureCrash(daemon string, n, c int) (result, error) {
	var res result
	lab, err := serving(daemon, n, c, true)
	defer lab.close()
	if err != nil {
		return res, err
	}
	k, live := lab.daemon, lab.live
	res.fresh = lab.fresh
	worker, err := childOf(k.cmd.Process.Pid)
	if err != nil {
		return res, err
	}
	pr := startProber(clusterIP(n/2+1) + ":80")
	time.Sleep(time.Second) // the prober's baseline
	t0 := time.Now()
	if err := syscall.Kill(worker, syscall.SIGKILL); err != nil {
		pr.stop()
		return res, err
	}
	err = waitUntil(2*time.Minute, "the next worker serving", func() bool { return k.has("Took over: the predecessor serves nothing more") })
	res.serving = time.Since(t0)
	time.Sleep(time.Second)
	probes := pr.stop()
	if err != nil {
		return res, fmt.Errorf("%w\n%s", err, k.log.String())
	}
	tally(&res, probes, t0)
	for _, p := range probes {
		if errors.Is(p.err, syscall.ECONNREFUSED) {
			res.refused++
		}
	}
	for _, l := range live {
		if exchange(l) != nil {
			res.cutLive++
		}
	}
	return res, nil
}

// childOf is the one child of the process pid (a keeper's worker).
func childOf(pid int) (int, error) {
	files, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	var kids []string
	for _, f := range files {
		b, _ := os.ReadFile(f)
		kids = append(kids, strings.Fields(string(b))...)
	}
	if len(kids) != 1 {
		return 0, fmt.Errorf("the keeper %d has children %v, want its one worker", pid, kids)
	}
	return strconv.Atoi(kids[0])
}

// dialClient connects from the client pod.
func dialClient(addr string, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return cluster.DialContextIn(clientNS())(ctx, "tcp4", addr)
}

// dialLive opens c connections over the first n ClusterIPs, each with one
// echo done; on an error, those opened so far.
func dialLive(n, c int) ([]net.Conn, error) {
	live := make([]net.Conn, 0, c)
	for i := 0; i < c; i++ {
		conn, err := dialClient(clusterIP(i%n)+":80", 5*time.Second)
		if err == nil {
			err = exchange(conn)
		}
		if err != nil {
			fds, _ := os.ReadDir("/proc/self/fd")
			var lim syscall.Rlimit
			_ = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim)
			return live, fmt.Errorf("live connection %d (%d descriptors open, limit %d): %w", i, len(fds), lim.Cur, err)
		}
		live = append(live, conn)
	}
	return live, nil
}

// probe is one of the prober's connections: when it began, how long its
// echo took, and how it failed.
type probe struct {
	at  time.Time
	d   time.Duration
	err error
}

// prober makes one new connection a millisecond to one address, until stop.
type prober struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	probes []probe
}

func startProber(addr string) *prober {
	ctx, cancel := context.WithCancel(context.Background())
	p := &prober{cancel: cancel}
	p.wg.Go(func() {
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for ctx.Err() == nil {
			<-tick.C
			t0 := time.Now()
			conn, err := dialClient(addr, 5*time.Second)
			if err == nil {
				err = exchange(conn)
				conn.Close()
			}
			p.mu.Lock()
			p.probes = append(p.probes, probe{t0, time.Since(t0), err})
			p.mu.Unlock()
		}
	})
	return p
}

// stop ends the prober and returns its probes.
func (p *prober) stop() []probe {
	p.cancel()
	p.wg.Wait()
	return p.probes
}

// tally puts into res what the probes saw of a handover begun at t0: the
// failures, the median connection before it, and the longest pause beyond
// that median during it.
func tally(res *result, probes []probe, t0 time.Time) {
	var before, during []time.Duration
	for _, p := range probes {
		switch {
		case p.err != nil:
			if res.failed < 3 {
				fmt.Fprintf(
					os.Stderr,
					"probe at %v (the handover or kill at 0), failed after %v: %v\n",
					p.at.Sub(t0).Round(time.Millisecond),
					p.d.Round(time.Millisecond),
					p.err,
				)
			}
			res.failed++
		case p.at.Add(p.d).Before(t0): // over before the event; one that spans it waited through it
			before = append(before, p.d)
		default:
			during = append(during, p.d)
		}
	}
	slices.Sort(before)
	if len(before) > 0 {
		res.median = before[len(before)/2]
	}
	if len(during) > 0 {
		res.pause = slices.Max(during) - res.median
	}
}
