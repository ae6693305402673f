package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

// The differential run (make differential): random but valid Service and
// EndpointSlice shapes, each observed from every kind of client over every
// address, first with kube-userspace-proxy, then with kube-proxy (nftables)
// in its place on the same three-node lab; every difference that
// differential-known.txt does not explain fails the run, reduced first to
// the smallest shape that still differs.
//
// One lab serves both proxies: they take turns (the one leaving is stopped
// and its rules cleaned up with its own --cleanup), so the shapes meet the
// same pods, nodes and addresses.

type diffOptions struct {
	seed        int64
	shapes      int
	only        int // a case to run alone; -1: all
	batch       int
	shrink      bool
	writeDocs   bool
	resultsFile string
}

// shapeRun is one shape's observations, before (phase 0) and after its edit.
type shapeRun struct {
	shape  shape
	phases [2][]observation
	health [2][]string // per node, LoadBalancer with externalTrafficPolicy Local only
	held   *heldConn   // a connection open across a "terminate" edit
}

// heldConn is a connection a pod on node 1 keeps open to the cluster IP
// of a shape's first TCP port while one of its endpoints goes terminating:
// established connections outlive the endpoint's readiness in both proxies.
type heldConn struct {
	conn   net.Conn
	br     *bufio.Reader
	target string
	before string // who answered when it was opened
}

// holdConnection opens the held connection, or returns nil when the shape
// has no TCP port or nothing answers.
func (d *differ) holdConnection(svc *v1.Service) *heldConn {
	for _, p := range svc.Spec.Ports {
		if p.Protocol != v1.ProtocolTCP || svc.Spec.ClusterIP == "" || svc.Spec.ClusterIP == v1.ClusterIPNone {
			continue
		}
		c := d.view.clients[0] // pod@node1
		addr := net.JoinHostPort(svc.Spec.ClusterIP, strconv.Itoa(int(p.Port)))
		ctx, cancel := context.WithTimeout(d.ctx, diffTimeout)
		conn, err := cluster.DialContextIn(c.netns)(ctx, "tcp", addr)
		cancel()
		if err != nil {
			return nil
		}
		h := &heldConn{conn: conn, br: bufio.NewReader(conn), target: "held-connection/" + p.Name + "/TCP"}
		_ = conn.SetDeadline(time.Now().Add(diffTimeout))
		if h.before, err = httpAsk(conn, h.br, "/hostname"); err != nil {
			conn.Close()
			return nil
		}
		return h
	}
	return nil
}

// check asks the held connection again after the edit and closes it.
func (h *heldConn) check() observation {
	defer h.conn.Close()
	o := observation{Client: "pod@node1", Target: h.target, Tries: 1}
	_ = h.conn.SetDeadline(time.Now().Add(diffTimeout))
	host, err := httpAsk(h.conn, h.br, "/hostname")
	switch {
	case err != nil:
		o.Outcome = "cut"
		o.Failures = []string{err.Error()}
	case strings.TrimSpace(host) != strings.TrimSpace(h.before):
		o.Outcome = "moved"
	default:
		o.Outcome = "alive"
	}
	return o
}

// differ is the run's state: the lab, its API client and what it saw.
type differ struct {
	ctx   context.Context
	l     *lab
	cp    *controlPlane
	repo  string
	kube  *kubernetes.Clientset
	view  *labView
	proxy string // serving now
	known []knownDiff
	log   *os.File

	sentinelFlip int
	sentinelIP   string
}

