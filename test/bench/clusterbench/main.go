// Command clusterbench is make bench-cluster: the daemon against the real
// control plane of test/cluster with N Services of M endpoints each (one
// EndpointSlice each), in a network namespace of its own. It measures what a
// node daemon at scale is judged by: memory while the objects stream in and
// when steady, start → serving, one change's latency from the API call until
// traffic reflects it, and a churn of endpoint changes (daemon CPU, lag).
// Root; it removes its namespace and processes on exit.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

type options struct {
	n, m      int
	churn     time.Duration
	page      time.Duration // the live page polled once serving, for its memory
	rate      int
	runs      int
	bin       string
	repo      string
	write     string
	minPeriod string
	profile   string
	heap      string
	startProf string
	logLevel  string
	logs      string
}

func main() {
	var o options
	flag.IntVar(&o.n, "n", 10000, "Services (one TCP port, one EndpointSlice each)")
	flag.IntVar(&o.m, "m", 5, "endpoints per Service")
	flag.DurationVar(&o.churn, "churn", 60*time.Second, "how long the endpoint churn lasts")
	flag.IntVar(&o.rate, "rate", 50, "endpoint changes per second during the churn")
	flag.IntVar(&o.runs, "runs", 5, "add/change/delete latencies measured")
	flag.StringVar(&o.bin, "bin", "bin", "where kube-userspace-proxy and backend are")
	flag.StringVar(&o.repo, "repo", ".", "the repository (for the control plane's module)")
	flag.StringVar(&o.write, "write", "", "write the table into this Markdown file (between bench-cluster markers)")
	flag.StringVar(&o.minPeriod, "min-sync-period", "", "pass --min-sync-period to the daemon (default: the daemon's)")
	flag.StringVar(&o.heap, "heap", "", "save the daemon's heap profile (in use, after a GC) when it serves, steady, to this file")
	flag.StringVar(&o.startProf, "start-profile", "", "write a CPU profile of the daemon's first 3 s after its restart's caches synced to this file")
	flag.StringVar(&o.logLevel, "log-level", "", "pass --log-level to the daemon (debug: each sync's and rule write's duration)")
	flag.StringVar(&o.logs, "logs", "", "keep the daemons' logs in this directory")
	flag.StringVar(&o.profile, "profile", "", "write a CPU profile of the daemon during the churn (its first 30 s) to this file")
	flag.DurationVar(&o.page, "page", 30*time.Second, "how long the live page's requests are made once serving, for its memory (0: not)")
	flag.Parse()
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "clusterbench needs root (a network namespace)")
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	b := &bench{o: o, ns: fmt.Sprintf("kcb%d", os.Getpid())}
	err := b.run(ctx)
	b.cleanup()
	if err != nil {
		fmt.Fprintln(os.Stderr, "clusterbench:", err)
		os.Exit(1)
	}
}

type bench struct {
	o      options
	ns     string
	tmp    string
	cp     *cluster.ControlPlane
	client *kubernetes.Clientset
	http   *http.Client
	procs  []running
	rows   [][2]string

	// seen is when this process's watch saw the last event of each object
	// ("slice/name", "service/name"): about when the daemon's did.
	seenMu sync.Mutex
	seen   map[string]time.Time
}

