// Command clusterbench is make bench-cluster: proxies against the real
// control plane of test/cluster with N Services of M endpoints each (one
// EndpointSlice each): ours, and kube-proxy v1.37.2 (the same module as the
// control plane) in its nftables and iptables modes, each in a network
// namespace of its own (node.go), one after the other, from the same API
// server. It measures what a node proxy at scale is judged by: memory while
// the objects stream in and when steady, start → serving, one change's
// latency from the API call until traffic reflects it, a churn of endpoint
// changes (proxy CPU, lag), and the node tax at that scale (tax.go).
// Root; it removes its namespaces and processes on exit.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

type options struct {
	n, m      int
	proxies   []string
	churn     time.Duration
	page      time.Duration // the live page polled once serving, for its memory
	rate      int
	runs      int
	tax       bool
	taxRuns   int
	taxDur    int
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
	var proxies string
	flag.IntVar(&o.n, "n", 10000, "Services (one TCP port, one EndpointSlice each)")
	flag.IntVar(&o.m, "m", 5, "endpoints per Service")
	flag.StringVar(&proxies, "proxies", strings.Join(allProxies, ","),
		"the proxies measured, in this order, comma-separated: "+strings.Join(allProxies, ", "))
	flag.DurationVar(&o.churn, "churn", 60*time.Second, "how long the endpoint churn lasts")
	flag.IntVar(&o.rate, "rate", 50, "endpoint changes per second during the churn")
	flag.IntVar(&o.runs, "runs", 5, "add/change/delete latencies measured")
	flag.BoolVar(&o.tax, "tax", true, "measure the node tax at N Services")
	flag.IntVar(&o.taxRuns, "tax-runs", 5, "runs of each node-tax figure, interleaved with the bare namespace's")
	flag.IntVar(&o.taxDur, "tax-dur", 2, "seconds each node-tax run lasts")
	flag.StringVar(&o.bin, "bin", "bin", "where kube-userspace-proxy, backend and loadgen are")
	flag.StringVar(&o.repo, "repo", ".", "the repository (for the control plane's and kube-proxy's modules)")
	flag.StringVar(&o.write, "write", "", "write the table into this Markdown file (between bench-cluster markers)")
	flag.StringVar(&o.minPeriod, "min-sync-period", "", "pass --min-sync-period to our daemon (default: the daemon's)")
	flag.StringVar(&o.heap, "heap", "", "save our daemon's heap profile (in use, after a GC) when it serves, steady, to this file")
	flag.StringVar(&o.startProf, "start-profile", "", "write a CPU profile of our daemon's first 3 s after its restart's caches synced to this file")
	flag.StringVar(&o.logLevel, "log-level", "", "pass --log-level to our daemon (debug: each sync's and rule write's duration)")
	flag.StringVar(&o.logs, "logs", "", "keep the proxies' logs in this directory")
	flag.StringVar(&o.profile, "profile", "", "write a CPU profile of our daemon during the churn (its first 30 s) to this file")
	flag.DurationVar(&o.page, "page", 30*time.Second, "how long our live page's requests are made once serving, for its memory (0: not)")
	flag.Parse()
	for _, p := range strings.Split(proxies, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		if !slices.Contains(allProxies, p) || slices.Contains(o.proxies, p) {
			fmt.Fprintf(os.Stderr, "clusterbench: -proxies: %q is not one of %s (each once)\n", p, strings.Join(allProxies, ", "))
			os.Exit(2)
		}
		o.proxies = append(o.proxies, p)
	}
	if len(o.proxies) == 0 || o.runs < 0 || o.taxRuns < 1 || o.taxDur < 1 {
		fmt.Fprintln(os.Stderr, "clusterbench: -proxies needs one proxy, -runs ≥ 0, -tax-runs and -tax-dur ≥ 1")
		os.Exit(2)
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "clusterbench needs root (network namespaces)")
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	b := &bench{o: o, ns: fmt.Sprintf("kcb%d", os.Getpid()), ctx: ctx}
	err := b.run(ctx)
	b.cleanup()
	if err != nil {
		fmt.Fprintln(os.Stderr, "clusterbench:", err)
		os.Exit(1)
	}
}