func runDifferential(ctx context.Context, repo string, b *binaries, tars []string, o diffOptions) (bool, error) {
	conf := filepath.Join(repo, "test", "conformance")
	known, err := readKnownDiffs(filepath.Join(conf, "differential-known.txt"))
	if err != nil {
		return false, err
	}
	sweep(labDir, false)
	l := &lab{dir: labDir, log: os.Stdout, nodes: 3, keepLogs: filepath.Join(os.TempDir(), "kup-conformance-logs", "differential")}
	defer l.close(false)
	start := time.Now()
	cp, err := l.bringUp(ctx, b, tars)
	if err != nil {
		return false, err
	}
	d := &differ{ctx: ctx, l: l, cp: cp, repo: repo, known: known, log: os.Stdout}
	if err := d.setUp(); err != nil {
		return false, fmt.Errorf("the differential's pods: %w", err)
	}
	fmt.Printf("   lab up in %v: %d clients, %d pool pods\n", time.Since(start).Round(time.Second), len(d.view.clients), len(diffPool))

	var shapes []shape
	for c := 0; c < o.shapes; c++ {
		if o.only >= 0 && c != o.only {
			continue
		}
		s := generate(o.seed, c)
		if !s.valid() {
			continue
		}
		shapes = append(shapes, s)
	}
	var ours, ref map[int]*shapeRun
	for _, p := range []string{proxyOurs, proxyKubeNftables} {
		if err := d.serveWith(p); err != nil {
			return false, err
		}
		t0 := time.Now()
		runs, err := d.runShapes(shapes, o.batch, ours)
		if err != nil {
			return false, err
		}
		fmt.Printf("   %s: %d shapes observed in %v\n", p, len(runs), time.Since(t0).Round(time.Second))
		if p == proxyOurs {
			ours = runs
		} else {
			ref = runs
		}
	}
	diffs := d.compareAll(shapes, ours, ref)
	if err := saveObservations(shapes, ours, ref); err != nil {
		fmt.Printf("   the observations were not saved: %v\n", err)
	}
	if len(unexplainedOf(diffs)) > 0 && o.shrink {
		d.shrinkAll(diffs)
	}
	sum := summarise(o, shapes, ours, diffs, time.Since(start))
	d.report(diffs)
	if o.resultsFile != "" {
		if err := writeJSON(o.resultsFile, sum); err != nil {
			return false, err
		}
	}
	if o.writeDocs {
		if err := writeDifferentialDocs(repo, sum); err != nil {
			return false, err
		}
	}
	fmt.Printf("== differential: %d shapes × %d clients, %d observations per proxy, %d differences (%d explained by differential-known.txt), %v\n",
		sum.Shapes, sum.Clients, sum.Observations, sum.Differences, sum.Explained, time.Since(start).Round(time.Second))
	return len(unexplainedOf(diffs)) == 0, nil
}

// bringUp starts the control plane and the nodes, with no Service proxy.
func (l *lab) bringUp(ctx context.Context, b *binaries, tars []string) (*controlPlane, error) {
	if err := os.MkdirAll(l.dir, 0o755); err != nil {
		return nil, err
	}
	if err := l.network(); err != nil {
		return nil, fmt.Errorf("lab network: %w", err)
	}
	cp, err := l.startControlPlane(ctx, b)
	if err != nil {
		return nil, fmt.Errorf("control plane: %w (logs in %s)", err, filepath.Join(l.dir, "logs"))
	}
	for i := 1; i <= l.nodes; i++ {
		if err := l.startNode(ctx, i, b, cp, tars); err != nil {
			return nil, fmt.Errorf("%s: %w (logs in %s)", nodeName(i), err, filepath.Join(l.dir, "logs"))
		}
	}
	if _, err := cp.kubectl("wait", "--for=condition=Ready", "node", "--all", "--timeout=120s"); err != nil {
		return nil, err
	}
	return cp, nil
}