func (b *bench) sh(args ...string) error {
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %w: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

func (b *bench) cleanup() {
	for _, p := range b.procs {
		_ = p.cmd.Process.Kill()
		<-p.done
	}
	if b.cp != nil {
		b.cp.Stop()
	}
	_ = exec.Command("ip", "netns", "del", b.ns).Run()
	if b.tmp != "" {
		if b.o.logs != "" {
			logs, _ := filepath.Glob(filepath.Join(b.tmp, "daemon-*.log"))
			_ = os.MkdirAll(b.o.logs, 0o755)
			for _, l := range logs {
				_ = os.Rename(l, filepath.Join(b.o.logs, filepath.Base(l)))
			}
		}
		os.RemoveAll(b.tmp)
	}
}

func (b *bench) record(what, value string) {
	b.rows = append(b.rows, [2]string{what, value})
	fmt.Printf("%-70s %s\n", what, value)
}

func (b *bench) run(ctx context.Context) error {
	var err error
	if b.tmp, err = os.MkdirTemp("", "clusterbench"); err != nil {
		return err
	}
	// The node: loopback for the API server, an interface (a veth pair: no
	// dummy driver everywhere) holding the two real backends' addresses and
	// the pod range the endpoints use.
	for _, c := range [][]string{
		{"ip", "netns", "add", b.ns},
		{"ip", "netns", "exec", b.ns, "ip", "link", "set", "lo", "up"},
		{"ip", "netns", "exec", b.ns, "ip", "link", "add", "pods", "type", "veth", "peer", "name", "pods-peer"},
		{"ip", "netns", "exec", b.ns, "ip", "addr", "add", "10.244.0.1/16", "dev", "pods"},
		{"ip", "netns", "exec", b.ns, "ip", "addr", "add", "10.244.0.2/16", "dev", "pods"},
		{"ip", "netns", "exec", b.ns, "ip", "link", "set", "pods", "up"},
		{"ip", "netns", "exec", b.ns, "ip", "link", "set", "pods-peer", "up"},
		// Service addresses are local here (as in progbench): a connection
		// to one without rules is refused at once instead of timing out,
		// so the 2 ms polling sees when rules appear and go; a route
		// through the pods' link left 20 ms (one attempt) of doubt.
		{"ip", "netns", "exec", b.ns, "ip", "route", "add", "local", "10.96.0.0/16", "dev", "lo"},
	} {
		if err := b.sh(c...); err != nil {
			return err
		}
	}
	bins, err := cluster.BinDir(b.o.repo, os.Stderr)
	if err != nil {
		return err
	}
	if b.cp, err = cluster.Start(ctx, cluster.Options{BinDir: bins, Dir: b.tmp, Netns: b.ns}); err != nil {
		return err
	}
	rc := &rest.Config{Host: b.cp.URL, BearerToken: b.cp.AdminToken, TLSClientConfig: rest.TLSClientConfig{Insecure: true},
		Dial: cluster.DialContextIn(b.ns), QPS: 2000, Burst: 4000}
	if b.client, err = kubernetes.NewForConfig(rc); err != nil {
		return err
	}
	// Short connect attempts: a SYN sent before the rule exists would wait
	// for its retransmission (1 s) and hide when the change landed.
	dial := cluster.DialContextIn(b.ns)
	b.http = &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			ctx, cancel := context.WithTimeout(ctx, attempt)
			defer cancel()
			return dial(ctx, network, addr)
		}}}
	for _, be := range []struct{ name, addr string }{{"A", "10.244.0.1:8080"}, {"B", "10.244.0.2:8080"}} {
		if _, err := b.start(io.Discard, filepath.Join(b.o.bin, "backend"), "--name", be.name, "--tcp", be.addr, "--udp", ""); err != nil {
			return err
		}
	}
	if _, err := b.client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "bench"}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	if _, err := b.client.CoreV1().Nodes().Create(ctx, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node"}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	fmt.Printf("clusterbench: %d Services × %d endpoints; control plane up\n", b.o.n, b.o.m)

	// 1. The daemon watches while the objects stream in.
	d, err := b.daemon(ctx)
	if err != nil {
		return err
	}
	if err := d.wait(ctx, "msg=Started", time.Minute); err != nil {
		return err
	}
	cpu0 := d.cpu()
	start := time.Now()
	if err := b.createAll(ctx); err != nil {
		return err
	}
	created := time.Since(start)
	last := fmt.Sprintf("10.96.%d.%d:80", (b.o.n)/250, (b.o.n)%250+1) // the last Service's ClusterIP
	if err := b.until(ctx, 5*time.Minute, func() bool { return b.accepts(last) }); err != nil {
		return fmt.Errorf("the last Service (%s) never served: %w\n%s", last, err, d.tail())
	}
	b.record(fmt.Sprintf("objects created (%d Services, %d slices, %d endpoints)", b.o.n, b.o.n, b.o.n*b.o.m), secs(created))
	b.record("served after the last object was created", secs(time.Since(start)-created))
	b.record("daemon CPU while the objects streamed in", fmt.Sprintf("%.1f s", d.cpu()-cpu0))
	b.record("daemon RSS peak while the objects streamed in", mib(d.peak()))
	time.Sleep(5 * time.Second)
	steady := d.rss()
	b.record("daemon RSS when serving, steady", mib(steady))
	if b.o.page > 0 {
		// The live page open for a while, then closed: its RSS against
		// the steady figure without it.
		d.peak()
		polls, err := b.pollPage(ctx, b.o.page)
		if err != nil {
			return fmt.Errorf("the live page's requests: %w", err)
		}
		peak, after := d.peak(), d.rss()
		b.record(fmt.Sprintf("live page polling for %s (%d refreshes): daemon RSS peak, and ÷ steady", b.o.page, polls),
			fmt.Sprintf("%s (%.2f×)", mib(peak), float64(peak)/float64(steady)))
		b.record("live page polling: daemon RSS at its end, and ÷ steady", fmt.Sprintf("%s (%.2f×)", mib(after), float64(after)/float64(steady)))
	}
	if b.o.heap != "" {
		if err := b.save("/debug/pprof/heap?gc=1", b.o.heap, time.Minute); err != nil {
			return fmt.Errorf("heap profile: %w", err)
		}
		// The text form ends with the runtime's MemStats: heap goal, stacks.
		if err := b.save("/debug/pprof/heap?debug=1", b.o.heap+".txt", time.Minute); err != nil {
			return fmt.Errorf("heap profile: %w", err)
		}
	}

	// 2. Start → serving, with everything in place (after a kill -9: the
	// rules and reserved ports of the dead daemon are still there).
	_ = d.cmd.Process.Kill()
	<-b.exited(d.cmd)
	t0 := time.Now()
	d, err = b.daemon(ctx)
	if err != nil {
		return err
	}
	if err := d.wait(ctx, "msg=Started", 5*time.Minute); err != nil {
		return err
	}
	listed := time.Since(t0)
	startProfiled := make(chan error, 1)
	if b.o.startProf != "" {
		go func() { startProfiled <- b.save("/debug/pprof/profile?seconds=3", b.o.startProf, time.Minute) }()
	} else {
		startProfiled <- nil
	}
	if err := d.wait(ctx, "Listening", 5*time.Minute); err != nil {
		return err
	}
	if err := b.until(ctx, time.Minute, func() bool { return b.accepts(last) }); err != nil {
		return err
	}
	serving := time.Since(t0)
	if err := <-startProfiled; err != nil {
		return fmt.Errorf("start profile: %w", err)
	}
	b.record("start → caches synced (the initial LIST and watch)", secs(listed))
	b.record("start → serving every Service (after kill -9)", secs(serving))
	b.record("start → serving, beyond the initial LIST", secs(serving-listed))
	b.record("daemon RSS peak from start to serving", mib(d.peak()))

	// 3. One change at a time, from the API call and from the watch event
	// (this process's own watch: about when the daemon's saw it).
	if b.o.runs > 0 {
		if err := b.watchEvents(ctx); err != nil {
			return err
		}
	}
	var adds, changes, deletes [2][]time.Duration
	for i := 0; i < b.o.runs; i++ {
		a, c, del, err := b.oneChange(ctx, i)
		if err != nil {
			return err
		}
		for k := range 2 {
			adds[k], changes[k], deletes[k] = append(adds[k], a[k]), append(changes[k], c[k]), append(deletes[k], del[k])
		}
	}
	if b.o.runs > 0 {
		b.record("add a Service and its slice → traffic, from the API call (median / max)", medMax(adds[0]))
		b.record("add a Service and its slice → traffic, from the slice's watch event", medMax(adds[1]))
		b.record("change a slice's endpoint → traffic, from the API call", medMax(changes[0]))
		b.record("change a slice's endpoint → traffic, from the watch event", medMax(changes[1]))
		b.record("delete a Service → traffic refused, from the API call", medMax(deletes[0]))
		b.record("delete a Service → traffic refused, from the watch event", medMax(deletes[1]))
	}

	// 4. Churn: endpoint changes at a steady rate, then one more change
	// whose latency says whether a lag built up.
	if b.o.churn > 0 {
		cpu0 = d.cpu()
		p, err := b.probeService(ctx, "churn-probe", 200)
		if err != nil {
			return err
		}
		profiled := make(chan error, 1)
		if b.o.profile != "" {
			go func() { profiled <- b.cpuProfile(30 * time.Second) }()
		} else {
			profiled <- nil
		}
		if err := b.churn(ctx); err != nil {
			return err
		}
		if err := <-profiled; err != nil {
			return fmt.Errorf("profile: %w", err)
		}
		lag, _, err := b.switchBackend(ctx, p)
		if err != nil {
			return err
		}
		b.record(fmt.Sprintf("churn: %d endpoint changes/s for %s, daemon CPU", b.o.rate, b.o.churn), fmt.Sprintf("%.1f s", d.cpu()-cpu0))
		b.record("churn: the change after the last one → traffic (lag)", ms(lag))
		b.record("daemon RSS after the churn", mib(d.rss()))
		b.record("daemon RSS peak over the whole run since start", mib(d.peak()))
	}
	if b.o.write != "" {
		return b.writeTable()
	}
	return nil
}