type bench struct {
	o         options
	ctx       context.Context
	ns        string // the control plane's namespace
	tmp       string
	cp        *cluster.ControlPlane
	client    *kubernetes.Clientset
	kubeProxy string // kube-proxy's binary
	cur       *node  // the node being measured
	bare      *node  // the namespace without rules of the node tax
	rows      []string
	cells     map[string][]string // the row's value for each proxy
	col       int                 // the proxy being measured

	// seen is when this process's watch saw the last event of each object
	// ("slice/name", "service/name"): about when the proxy's did.
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
	for _, n := range []*node{b.cur, b.bare} {
		if n != nil {
			n.close()
		}
	}
	if b.cp != nil {
		b.cp.Stop()
	}
	_ = exec.Command("ip", "netns", "del", b.ns).Run()
	if b.tmp != "" {
		if b.o.logs != "" {
			logs, _ := filepath.Glob(filepath.Join(b.tmp, "*.log"))
			_ = os.MkdirAll(b.o.logs, 0o755)
			for _, l := range logs {
				_ = os.Rename(l, filepath.Join(b.o.logs, filepath.Base(l)))
			}
		}
		os.RemoveAll(b.tmp)
	}
}

// record sets the current proxy's cell of the row what.
func (b *bench) record(what, value string) {
	if b.cells == nil {
		b.cells = map[string][]string{}
	}
	if _, ok := b.cells[what]; !ok {
		b.rows = append(b.rows, what)
		b.cells[what] = make([]string, len(b.o.proxies))
	}
	b.cells[what][b.col] = value
	fmt.Printf("%-22s %-90s %s\n", b.o.proxies[b.col], what, value)
}

// kubeProxyBin builds kube-proxy from the conformance lab's Kubernetes
// module (the version the control plane runs) once, into the cache.
func kubeProxyBin(repo string) (string, error) {
	mod := filepath.Join(repo, "test", "conformance", "build", "k8s")
	dir, err := cluster.Cached("kube-proxy", mod, []string{"kube-proxy"}, os.Stderr, "kube-proxy (first time only: ~4 minutes)",
		func(out string) error {
			cmd := cluster.GoCommand(mod, "build", "-o", out+"/", "k8s.io/kubernetes/cmd/kube-proxy")
			cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
			return cmd.Run()
		})
	return filepath.Join(dir, "kube-proxy"), err
}

func (b *bench) run(ctx context.Context) error {
	var err error
	if b.tmp, err = os.MkdirTemp("", "clusterbench"); err != nil {
		return err
	}
	for _, c := range [][]string{{"ip", "netns", "add", b.ns}, {"ip", "netns", "exec", b.ns, "ip", "link", "set", "lo", "up"}} {
		if err := b.sh(c...); err != nil {
			return err
		}
	}
	bins, err := cluster.BinDir(b.o.repo, os.Stderr)
	if err != nil {
		return err
	}
	if slices.ContainsFunc(b.o.proxies, func(p string) bool { return p != ours }) {
		if b.kubeProxy, err = kubeProxyBin(b.o.repo); err != nil {
			return err
		}
	}
	if b.cp, err = cluster.Start(ctx, cluster.Options{BinDir: bins, Dir: b.tmp, Netns: b.ns, ListenAll: true}); err != nil {
		return err
	}
	rc := &rest.Config{Host: b.cp.URL, BearerToken: b.cp.AdminToken, TLSClientConfig: rest.TLSClientConfig{Insecure: true},
		Dial: cluster.DialContextIn(b.ns), QPS: 2000, Burst: 4000}
	if b.client, err = kubernetes.NewForConfig(rc); err != nil {
		return err
	}
	if _, err := b.client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "bench"}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	// The node's address, as a kubelet reports it: kube-proxy waits up to
	// 30 s for one before its first sync.
	node, err := b.client.CoreV1().Nodes().Create(ctx, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node"}}, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	node.Status.Addresses = []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: nodeIP}}
	if _, err := b.client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		return err
	}
	if b.o.tax {
		if _, err := b.client.CoreV1().Services("bench").Create(ctx, service(taxTarget, taxTargetIP), metav1.CreateOptions{}); err != nil {
			return err
		}
		if _, err := b.client.DiscoveryV1().EndpointSlices(
			"bench",
		).Create(
			ctx,
			slice(taxTarget, []string{"10.244.0.1"}, 8080),
			metav1.CreateOptions{},
		); err != nil {
			return err
		}
		if b.bare, err = b.newBare(); err != nil {
			return err
		}
	}
	fmt.Printf("clusterbench: %d Services × %d endpoints; control plane up; measuring %s\n", b.o.n, b.o.m, strings.Join(b.o.proxies, ", "))
	for i, proxy := range b.o.proxies {
		b.col = i
		if b.cur, err = b.newNode(ctx, i, proxy); err != nil {
			return err
		}
		err = b.measure(ctx, b.cur, i == 0)
		b.cur.close()
		b.cur = nil
		if err != nil {
			return fmt.Errorf("%s: %w", proxy, err)
		}
	}
	if b.o.write != "" {
		return b.writeTable()
	}
	return nil
}