// setUp makes the namespace, the pool, the client pods and the sentinel,
// labels the nodes with zones and routes the outside addresses to nodes.
func (d *differ) setUp() error {
	cfg, err := clientcmd.BuildConfigFromFlags("", d.cp.kubeconfig)
	if err != nil {
		return err
	}
	cfg.Dial = cluster.DialContextIn(netNS)
	cfg.WarningHandler = rest.NoWarnings{} // externalIPs' deprecation, once per Service
	cfg.QPS, cfg.Burst = 200, 400
	if d.kube, err = kubernetes.NewForConfig(cfg); err != nil {
		return err
	}
	ctx := d.ctx
	for i := 1; i <= d.l.nodes; i++ {
		if _, err := d.cp.kubectl("label", "node", nodeName(i), "--overwrite", "topology.kubernetes.io/zone="+diffZones[i]); err != nil {
			return err
		}
	}
	for _, r := range [][]string{{diffExternalNet + "0/24", nodeAddr(1)}, {diffLBNet + "0/24", nodeAddr(2)}} {
		if err := ip(netNS, "route", "replace", r[0], "via", r[1]); err != nil {
			return err
		}
	}
	if _, err := d.kube.CoreV1().Namespaces().Create(
		ctx,
		&v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: diffNamespace}},
		metav1.CreateOptions{},
	); err != nil {
		return err
	}
	netexec := func(name string, http, udp int) v1.Container {
		return v1.Container{Name: name, Image: agnhostImage, ImagePullPolicy: v1.PullNever,
			Args: []string{"netexec", fmt.Sprintf("--http-port=%d", http), fmt.Sprintf("--udp-port=%d", udp)}}
	}
	pods := map[string]int{}
	for _, p := range diffPool {
		pods[p.name] = p.node
		pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: p.name, Namespace: diffNamespace}, Spec: v1.PodSpec{
			NodeName: nodeName(p.node), Containers: []v1.Container{netexec("main", 8080, 8081), netexec("alt", 9080, 9081)}}}
		if _, err := d.kube.CoreV1().Pods(diffNamespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			return err
		}
	}
	for i := 1; i <= d.l.nodes; i++ {
		name := fmt.Sprintf("client-%d", i)
		pods[name] = i
		pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: diffNamespace}, Spec: v1.PodSpec{
			NodeName: nodeName(i), Containers: []v1.Container{{Name: "c", Image: agnhostImage, ImagePullPolicy: v1.PullNever, Args: []string{"pause"}}}}}
		if _, err := d.kube.CoreV1().Pods(diffNamespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			return err
		}
	}
	ips := map[string]string{}
	if err := waitFor(ctx, 3*time.Minute, "the differential's pods running", func() error {
		list, err := d.kube.CoreV1().Pods(diffNamespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, p := range list.Items {
			if p.Status.Phase != v1.PodRunning || p.Status.PodIP == "" {
				return fmt.Errorf("%s: %s", p.Name, p.Status.Phase)
			}
			ips[p.Name] = p.Status.PodIP
		}
		if len(ips) != len(pods) {
			return fmt.Errorf("%d of %d pods", len(ips), len(pods))
		}
		return nil
	}); err != nil {
		return err
	}
	v := &labView{podIPs: ips, names: map[string]string{bridgeAddr: "outside"}}
	for name, ip := range ips {
		v.names[ip] = name
	}
	for i := 1; i <= d.l.nodes; i++ {
		v.names[nodeAddr(i)] = nodeName(i)
		node, err := d.kube.CoreV1().Nodes().Get(ctx, nodeName(i), metav1.GetOptions{})
		if err != nil {
			return err
		}
		if gw, ok := bridgeGateway(node.Spec.PodCIDR); ok {
			v.names[gw] = nodeName(i) + "-bridge"
		}
	}
	nsOf, err := podNetns(d.l.dir)
	if err != nil {
		return err
	}
	for i := 1; i <= d.l.nodes; i++ {
		name := fmt.Sprintf("client-%d", i)
		ns, ok := nsOf[ips[name]]
		if !ok {
			return fmt.Errorf("no network namespace holds %s's address %s", name, ips[name])
		}
		v.clients = append(v.clients, diffClient{name: fmt.Sprintf("pod@node%d", i), netns: ns, ip: ips[name], node: i})
	}
	for i := 1; i <= d.l.nodes; i++ {
		v.clients = append(v.clients, diffClient{name: fmt.Sprintf("node%d", i), netns: nodeName(i), ip: nodeAddr(i), node: i})
	}
	v.clients = append(v.clients, diffClient{name: "outside", netns: netNS, ip: bridgeAddr})
	d.view = v
	return d.makeSentinel()
}