// proc is a daemon under measurement: its log lines as they come, its
// memory and CPU from /proc.
type proc struct {
	cmd    *exec.Cmd
	mu     sync.Mutex
	seen   []string
	peakKB atomic.Int64
	stop   chan struct{}
}

func (b *bench) start(out io.Writer, args ...string) (*exec.Cmd, error) {
	cmd := exec.Command("ip", append([]string{"netns", "exec", b.ns}, args...)...)
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
		return nil, err
	}
	b.procs = append(b.procs, running{cmd, done})
	return cmd, nil
}

// running is a started process and a channel closed once it has exited.
type running struct {
	cmd  *exec.Cmd
	done chan struct{}
}

func (b *bench) exited(cmd *exec.Cmd) <-chan struct{} {
	for _, r := range b.procs {
		if r.cmd == cmd {
			return r.done
		}
	}
	return nil
}

func (b *bench) daemon(ctx context.Context) (*proc, error) {
	pr, pw := io.Pipe()
	logFile, err := os.Create(filepath.Join(b.tmp, fmt.Sprintf("daemon-%d.log", len(b.procs))))
	if err != nil {
		return nil, err
	}
	args := []string{filepath.Join(b.o.bin, "kube-userspace-proxy"), "--kubeconfig", b.cp.Kubeconfig, "--hostname-override", "node",
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
	cmd, err := b.start(io.MultiWriter(pw, logFile), args...)
	if err != nil {
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
		<-b.exited(cmd)
		p.mu.Lock()
		p.seen = append(p.seen, fmt.Sprintf("(the daemon exited: %v)", cmd.ProcessState))
		p.mu.Unlock()
		pw.Close()
		logFile.Close()
		close(p.stop)
	}()
	return p, nil
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
			return fmt.Errorf("the daemon exited before %q:\n%s", text, p.tail())
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

// cpu is the daemon's user+system CPU time so far, in seconds.
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

func clusterIP(i int) string { return fmt.Sprintf("10.96.%d.%d", (i+1)/250, (i+1)%250+1) }

// createAll creates the Services and their slices, 32 at a time.
func (b *bench) createAll(ctx context.Context) error {
	var next atomic.Int64
	errs := make(chan error, 32)
	var wg sync.WaitGroup
	for w := 0; w < 32; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1)) - 1; i < b.o.n; i = int(next.Add(1)) - 1 {
				name := fmt.Sprintf("s%d", i)
				if _, err := b.client.CoreV1().Services("bench").Create(ctx, service(name, clusterIP(i)), metav1.CreateOptions{}); err != nil {
					errs <- err
					return
				}
				var addrs []string
				for k := 0; k < b.o.m; k++ {
					e := i*b.o.m + k
					addrs = append(addrs, fmt.Sprintf("10.244.%d.%d", 1+e/250, e%250+1))
				}
				if _, err := b.client.DiscoveryV1().EndpointSlices("bench").Create(ctx, slice(name, addrs, 8080), metav1.CreateOptions{}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

func service(name, ip string) *v1.Service {
	return &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "bench"},
		Spec: v1.ServiceSpec{ClusterIP: ip, Ports: []v1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}}}
}