// newBare makes the node tax's namespace without rules: loopback and the
// node's own servers.
func (b *bench) newBare() (*node, error) {
	n := &node{b: b, ns: b.ns + "-bare"}
	for _, c := range [][]string{{"ip", "netns", "add", n.ns}, {"ip", "netns", "exec", n.ns, "ip", "link", "set", "lo", "up"}} {
		if err := b.sh(c...); err != nil {
			n.close()
			return nil, err
		}
	}
	if err := n.startTaxServers(); err != nil {
		n.close()
		return nil, err
	}
	return n, nil
}

// lastService is the ClusterIP address of the last bulk Service: a proxy
// that serves it serves them all (each writes its rules in name order or
// at once).
func (b *bench) lastService() string { return clusterIP(b.o.n-1) + ":80" }

// watching waits until p watches the API server: our daemon's start line,
// kube-proxy's health server (up once its informers are started).
func (n *node) watching(ctx context.Context, p *proc, limit time.Duration) error {
	if n.proxy == ours {
		return p.wait(ctx, "msg=Started", limit)
	}
	if err := n.b.until(ctx, limit, func() bool { return n.accepts("127.0.0.1:10256") }); err != nil {
		return fmt.Errorf("kube-proxy's health server never answered: %w\n%s", err, p.tail())
	}
	return nil
}

// measure measures the proxy of n; the first one, when ours, also while
// the objects are created.
func (b *bench) measure(ctx context.Context, n *node, first bool) error {
	switch {
	case first && n.proxy == ours:
		if err := b.streamIn(ctx, n); err != nil {
			return err
		}
	case first:
		// kube-proxy's iptables mode takes minutes per sync at 10 000
		// Services: it starts on the objects in place.
		if err := b.createAll(ctx); err != nil {
			return err
		}
	}
	p, err := b.startClean(ctx, n)
	if err != nil {
		return err
	}
	if p, err = b.restart(ctx, n, p); err != nil {
		return err
	}
	if err := b.timeChanges(ctx); err != nil {
		return err
	}
	if err := b.timeChurn(ctx, n, p); err != nil {
		return err
	}
	b.record("RSS peak over the whole run since the restart", mib(p.peak()))
	if b.o.tax {
		return b.measureTax(n, p)
	}
	return nil
}

// streamIn has the proxy watch while the objects stream in, then kills it
// and removes its rules.
func (b *bench) streamIn(ctx context.Context, n *node) error {
	last := b.lastService()
	p, err := n.startProxy()
	if err != nil {
		return err
	}
	if err := n.watching(ctx, p, time.Minute); err != nil {
		return err
	}
	cpu0 := p.cpu()
	start := time.Now()
	if err := b.createAll(ctx); err != nil {
		return err
	}
	created := time.Since(start)
	if err := b.until(ctx, 5*time.Minute, func() bool { return n.accepts(last) }); err != nil {
		return fmt.Errorf("the last Service (%s) never served: %w\n%s", last, err, p.tail())
	}
	b.record(fmt.Sprintf("objects created (%d Services, %d slices, %d endpoints), the first proxy watching", b.o.n, b.o.n, b.o.n*b.o.m), secs(created))
	b.record("served after the last object was created", secs(time.Since(start)-created))
	b.record("CPU while the objects streamed in", fmt.Sprintf("%.1f s", p.cpu()-cpu0))
	b.record("RSS peak while the objects streamed in", mib(p.peak()))
	n.kill(p)
	return n.cleanup()
}