// bridgeGateway is the first address of a node's pod subnet (the CNI bridge's).
func bridgeGateway(cidr string) (string, bool) {
	base, _, ok := strings.Cut(cidr, "/")
	if !ok {
		return "", false
	}
	parts := strings.Split(base, ".")
	if len(parts) != 4 {
		return "", false
	}
	parts[3] = "1"
	return strings.Join(parts, "."), true
}

// podNetns maps each pod address to a path of its network namespace:
// /proc/PID/ns/net of a process inside it (the pod's pause process holds
// it for the pod's life), found among the lab's processes.
func podNetns(labDir string) (map[string]string, error) {
	out := map[string]string{}
	seen := map[string]bool{}
	for _, pid := range labPids(labDir) {
		path := fmt.Sprintf("/proc/%d/ns/net", pid)
		ino, err := os.Readlink(path)
		if err != nil || seen[ino] {
			continue
		}
		seen[ino] = true
		data, err := runOut("nsenter", "--net="+path, "--", "ip", "-4", "-o", "addr", "show")
		if err != nil {
			continue
		}
		for _, line := range strings.Split(data, "\n") {
			fields := strings.Fields(line)
			for i := 0; i+1 < len(fields); i++ {
				if fields[i] == "inet" {
					addr, _, _ := strings.Cut(fields[i+1], "/")
					if addr != "127.0.0.1" {
						out[addr] = path
					}
				}
			}
		}
	}
	return out, nil
}

// The sentinel is a Service whose one endpoint the run moves between two
// pool pods after each round of writes, renaming its port in the Service
// and in its EndpointSlice at once: a proxy answers from the new pod only
// once it has both the Service and the slice written last, and so every
// Service and slice written before them (each kind reaches a proxy in the
// order it was written, but the two kinds by separate watches).
func (d *differ) makeSentinel() error {
	svc := &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: "sentinel", Namespace: diffNamespace}, Spec: v1.ServiceSpec{
		Ports: []v1.ServicePort{{Name: d.sentinelPort(), Port: 80}}}}
	got, err := d.kube.CoreV1().Services(diffNamespace).Create(d.ctx, svc, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	d.sentinelIP = got.Spec.ClusterIP
	return d.writeSentinelSlice()
}

func (d *differ) sentinelPod() string  { return []string{"pool-1a", "pool-2a"}[d.sentinelFlip%2] }
func (d *differ) sentinelPort() string { return fmt.Sprintf("http-%d", d.sentinelFlip) }

// writeSentinel renames the sentinel's port in its Service, then moves its
// endpoint and renames the port in its slice.
func (d *differ) writeSentinel() error {
	svcs := d.kube.CoreV1().Services(diffNamespace)
	svc, err := svcs.Get(d.ctx, "sentinel", metav1.GetOptions{})
	if err != nil {
		return err
	}
	svc.Spec.Ports[0].Name = d.sentinelPort()
	if _, err := svcs.Update(d.ctx, svc, metav1.UpdateOptions{}); err != nil {
		return err
	}
	return d.writeSentinelSlice()
}

func (d *differ) writeSentinelSlice() error {
	name, port := d.sentinelPort(), int32(8080)
	sl := &discovery.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "sentinel", Namespace: diffNamespace, Labels: map[string]string{
			discovery.LabelServiceName: "sentinel", discovery.LabelManagedBy: diffManagedBy}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: &name, Port: &port}},
		Endpoints:   []discovery.Endpoint{{Addresses: []string{d.view.podIPs[d.sentinelPod()]}, Conditions: discovery.EndpointConditions{Ready: ptr(true)}}},
	}
	c := d.kube.DiscoveryV1().EndpointSlices(diffNamespace)
	if _, err := c.Update(d.ctx, sl, metav1.UpdateOptions{}); apierrors.IsNotFound(err) {
		_, err = c.Create(d.ctx, sl, metav1.CreateOptions{})
		return err
	} else {
		return err
	}
}