func slice(service string, addrs []string, port int32) *discovery.EndpointSlice {
	es := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: service, Namespace: "bench", Labels: map[string]string{discovery.LabelServiceName: service}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr("http"), Port: ptr(port), Protocol: ptr(v1.ProtocolTCP)}},
	}
	for _, a := range addrs {
		es.Endpoints = append(es.Endpoints, discovery.Endpoint{Addresses: []string{a}, Conditions: discovery.EndpointConditions{Ready: ptr(true)}})
	}
	return es
}

func ptr[T any](v T) *T { return &v }

// attempt bounds one connection attempt of a probe: the resolution of the
// latencies measured.
const attempt = 20 * time.Millisecond

// accepts reports whether a TCP connection to addr (in the node) is
// accepted: a listener serves it.
func (b *bench) accepts(addr string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), attempt)
	defer cancel()
	c, err := cluster.DialContextIn(b.ns)(ctx, "tcp", addr)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// answer is the name of the backend that answers http://addr/, or "".
func (b *bench) answer(addr string) string {
	resp, err := b.http.Get("http://" + addr + "/")
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	name, _, _ := strings.Cut(string(body), " ")
	return name
}

// until polls cond every 2 ms.
func (b *bench) until(ctx context.Context, limit time.Duration, cond func() bool) error {
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			return errors.New("timed out")
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		time.Sleep(2 * time.Millisecond)
	}
	return nil
}