// startClean starts the proxy on a node without rules, every object in
// place, and measures it until steady (and our live page's memory).
func (b *bench) startClean(ctx context.Context, n *node) (*proc, error) {
	last := b.lastService()
	t0 := time.Now()
	p, err := n.startProxy()
	if err != nil {
		return nil, err
	}
	// kube-proxy's iptables mode takes 4–6 minutes here at 10 000 Services.
	if err := b.until(ctx, 15*time.Minute, func() bool { return n.accepts(last) }); err != nil {
		return nil, fmt.Errorf("the last Service (%s) never served: %w\n%s", last, err, p.tail())
	}
	b.record("start on a node without rules → serving every Service", secs(time.Since(t0)))
	b.record("RSS peak from that start to serving", mib(p.peak()))
	time.Sleep(5 * time.Second)
	steady := p.rss()
	b.record("RSS when serving, steady", mib(steady))
	if n.proxy == ours && b.o.page > 0 {
		// The live page open for a while, then closed: its RSS against
		// the steady figure without it.
		p.peak()
		polls, err := b.pollPage(ctx, b.o.page)
		if err != nil {
			return nil, fmt.Errorf("the live page's requests: %w", err)
		}
		peak, after := p.peak(), p.rss()
		b.record(fmt.Sprintf("live page polling for %s: RSS peak, and ÷ steady", b.o.page),
			fmt.Sprintf("%s (%.2f×, %d refreshes)", mib(peak), float64(peak)/float64(steady), polls))
		b.record("live page polling: RSS at its end, and ÷ steady", fmt.Sprintf("%s (%.2f×)", mib(after), float64(after)/float64(steady)))
	}
	if n.proxy == ours && b.o.heap != "" {
		if err := b.save("/debug/pprof/heap?gc=1", b.o.heap, time.Minute); err != nil {
			return nil, fmt.Errorf("heap profile: %w", err)
		}
		// The text form ends with the runtime's MemStats: heap goal, stacks.
		if err := b.save("/debug/pprof/heap?debug=1", b.o.heap+".txt", time.Minute); err != nil {
			return nil, fmt.Errorf("heap profile: %w", err)
		}
	}
	return p, nil
}

// restart kills p with -9 and starts the proxy again: the rules of the
// dead one are still there. kube-proxy's keep serving in the kernel
// meanwhile; ours point at listeners that died with it.
func (b *bench) restart(ctx context.Context, n *node, p *proc) (*proc, error) {
	n.kill(p)
	t0 := time.Now()
	p, err := n.startProxy()
	if err != nil {
		return nil, err
	}
	if n.proxy == ours {
		if err := p.wait(ctx, "msg=Started", 5*time.Minute); err != nil {
			return nil, err
		}
	}
	listed := time.Since(t0)
	startProfiled := make(chan error, 1)
	if n.proxy == ours && b.o.startProf != "" {
		go func() { startProfiled <- b.save("/debug/pprof/profile?seconds=3", b.o.startProf, time.Minute) }()
	} else {
		startProfiled <- nil
	}
	if err := b.until(ctx, 5*time.Minute, func() bool { return n.accepts(b.lastService()) }); err != nil {
		return nil, err
	}
	serving := time.Since(t0)
	if err := <-startProfiled; err != nil {
		return nil, fmt.Errorf("start profile: %w", err)
	}
	b.record("restart after kill -9 → serving every Service", secs(serving))
	if n.proxy == ours {
		b.record("that restart → caches synced (the initial LIST and watch)", secs(listed))
		b.record("that restart → serving, beyond the initial LIST", secs(serving-listed))
	}
	// The changes measured next must not wait for the first sync of a
	// proxy that serves on the old rules meanwhile (kube-proxy).
	if err := b.until(ctx, 15*time.Minute, func() bool { return n.syncedSince(t0) }); err != nil {
		return nil, fmt.Errorf("no sync after the restart: %w\n%s", err, p.tail())
	}
	b.record("restart after kill -9 → its first sync done", secs(time.Since(t0)))
	b.record("RSS peak from that restart to its first sync", mib(p.peak()))
	return p, nil
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
	s := string(data)
	i, j := strings.Index(s, begin), strings.Index(s, end)
	t := table{corner: fmt.Sprintf("%d Services × %d endpoints", b.o.n, b.o.m)}
	if i >= 0 && j > i {
		// Columns this run did not measure stay, with the run they came from,
		// when they measured the same scale.
		if old := parseTable(s[i+len(begin) : j]); old.corner == t.corner {
			t = old
		}
	}
	cmd := fmt.Sprintf("`%s`, %s", strings.Join(os.Args, " "), time.Now().UTC().Format("2006-01-02"))
	for c, p := range b.o.proxies {
		t.set(p, cmd, b.rows, func(row string) string { return b.cells[row][c] })
	}
	if i >= 0 && j > i {
		s = s[:i] + begin + "\n" + t.String() + end + s[j+len(end):]
	} else {
		s = strings.TrimRight(s, "\n") + "\n\n## The cluster source at scale\n\n" + begin + "\n" + t.String() + end + "\n"
	}
	return os.WriteFile(b.o.write, []byte(s), 0o644)
}