// synced moves the sentinel and waits until every node's proxy answers
// from its new endpoint.
func (d *differ) synced() error {
	d.sentinelFlip++
	if err := d.writeSentinel(); err != nil {
		return err
	}
	want := d.sentinelPod()
	return waitFor(d.ctx, time.Minute, d.proxy+" programmed on every node", func() error {
		for _, c := range d.view.clients {
			if c.node == 0 || strings.HasPrefix(c.name, "pod@") {
				continue
			}
			r := try(c, target{addr: d.sentinelIP + ":80", proto: v1.ProtocolTCP})
			if r.endpoint != want {
				return fmt.Errorf("%s: sentinel answered by %q (%s), want %s", c.name, r.endpoint, r.outcome, want)
			}
		}
		return nil
	})
}

// serveWith makes proxy the Service proxy, stopping and cleaning up the
// one serving before.
func (d *differ) serveWith(proxy string) error {
	if d.proxy == proxy {
		return nil
	}
	if d.proxy != "" {
		if err := d.stopProxy(); err != nil {
			return fmt.Errorf("stopping %s: %w", d.proxy, err)
		}
	}
	logStart := map[int]int64{}
	for i := 1; i <= d.l.nodes; i++ {
		logStart[i] = fileSize(d.kubeProxyLog(i))
	}
	if err := d.l.deployProxy(d.ctx, d.cp, d.repo, proxy); err != nil {
		return fmt.Errorf("deploying %s: %w", proxy, err)
	}
	d.proxy = proxy
	if proxy == proxyKubeNftables || proxy == proxyKubeIptables {
		if err := d.kubeProxiesTookZones(logStart); err != nil {
			return err
		}
	}
	return d.synced()
}

// kubeProxiesTookZones makes sure every kube-proxy serves with its node's
// zone. kube-proxy v1.37 can miss it for its whole life: its node
// informer is running before the proxier registers for topology changes,
// the informer's first event for the node arrives in between, and later
// ones carry the same labels, which it skips. That kube-proxy ignores every
// topology hint ("since node is missing label") while its node has the
// label. A kube-proxy that has not said it took its zone within 20 s is
// started again (at most three times).
func (d *differ) kubeProxiesTookZones(logStart map[int]int64) error {
	for i := 1; i <= d.l.nodes; i++ {
		zone := diffZones[i]
		if zone == "" {
			continue // no label: nothing to take
		}
		for try := 1; ; try++ {
			err := waitFor(d.ctx, 20*time.Second, fmt.Sprintf("kube-proxy on %s taking its zone %s", nodeName(i), zone), func() error {
				if tookZone(d.kubeProxyLog(i), logStart[i], zone) {
					return nil
				}
				return fmt.Errorf("its log since its start has no %q with %s", kubeProxyTopologyLine, zone)
			})
			if err == nil {
				break
			}
			if try == 3 {
				return err
			}
			fmt.Fprintf(d.log, "   kube-proxy on %s did not take its node's zone (its start race): started again\n", nodeName(i))
			for _, p := range d.l.procs {
				if p.name == kubeProxyName(i) {
					stopProc(p, 10*time.Second)
				}
			}
			logStart[i] = fileSize(d.kubeProxyLog(i))
			if _, err := d.l.startKubeProxy(d.cp, d.proxy, i); err != nil {
				return err
			}
		}
	}
	return nil
}

// kubeProxyTopologyLine is what kube-proxy's proxier logs (level 4) when it
// takes its node's topology labels.
const kubeProxyTopologyLine = "Updated proxier node topology labels"

func (d *differ) kubeProxyLog(i int) string {
	return filepath.Join(d.l.dir, "logs", kubeProxyName(i)+".log")
}

// tookZone says whether the log at path, from offset on, has kube-proxy
// taking zone.
func tookZone(path string, offset int64, zone string) bool {
	b, err := os.ReadFile(path)
	if err != nil || int64(len(b)) < offset {
		return false
	}
	for _, line := range strings.Split(string(b[offset:]), "\n") {
		if strings.Contains(line, kubeProxyTopologyLine) && strings.Contains(line, zone) {
			return true
		}
	}
	return false
}