type probe struct{ name, addr string }

// probeService creates a Service whose endpoint is backend A, and waits
// until it answers.
func (b *bench) probeService(ctx context.Context, name string, octet int) (probe, error) {
	p := probe{name: name, addr: fmt.Sprintf("10.96.%d.1:80", octet)}
	if _, err := b.client.CoreV1().Services("bench").Create(ctx, service(name, strings.TrimSuffix(p.addr, ":80")), metav1.CreateOptions{}); err != nil {
		return p, err
	}
	if _, err := b.client.DiscoveryV1().EndpointSlices("bench").Create(ctx, slice(name, []string{"10.244.0.1"}, 8080), metav1.CreateOptions{}); err != nil {
		return p, err
	}
	return p, b.until(ctx, time.Minute, func() bool { return b.answer(p.addr) == "A" })
}

// watchEvents records when each Service and EndpointSlice event of the
// bench namespace arrives, from now on, until ctx ends.
func (b *bench) watchEvents(ctx context.Context) error {
	b.seen = map[string]time.Time{}
	for _, kind := range []string{"service", "slice"} {
		var w watch.Interface
		var err error
		// From the current resource version: no event for what exists.
		if kind == "service" {
			l, lerr := b.client.CoreV1().Services("bench").List(ctx, metav1.ListOptions{Limit: 1})
			if lerr != nil {
				return lerr
			}
			w, err = b.client.CoreV1().Services("bench").Watch(ctx, metav1.ListOptions{ResourceVersion: l.ResourceVersion})
		} else {
			l, lerr := b.client.DiscoveryV1().EndpointSlices("bench").List(ctx, metav1.ListOptions{Limit: 1})
			if lerr != nil {
				return lerr
			}
			w, err = b.client.DiscoveryV1().EndpointSlices("bench").Watch(ctx, metav1.ListOptions{ResourceVersion: l.ResourceVersion})
		}
		if err != nil {
			return err
		}
		go func() {
			defer w.Stop()
			for ev := range w.ResultChan() {
				now := time.Now()
				if m, err := meta.Accessor(ev.Object); err == nil {
					b.seenMu.Lock()
					b.seen[kind+"/"+m.GetName()] = now
					b.seenMu.Unlock()
				}
			}
		}()
	}
	return nil
}

// sinceEvent is how long before at the first event of key at or after
// from arrived (0 when none came within 5 s).
func (b *bench) sinceEvent(key string, from, at time.Time) time.Duration {
	deadline := time.Now().Add(5 * time.Second)
	for {
		b.seenMu.Lock()
		t, ok := b.seen[key]
		b.seenMu.Unlock()
		if ok && !t.Before(from) {
			return at.Sub(t)
		}
		if time.Now().After(deadline) {
			return 0
		}
		time.Sleep(time.Millisecond)
	}
}