func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// saveOurLogs copies our daemons' logs beside the lab's others (kept after
// the run) before their pods go: best effort, a run does not fail on it.
func (d *differ) saveOurLogs() {
	out, err := d.cp.kubectl("-n", "kube-system", "get", "pods", "-o", "name")
	if err != nil {
		return
	}
	for _, pod := range strings.Fields(out) {
		if !strings.Contains(pod, ourDaemonSetName) {
			continue
		}
		if logs, err := d.cp.kubectl("-n", "kube-system", "logs", pod); err == nil {
			_ = os.WriteFile(filepath.Join(d.l.dir, "logs", strings.TrimPrefix(pod, "pod/")+".log"), []byte(logs), 0o644)
		}
	}
}

func (d *differ) stopProxy() error {
	switch d.proxy {
	case proxyOurs:
		d.saveOurLogs()
		if _, err := d.cp.kubectl("-n", "kube-system", "delete", "daemonset", ourDaemonSetName, "--wait=true"); err != nil {
			return err
		}
		if err := waitFor(d.ctx, 2*time.Minute, "our DaemonSet's pods gone", func() error {
			out, err := d.cp.kubectl("-n", "kube-system", "get", "pods", "-o", "name")
			if err != nil {
				return err
			}
			if strings.Contains(out, ourDaemonSetName) {
				return fmt.Errorf("still running: %s", strings.TrimSpace(out))
			}
			return nil
		}); err != nil {
			return err
		}
		for i := 1; i <= d.l.nodes; i++ {
			if err := run("", "nsenter", "--net=/run/netns/"+nodeName(i), "--", d.cp.b.ours, "--cleanup"); err != nil {
				return err
			}
		}
	case proxyKubeNftables, proxyKubeIptables:
		for _, p := range d.l.procs {
			if strings.HasPrefix(p.name, "kube-proxy-") {
				stopProc(p, 10*time.Second)
			}
		}
		for i := 1; i <= d.l.nodes; i++ {
			if err := run("", "nsenter", "--net=/run/netns/"+nodeName(i), "--", filepath.Join(d.cp.b.k8s, "kube-proxy"), "--cleanup"); err != nil {
				return err
			}
		}
	}
	return nil
}

// runShapes applies, observes and deletes the shapes, batch at a time.
// With ours given (the run of the other proxy), an endpoint set that
// lacks one ours saw is observed again with more tries before it counts:
// kube-proxy picks at random, and eight tries may miss one of four.
func (d *differ) runShapes(shapes []shape, batch int, ours map[int]*shapeRun) (map[int]*shapeRun, error) {
	runs := map[int]*shapeRun{}
	for i := 0; i < len(shapes); i += batch {
		group := shapes[i:min(i+batch, len(shapes))]
		applied := make([]*v1.Service, len(group))
		for j, s := range group {
			svc, err := d.apply(s, nil)
			if err != nil {
				return nil, fmt.Errorf("case %d: %w", s.Case, err)
			}
			applied[j] = svc
			runs[s.Case] = &shapeRun{shape: s}
		}
		for phase := 0; phase < 2; phase++ {
			if phase == 1 {
				for j, s := range group {
					if s.Edit == nil {
						continue
					}
					if s.Edit.Kind == "terminate" {
						runs[s.Case].held = d.holdConnection(applied[j])
					}
					svc, err := d.apply(s.edited(), applied[j])
					if err != nil {
						return nil, fmt.Errorf("case %d's edit: %w", s.Case, err)
					}
					applied[j] = svc
				}
			}
			if err := d.synced(); err != nil {
				return nil, err
			}
			var wg sync.WaitGroup
			for j, s := range group {
				if phase == 1 && s.Edit == nil {
					continue
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					var prior *shapeRun
					if ours != nil {
						prior = ours[s.Case]
					}
					r := runs[s.Case]
					r.phases[phase], r.health[phase] = d.observeShape(s, applied[j], prior, phase)
				}()
			}
			wg.Wait()
		}
		for _, s := range group {
			if h := runs[s.Case].held; h != nil {
				runs[s.Case].phases[1] = append(runs[s.Case].phases[1], h.check())
			}
			d.remove(s)
		}
	}
	return runs, nil
}

// apply writes the shape's objects (over prev, the Service as it stands,
// for an edit) and returns the Service with what the API server filled in.
func (d *differ) apply(s shape, prev *v1.Service) (*v1.Service, error) {
	svcs := d.kube.CoreV1().Services(diffNamespace)
	want := s.service()
	var got *v1.Service
	var err error
	if prev == nil {
		got, err = svcs.Create(d.ctx, want, metav1.CreateOptions{})
	} else {
		upd := prev.DeepCopy()
		upd.Spec.Ports = want.Spec.Ports
		for k, p := range upd.Spec.Ports {
			for _, old := range prev.Spec.Ports {
				if old.Port == p.Port && old.Protocol == p.Protocol {
					upd.Spec.Ports[k].NodePort = old.NodePort
				}
			}
		}
		upd.Spec.ExternalTrafficPolicy, upd.Spec.InternalTrafficPolicy = want.Spec.ExternalTrafficPolicy, want.Spec.InternalTrafficPolicy
		if upd.Spec.ExternalTrafficPolicy == "" && upd.Spec.Type != v1.ServiceTypeClusterIP {
			upd.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyCluster
		}
		if upd.Spec.ExternalTrafficPolicy != v1.ServiceExternalTrafficPolicyLocal {
			upd.Spec.HealthCheckNodePort = 0
		}
		if upd.Spec.InternalTrafficPolicy == nil {
			upd.Spec.InternalTrafficPolicy = ptr(v1.ServiceInternalTrafficPolicyCluster)
		}
		got, err = svcs.Update(d.ctx, upd, metav1.UpdateOptions{})
	}
	if err != nil {
		return nil, err
	}
	if s.LBIP && prev == nil {
		got.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: s.lbIP(), IPMode: ptr(v1.LoadBalancerIPModeVIP)}}
		if got, err = svcs.UpdateStatus(d.ctx, got, metav1.UpdateOptions{}); err != nil {
			return nil, fmt.Errorf("load-balancer status: %w", err)
		}
	}
	slices := d.kube.DiscoveryV1().EndpointSlices(diffNamespace)
	for _, sl := range s.slices(d.view.podIPs) {
		if prev == nil {
			_, err = slices.Create(d.ctx, sl, metav1.CreateOptions{})
		} else {
			_, err = slices.Update(d.ctx, sl, metav1.UpdateOptions{})
		}
		if err != nil {
			return nil, err
		}
	}
	return got, nil
}

func (d *differ) remove(s shape) {
	_ = d.kube.CoreV1().Services(diffNamespace).Delete(d.ctx, s.name(), metav1.DeleteOptions{})
	for _, sl := range s.slices(d.view.podIPs) {
		_ = d.kube.DiscoveryV1().EndpointSlices(diffNamespace).Delete(d.ctx, sl.Name, metav1.DeleteOptions{})
	}
}

// targets are the addresses a client dials for a Service port: the
// cluster IP, the node port on its own node and the next one (outside:
// on every node), the external IP and the load-balancer IP.
func targets(c diffClient, s shape, svc *v1.Service) []target {
	var out []target
	for _, sp := range svc.Spec.Ports {
		t := func(kind, host string, port int32) target {
			return target{kind: kind, addr: fmt.Sprintf("%s:%d", host, port), proto: sp.Protocol, port: sp.Name}
		}
		if svc.Spec.ClusterIP != "" && svc.Spec.ClusterIP != v1.ClusterIPNone {
			out = append(out, t("cluster-ip", svc.Spec.ClusterIP, sp.Port))
		}
		if sp.NodePort != 0 {
			for i := 1; i <= 3; i++ {
				if c.node == 0 || i == c.node || i == c.node%3+1 {
					out = append(out, t(fmt.Sprintf("node-port@node%d", i), nodeAddr(i), sp.NodePort))
				}
			}
		}
		if s.ExternalIP {
			out = append(out, t("external-ip", s.externalIP(), sp.Port))
		}
		if s.LBIP {
			out = append(out, t("lb-ip", s.lbIP(), sp.Port))
		}
	}
	return out
}