// oneChange measures an add (Service, then its slice: from the slice's
// API call, and from its watch event), a change (the slice's endpoint
// from A to B) and a delete; [0] from the API call, [1] from the event.
func (b *bench) oneChange(ctx context.Context, i int) (add, change, del [2]time.Duration, err error) {
	name := fmt.Sprintf("probe-%d", i)
	ip := fmt.Sprintf("10.96.%d.1", 210+i)
	// Each measured change is a lone one: after a quiet time longer than
	// the daemon's rate limit needs to refill (2 × --min-sync-period).
	lone := func() { time.Sleep(2500 * time.Millisecond) }
	lone()
	if _, err = b.client.CoreV1().Services("bench").Create(ctx, service(name, ip), metav1.CreateOptions{}); err != nil {
		return
	}
	called := time.Now()
	if _, err = b.client.DiscoveryV1().EndpointSlices("bench").Create(ctx, slice(name, []string{"10.244.0.1"}, 8080), metav1.CreateOptions{}); err != nil {
		return
	}
	t := time.Now()
	if err = b.until(ctx, time.Minute, func() bool { return b.answer(ip+":80") == "A" }); err != nil {
		return
	}
	done := time.Now()
	add = [2]time.Duration{done.Sub(t), b.sinceEvent("slice/"+name, called, done)}
	if b.o.logs != "" { // to line up with the daemon's log
		fmt.Fprintf(os.Stderr, "%s add %s: %v from the call, %v from the slice's event\n", done.UTC().Format("15:04:05.000"), name, add[0], add[1])
	}
	lone()
	var at time.Time
	called = time.Now()
	if change[0], at, err = b.switchBackend(ctx, probe{name: name, addr: ip + ":80"}); err != nil {
		return
	}
	change[1] = b.sinceEvent("slice/"+name, called, at)
	lone()
	// The probes start before the call: the API server answers a DELETE
	// 40-90 ms after its watch event, and the daemon refuses before that.
	refused := make(chan error, 1)
	var refusedAt time.Time
	pctx, stopProbes := context.WithCancel(ctx)
	go func() {
		err := b.until(pctx, time.Minute, func() bool { return !b.accepts(ip + ":80") })
		refusedAt = time.Now()
		refused <- err
	}()
	called = time.Now()
	if err = b.client.CoreV1().Services("bench").Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		stopProbes()
		<-refused
		return
	}
	t = time.Now()
	err = <-refused
	stopProbes()
	if err != nil {
		return
	}
	// From the call's answer: 0 when refused before it came.
	del = [2]time.Duration{max(refusedAt.Sub(t), 0), b.sinceEvent("service/"+name, called, refusedAt)}
	_ = b.client.DiscoveryV1().EndpointSlices("bench").Delete(ctx, name, metav1.DeleteOptions{})
	return
}

// switchBackend moves the probe's endpoint to the other backend and returns
// how long after the API call traffic reached it, and when.
func (b *bench) switchBackend(ctx context.Context, p probe) (time.Duration, time.Time, error) {
	want, addr := "B", "10.244.0.2"
	if b.answer(p.addr) == "B" {
		want, addr = "A", "10.244.0.1"
	}
	es, err := b.client.DiscoveryV1().EndpointSlices("bench").Get(ctx, p.name, metav1.GetOptions{})
	if err != nil {
		return 0, time.Time{}, err
	}
	es.Endpoints[0].Addresses = []string{addr}
	if _, err := b.client.DiscoveryV1().EndpointSlices("bench").Update(ctx, es, metav1.UpdateOptions{}); err != nil {
		return 0, time.Time{}, err
	}
	t := time.Now()
	err = b.until(ctx, time.Minute, func() bool { return b.answer(p.addr) == want })
	done := time.Now()
	return done.Sub(t), done, err
}

// churn flips one endpoint's readiness in a random slice, rate times a
// second, for the churn's duration.
func (b *bench) churn(ctx context.Context) error {
	r := rand.New(rand.NewPCG(1, 2))
	tick := time.NewTicker(time.Second / time.Duration(b.o.rate))
	defer tick.Stop()
	end := time.Now().Add(b.o.churn)
	for time.Now().Before(end) {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
		name := fmt.Sprintf("s%d", r.IntN(b.o.n))
		es, err := b.client.DiscoveryV1().EndpointSlices("bench").Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		k := r.IntN(len(es.Endpoints))
		ready := es.Endpoints[k].Conditions.Ready == nil || *es.Endpoints[k].Conditions.Ready
		es.Endpoints[k].Conditions.Ready = ptr(!ready)
		if _, err := b.client.DiscoveryV1().EndpointSlices("bench").Update(ctx, es, metav1.UpdateOptions{}); err != nil {
			return err
		}
	}
	return nil
}