// observeShape observes every client at every target, one after another
// (ours balances round-robin across clients: concurrent clients would see
// parts of the rotation), and the health checks.
func (d *differ) observeShape(s shape, svc *v1.Service, prior *shapeRun, phase int) ([]observation, []string) {
	tries := 8
	if prior != nil {
		tries = 16
	}
	var obs []observation
	for _, c := range d.view.clients {
		for _, t := range targets(c, s, svc) {
			o := d.view.observe(c, t, tries)
			if prior != nil {
				if p := find(prior.phases[phase], o.key()); p != nil && missesSome(o, *p) {
					o.add(d.view, c, t, 32)
				}
			}
			obs = append(obs, o)
		}
	}
	var health []string
	if svc.Spec.HealthCheckNodePort != 0 {
		for i := 1; i <= d.l.nodes; i++ {
			health = append(health, healthCheck(i, svc.Spec.HealthCheckNodePort))
		}
	}
	return obs, health
}

func find(obs []observation, key string) *observation {
	for i := range obs {
		if obs[i].key() == key {
			return &obs[i]
		}
	}
	return nil
}

// missesSome says whether o lacks an endpoint p saw.
func missesSome(o, p observation) bool {
	have := toSet(o.Endpoints)
	for _, e := range p.Endpoints {
		if !have[e] {
			return true
		}
	}
	return false
}

// saveObservations writes every observation of both proxies, shape by
// shape, for a reader who wants more than the differences.
func saveObservations(shapes []shape, ours, ref map[int]*shapeRun) error {
	type entry struct {
		Shape  shape            `json:"shape"`
		Ours   [2][]observation `json:"ours"`
		Ref    [2][]observation `json:"kubeProxy"`
		Health [2][][]string    `json:"health"`
	}
	var all []entry
	for _, s := range shapes {
		e := entry{Shape: s}
		if r := ours[s.Case]; r != nil {
			e.Ours = r.phases
			e.Health[0] = r.health[:]
		}
		if r := ref[s.Case]; r != nil {
			e.Ref = r.phases
			e.Health[1] = r.health[:]
		}
		all = append(all, e)
	}
	path := filepath.Join(os.TempDir(), "kup-differential", "observations.json")
	if err := writeJSON(path, all); err != nil {
		return err
	}
	fmt.Printf("   every observation: %s\n", path)
	return nil
}

func writeJSON(path string, v any) error {
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, append(data, '\n'), 0o644)
}

// diffSummary is what a run found, for the results file and the docs.
type diffSummary struct {
	Date         string         `json:"date"`
	Command      string         `json:"command"`
	Seed         int64          `json:"seed"`
	Shapes       int            `json:"shapes"`
	Clients      int            `json:"clients"`
	Observations int            `json:"observations"`
	Differences  int            `json:"differences"`
	Explained    int            `json:"explained"`
	Minutes      float64        `json:"minutes"`
	ByKind       map[string]int `json:"byKind"`
	Found        []string       `json:"found,omitempty"`
}

func summarise(o diffOptions, shapes []shape, ours map[int]*shapeRun, diffs []difference, took time.Duration) diffSummary {
	sum := diffSummary{Date: time.Now().UTC().Format("2006-01-02"), Seed: o.seed, Shapes: len(shapes), Clients: 7,
		Minutes: took.Minutes(), ByKind: map[string]int{}, Command: fmt.Sprintf("make differential SEED=%d SHAPES=%d", o.seed, o.shapes)}
	for _, s := range shapes {
		sum.ByKind[string(s.Type)]++
		if r := ours[s.Case]; r != nil {
			sum.Observations += len(r.phases[0]) + len(r.phases[1])
		}
	}
	seen := map[string]bool{}
	for _, df := range diffs {
		sum.Differences++
		if df.known != "" {
			sum.Explained++
			if !seen[df.known] {
				seen[df.known] = true
				sum.Found = append(sum.Found, df.known)
			}
		}
	}
	sort.Strings(sum.Found)
	return sum
}