// cpuProfile saves the daemon's CPU profile over d to the -profile file.
func (b *bench) cpuProfile(d time.Duration) error {
	return b.save(fmt.Sprintf("/debug/pprof/profile?seconds=%d", int(d.Seconds())), b.o.profile, d+30*time.Second)
}

// pageRequests are what the live page fetches on each refresh
// (cmd/kube-userspace-proxy/ui/index.html, refresh()): at once, and the next
// refresh a second after the last answer; the rules every rulesEvery
// refreshes, from the first.
var pageRequests = []string{"/debug/services?limit=500", "/debug/connections?limit=500", "/debug/log?n=50"}

const (
	pageRules  = "/debug/rules?format=json"
	rulesEvery = 10
)

// pollPage makes the live page's requests for d, as the page does, and
// returns how many refreshes it made.
func (b *bench) pollPage(ctx context.Context, d time.Duration) (int, error) {
	c := &http.Client{Timeout: time.Minute, Transport: &http.Transport{DialContext: cluster.DialContextIn(b.ns)}}
	get := func(path string) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://127.0.0.1:10249"+path, nil)
		if err != nil {
			return err
		}
		req.Header.Set("Accept", "application/json")
		resp, err := c.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			return err
		}
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET %s: %s", path, resp.Status)
		}
		return nil
	}
	end := time.Now().Add(d)
	n := 0
	for ; time.Now().Before(end); n++ {
		paths := pageRequests
		if n%rulesEvery == 0 {
			paths = append(slices.Clone(paths), pageRules)
		}
		errs := make(chan error, len(paths))
		for _, path := range paths {
			go func() { errs <- get(path) }()
		}
		for range paths {
			if err := <-errs; err != nil {
				return n, err
			}
		}
		select {
		case <-ctx.Done():
			return n, ctx.Err()
		case <-time.After(time.Second):
		}
	}
	return n, nil
}

// save writes what the daemon's metrics server answers on path to file.
func (b *bench) save(path, file string, timeout time.Duration) error {
	c := &http.Client{Timeout: timeout, Transport: &http.Transport{DialContext: cluster.DialContextIn(b.ns)}}
	resp, err := c.Get("http://127.0.0.1:10249" + path)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", path, resp.Status)
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = io.Copy(f, resp.Body)
	return err
}

func secs(d time.Duration) string { return fmt.Sprintf("%.2f s", d.Seconds()) }
func ms(d time.Duration) string   { return fmt.Sprintf("%.0f ms", float64(d.Microseconds())/1000) }
func mib(kb int64) string         { return fmt.Sprintf("%.0f MiB", float64(kb)/1024) }

func medMax(ds []time.Duration) string {
	s := slices.Clone(ds)
	slices.Sort(s)
	return ms(s[len(s)/2]) + " / " + ms(s[len(s)-1])
}

// writeTable puts the table between the bench-cluster markers of the
// Markdown file (appending them when missing).
func (b *bench) writeTable() error {
	data, err := os.ReadFile(b.o.write)
	if err != nil {
		return err
	}
	const begin, end = "<!-- bench-cluster:begin -->", "<!-- bench-cluster:end -->"
	var t strings.Builder
	fmt.Fprintf(&t, "%s\n`make bench-cluster` (`%s`), %s:\n\n| %d Services × %d endpoints | |\n|---|---:|\n",
		begin, strings.Join(os.Args, " "), time.Now().UTC().Format("2006-01-02"), b.o.n, b.o.m)
	for _, r := range b.rows {
		fmt.Fprintf(&t, "| %s | %s |\n", r[0], r[1])
	}
	t.WriteString(end)
	s := string(data)
	if i, j := strings.Index(s, begin), strings.Index(s, end); i >= 0 && j > i {
		s = s[:i] + t.String() + s[j+len(end):]
	} else {
		s = strings.TrimRight(s, "\n") + "\n\n## The cluster source at scale\n\n" + t.String() + "\n"
	}
	return os.WriteFile(b.o.write, []byte(s), 0o644)
}
