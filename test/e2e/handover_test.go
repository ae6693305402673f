package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
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

// handoverLab is a lab serving lab/web with a daemon whose handover socket
// is the test's own.
type handoverLab struct {
	*Lab
	socket   string
	manifest string
	args     []string
}

// The old daemons' grace is short: a connection that was not handed over
// is cut soon after their SIGTERM, and the test sees it. Local-traffic
// detection is on, as on a kubeadm node: the pods' connections reach their
// backends with the pod's address, the node's and external clients' of
// Cluster Services with the node's.
func newHandoverLab(t *testing.T) *handoverLab {
	l := NewLab(t)
	l.Backends()
	for _, pod := range []string{"pod1", "pod2"} {
		l.Start(pod, filepath.Join(binDir, "backend"), "--name", pod, "--tcp", "", "--udp", "", "--echo", ":9007", "--echo-after-eof", ":9008")
	}
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, webManifest()+"---\n"+service("echo", "ClusterIP", "10.96.0.20", "", `{name: echo, port: 7, targetPort: 9007, protocol: TCP}`)+
		slices("echo", `{name: echo, port: 9007, protocol: TCP}`, false)+"---\n"+
		service("slowecho", "ClusterIP", "10.96.0.21", "", `{name: echo, port: 8, targetPort: 9008, protocol: TCP}`)+
		slices("slowecho", `{name: echo, port: 9008, protocol: TCP}`, false))
	return &handoverLab{Lab: l, socket: filepath.Join(t.TempDir(), "run", "handover.sock"), manifest: m,
		args: append([]string{"--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node", "--shutdown-grace", "1s"}, detectionArgs...)}
}

// echo says msg on c and reads it back.
func echo(c net.Conn, msg string) error {
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, msg); err != nil {
		return err
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if string(buf) != msg {
		return fmt.Errorf("echoed %q, want %q", buf, msg)
	}
	return nil
}

func (h *handoverLab) daemon() *Proc {
	return h.Daemon(append([]string{"--handover-socket", h.socket}, h.args...)...)
}

// waitHandoverSocket waits until p serves its handover socket: a daemon
// started before that finds none and starts on its own, beside p. A
// daemon serves Services a moment before it opens the socket, and a
// successor says it took the connections while it opens it.
func waitHandoverSocket(t *testing.T, p *Proc) {
	t.Helper()
	waitLog(t, p, "Serving the handover socket")
}

// waitLog waits until p's output has s.
func waitLog(t *testing.T, p *Proc, s string) {
	t.Helper()
	waitFor(t, "the log line "+s, func() bool { return strings.Contains(p.Output(), s) })
}

// load makes a new connection through the ClusterIP every 25 ms (40/s)
// from the client namespace, each one HTTP request, until stop; it counts
// the attempts and the failures (refused, reset, unanswered within 3 s).
type load struct {
	tries, fails atomic.Int64
	mu           sync.Mutex
	errs         []string
	errAt        []time.Time // when each of errs happened
	errStart     []time.Time // when each of errs' connections was begun
	stop         chan struct{}
	done         chan struct{}
}

func startLoad(l *Lab, addr string) *load {
	ld := &load{stop: make(chan struct{}), done: make(chan struct{})}
	dial := cluster.DialContextIn(l.NS("client"))
	var wg sync.WaitGroup
	go func() {
		defer close(ld.done)
		defer wg.Wait()
		tick := time.NewTicker(25 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ld.stop:
				return
			case <-tick.C:
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				ld.tries.Add(1)
				begun := time.Now()
				if err := request(dial, addr); err != nil {
					ld.fails.Add(1)
					now := time.Now()
					ld.mu.Lock()
					ld.errs = append(ld.errs, now.Format("15:04:05.000")+" "+err.Error())
					ld.errAt = append(ld.errAt, now)
					ld.errStart = append(ld.errStart, begun)
					ld.mu.Unlock()
				}
			}()
		}
	}()
	return ld
}

func (ld *load) end() (tries, fails int64, errs []string) {
	close(ld.stop)
	<-ld.done
	ld.mu.Lock()
	defer ld.mu.Unlock()
	return ld.tries.Load(), ld.fails.Load(), ld.errs
}

// request is one HTTP/1.0 GET / on a connection of its own.
func request(dial func(ctx context.Context, network, addr string) (net.Conn, error), addr string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	c, err := dial(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.0\r\nHost: web\r\n\r\n"); err != nil {
		return err
	}
	b, err := io.ReadAll(c)
	if err != nil {
		return err
	}
	if !strings.Contains(string(b), "pod") {
		return fmt.Errorf("answer %q", b)
	}
	return nil
}

// A successor started beside the running daemon takes its sockets over;
// the old one is stopped afterwards. Under 40 new connections a second
// through the ClusterIP not one is refused, reset or unanswered; a 200 MB
// download running across it arrives whole; a UDP client on one source
// port gets its answers; the successor serves on the same ports (the
// rules are not rewritten); a third daemon takes over from the second.
func TestHandoverRefusesNothing(t *testing.T) {
	h := newHandoverLab(t)
	first := h.daemon()
	waitFor(t, "the ClusterIP", func() bool { return strings.HasPrefix(h.Curl("client", "http://10.96.0.10/"), "pod") })
	rulesBefore := h.MustExec("node", "iptables-save", "-t", "nat")

	ld := startLoad(h.Lab, "10.96.0.10:80")
	dial := cluster.DialContextIn(h.NS("client"))
	// An idle connection held across both handovers.
	var idle net.Conn
	waitFor(t, "the echo Service", func() bool {
		c, err := dial(context.Background(), "tcp", "10.96.0.20:7")
		if err == nil && echo(c, "first") == nil {
			idle = c
			return true
		}
		if c != nil {
			c.Close()
		}
		return false
	})
	defer idle.Close()

	// A download that reads slowly enough to span the handover.
	const size = 200 << 20
	type result struct {
		sum string
		n   int64
		err error
	}
	download := make(chan result, 1)
	go func() {
		c, err := dial(context.Background(), "tcp", "10.96.0.10:80")
		if err != nil {
			download <- result{err: err}
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(2 * time.Minute))
		fmt.Fprintf(c, "GET /bytes?n=%d HTTP/1.0\r\nHost: web\r\n\r\n", size)
		br := bufio.NewReader(c)
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				download <- result{err: err}
				return
			}
			if line == "\r\n" {
				break
			}
		}
		hash := sha256.New()
		var n int64
		buf := make([]byte, 64<<10)
		for {
			k, err := br.Read(buf)
			hash.Write(buf[:k])
			n += int64(k)
			if err == io.EOF {
				break
			}
			if err != nil {
				download <- result{n: n, err: err}
				return
			}
			time.Sleep(2 * time.Millisecond) // at most ~32 MB/s: the download spans both handovers
		}
		download <- result{sum: fmt.Sprintf("%x", hash.Sum(nil)), n: n}
	}()

	// A UDP client on one fixed source port: its flow is handed over, so
	// every answer comes from the same pod.
	udp := startUDPClient(t, h.Lab, 45321, "10.96.0.10:53")

	time.Sleep(time.Second) // load before the handover
	waitHandoverSocket(t, first)
	second := h.daemon()
	waitLog(t, second, "Took over: the predecessor serves nothing more")
	waitLog(t, first, "Handed over to the successor")
	time.Sleep(time.Second) // load after the handover, the old daemon still running
	_ = first.Cmd.Process.Signal(syscall.SIGTERM)
	exited := make(chan error, 1)
	go func() { exited <- first.Cmd.Wait() }()

	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("the old daemon: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the old daemon did not exit on SIGTERM")
	}
	time.Sleep(time.Second) // load with the old daemon gone
	// And once more: a third daemon takes over from the second.
	waitHandoverSocket(t, second)
	third := h.daemon()
	waitLog(t, third, "Took over: the predecessor serves nothing more")
	time.Sleep(time.Second)
	_ = second.Cmd.Process.Signal(syscall.SIGTERM)
	_ = second.Cmd.Wait()
	time.Sleep(500 * time.Millisecond)
	if err := echo(idle, "after two handovers"); err != nil {
		t.Errorf("the idle connection held across the handovers: %v", err)
	}
	r := <-download
	if r.err != nil || r.n != size {
		t.Errorf("download: %d of %d bytes, %v", r.n, size, r.err)
	} else if want := zeroSum(size); r.sum != want {
		t.Errorf("download sha256 %s, want %s", r.sum, want)
	}

	tries, fails, errs := ld.end()
	udp.end(t)
	t.Logf("%d connections, %d failed", tries, fails)
	if fails > 0 {
		t.Errorf("%d of %d connections failed across the handovers: %s", fails, tries, strings.Join(errs, "; "))
	}
	if tries < 100 {
		t.Errorf("only %d connections tried", tries)
	}
	for _, p := range []*Proc{second, third} {
		if !strings.Contains(p.Output(), "Took the predecessor's connections") ||
			!strings.Contains(grepLines(p.Output(), "Took the predecessor"), "connections=") {
			t.Errorf("no adoption logged:\n%s", tail(p.Output(), 2000))
		}
	}
	for _, p := range []*Proc{first, second} {
		if !strings.Contains(p.Output(), "UDP flows transferred") {
			t.Errorf("the old daemon handed no UDP flow over:\n%s", grepLines(p.Output(), "handover"))
		}
	}
	if after := h.MustExec("node", "iptables-save", "-t", "nat"); stripCounters(after) != stripCounters(rulesBefore) {
		t.Errorf("the rules changed across the handovers:\nbefore:\n%s\nafter:\n%s", rulesBefore, after)
	}
	if os.Getenv("HANDOVER_LOGS") != "" {
		t.Logf("first:\n%s\nsecond:\n%s\nthird:\n%s", first.Output(), second.Output(), third.Output())
	}
	for _, p := range []*Proc{first, second} {
		if strings.Contains(p.Output(), "level=error") {
			t.Errorf("errors in a handed-over daemon's log:\n%s", grepLines(p.Output(), "level=error"))
		}
	}
}

// udpClient asks one question every 50 ms from one fixed source port, as
// a resolver or game client does, and counts the answers by pod.
type udpClient struct {
	sent, answered atomic.Int64
	mu             sync.Mutex
	pods           map[string]int
	stop, done     chan struct{}
}

func startUDPClient(t *testing.T, l *Lab, port int, addr string) *udpClient {
	u := &udpClient{pods: map[string]int{}, stop: make(chan struct{}), done: make(chan struct{})}
	var c net.Conn
	err := cluster.InNetns(l.NS("client"), func() error {
		var err error
		c, err = (&net.Dialer{LocalAddr: &net.UDPAddr{Port: port}}).Dial("udp", addr)
		return err
	})
	if err != nil {
		t.Fatalf("UDP client: %v", err)
	}
	go func() {
		defer close(u.done)
		defer c.Close()
		buf := make([]byte, 512)
		for {
			select {
			case <-u.stop:
				return
			default:
			}
			u.sent.Add(1)
			_, _ = c.Write([]byte("hello"))
			_ = c.SetReadDeadline(time.Now().Add(time.Second))
			if n, err := c.Read(buf); err == nil && n > 0 {
				u.answered.Add(1)
				pod, _, _ := strings.Cut(string(buf[:n]), ":")
				u.mu.Lock()
				u.pods[pod]++
				u.mu.Unlock()
				time.Sleep(50 * time.Millisecond)
			}
		}
	}()
	return u
}

// answeredBy is how many answers each pod gave so far.
func (u *udpClient) answeredBy() map[string]int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return maps.Clone(u.pods)
}

// end stops the client and checks that ≥ 99 % of its questions were
// answered, all by one pod.
func (u *udpClient) end(t *testing.T) {
	t.Helper()
	close(u.stop)
	<-u.done
	u.mu.Lock()
	defer u.mu.Unlock()
	s, a := u.sent.Load(), u.answered.Load()
	t.Logf("UDP: %d of %d answered, by %v", a, s, u.pods)
	if a*100 < s*99 {
		t.Errorf("UDP: %d of %d answered, want ≥ 99 %%", a, s)
	}
	if len(u.pods) != 1 {
		t.Errorf("the UDP client on one source port was answered by %v: its flow did not stay with its endpoint", u.pods)
	}
}

// zeroSum is the sha256 of n zero bytes.
func zeroSum(n int) string {
	h := sha256.New()
	buf := make([]byte, 1<<20)
	for n > 0 {
		k := min(n, len(buf))
		h.Write(buf[:k])
		n -= k
	}
	return fmt.Sprintf("%x", h.Sum(nil))
}

// stripCounters drops iptables-save's comments and counters.
func stripCounters(s string) string {
	var out []string
	for _, line := range strings.Split(s, "\n") {
		if strings.HasPrefix(line, "#") {
			continue
		}
		if strings.HasPrefix(line, ":") {
			if i := strings.Index(line, " ["); i > 0 {
				line = line[:i]
			}
		}
		out = append(out, line)
	}
	return strings.Join(out, "\n")
}

// Without a successor, SIGTERM keeps the rules and the next start (with a
// handover socket left behind by the old daemon) serves within 3 s.
func TestRestartWithoutSuccessor(t *testing.T) {
	h := newHandoverLab(t)
	first := h.daemon()
	waitFor(t, "the ClusterIP", func() bool { return strings.HasPrefix(h.Curl("client", "http://10.96.0.10/"), "pod") })
	_ = first.Cmd.Process.Signal(syscall.SIGTERM)
	_ = first.Cmd.Wait()
	if n := countRules(t, h.Lab, `lab/web`); n == 0 {
		t.Fatal("the rules went with the daemon")
	}
	if !strings.Contains(first.Output(), "Stopped serving: the rules stay, so this node refuses every new connection") {
		t.Errorf("the stopped daemon does not say that the node refuses until the next start:\n%s", tail(first.Output(), 2000))
	}
	if _, err := os.Stat(h.socket); err != nil {
		t.Logf("handover socket after SIGTERM: %v", err)
	}
	start := time.Now()
	second := h.daemon()
	testutil.WaitFor(t, "serving again", 3*time.Second, 20*time.Millisecond, func() bool {
		return strings.HasPrefix(h.Curl("client", "http://10.96.0.10/"), "pod")
	})
	t.Logf("serving %v after the start", time.Since(start).Round(time.Millisecond))
	if strings.Contains(second.Output(), "Taking over") {
		t.Error("took over from a daemon that had stopped")
	}
	// kill -9: the next start is as plain.
	_ = second.Cmd.Process.Kill()
	_ = second.Cmd.Wait()
	third := h.daemon()
	testutil.WaitFor(t, "serving after kill -9", 3*time.Second, 20*time.Millisecond, func() bool {
		return strings.HasPrefix(h.Curl("client", "http://10.96.0.10/"), "pod")
	})
	if strings.Contains(third.Output(), "Taking over") {
		t.Error("took over from a killed daemon")
	}
}

// daemonUsage is a daemon's descriptors, goroutines and resident memory.
type daemonUsage struct {
	fds, goroutines int
	rssKiB          int
}

func usageOf(t *testing.T, h *handoverLab, p *Proc) daemonUsage {
	t.Helper()
	pid := p.Cmd.Process.Pid
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	u := daemonUsage{fds: len(fds)}
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			fmt.Sscanf(strings.TrimSpace(v), "%d", &u.rssKiB)
		}
	}
	for _, line := range strings.Split(h.Curl("node", "http://127.0.0.1:10249/metrics"), "\n") {
		if v, ok := strings.CutPrefix(line, "go_goroutines "); ok {
			fmt.Sscanf(v, "%d", &u.goroutines)
		}
	}
	return u
}

// goroutineStacks is the serving daemon's goroutines, grouped by stack
// (--profiling).
func goroutineStacks(h *handoverLab) string {
	return h.Curl("node", "http://127.0.0.1:10249/debug/pprof/goroutine?debug=1")
}

// handovers is how many TestManyHandovers makes (KUP_HANDOVERS overrides).
func handovers() int {
	if n, err := strconv.Atoi(os.Getenv("KUP_HANDOVERS")); err == nil && n > 0 {
		return n
	}
	return 100
}

// 100 handovers in a row under load (40 new connections a second, an idle
// connection held throughout and keep-alive ones to the loaded Service, one
// seeing the pod, one the node; a UDP client on one source port): no client
// error, the UDP client kept its endpoint at every handover, and the last
// daemon, once the load is over, holds no more descriptors, goroutines or
// memory than the first successor did under it.
func TestManyHandovers(t *testing.T) {
	h := newHandoverLab(t)
	h.args = append(h.args, "--profiling") // the goroutines' stacks, should their count grow
	cur := h.daemon()
	waitFor(t, "the ClusterIP", func() bool { return strings.HasPrefix(h.Curl("client", "http://10.96.0.10/"), "pod") })
	dial := cluster.DialContextIn(h.NS("client"))
	idle, err := dial(context.Background(), "tcp", "10.96.0.20:7")
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	if err := echo(idle, "first"); err != nil {
		t.Fatal(err)
	}
	// Keep-alive connections to the Service the load reaches: a pod's,
	// whose backend sees the pod, and an external client's, whose
	// backend sees the node (externalTrafficPolicy Cluster).
	held := map[string]*heldConn{}
	for _, c := range []struct{ ns, addr, sees string }{{"client", "10.96.0.10:80", "10.251.19.20"}, {"ext", "203.0.113.10:80", "10.251.19.1"}} {
		k := dialKeepAliveIn(t, h.Lab, c.ns, c.addr)
		pod, peer, err := k.ask()
		if err != nil || !seenOK(peer, c.sees) {
			t.Fatalf("%s → %s: %q seeing %q, %v; want the backend to see %s", c.ns, c.addr, pod, peer, err, c.sees)
		}
		held[c.ns] = &heldConn{name: c.ns + " → " + c.addr, k: k, pod: pod, sees: peer}
	}
	ld := startLoad(h.Lab, "10.96.0.10:80")
	udp := startUDPClient(t, h.Lab, 45322, "10.96.0.10:53")
	n := handovers()
	var first daemonUsage
	var firstStacks string
	for i := 1; i <= n; i++ {
		waitHandoverSocket(t, cur)
		next := h.daemon()
		waitLog(t, next, "Took the predecessor's connections")
		_ = cur.Cmd.Process.Signal(syscall.SIGTERM)
		if err := cur.Cmd.Wait(); err != nil {
			t.Fatalf("handover %d: the old daemon: %v\n%s", i, err, tail(cur.Output(), 20))
		}
		if pods := udp.answeredBy(); len(pods) > 1 {
			t.Fatalf("handover %d: the UDP client on one source port was answered by %v\nthe old daemon:\n%s\nthe successor:\n%s",
				i, pods, tail(cur.Output(), 3000), tail(next.Output(), 3000))
		}
		cur = next
		if err := echo(idle, fmt.Sprintf("after handover %d", i)); err != nil {
			t.Fatalf("the idle connection after handover %d: %v", i, err)
		}
		for _, c := range held {
			if pod, peer, err := c.k.ask(); err != nil || pod != c.pod || peer != c.sees {
				t.Fatalf("handover %d: %s (%s, seeing %s) answered %q seeing %q, %v", i, c.name, c.pod, c.sees, pod, peer, err)
			}
		}
		if i == 1 {
			first = usageOf(t, h, cur)
			firstStacks = goroutineStacks(h)
		}
	}
	tries, fails, errs := ld.end()
	udp.end(t)
	// The first successor was measured under the load, the last is once
	// the load's connections have ended (their descriptors and goroutines
	// go a moment after the client's, and a burst's parked workers within
	// two of the pool's 10 s idle periods): a leak of one descriptor or
	// goroutine per handover would stand 100 above.
	var last daemonUsage
	deadline := time.Now().Add(25 * time.Second)
	for {
		last = usageOf(t, h, cur)
		if last.fds <= first.fds+5 && last.goroutines <= first.goroutines+5 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("%d handovers; %d connections, %d failed; first successor %+v, last %+v", n, tries, fails, first, last)
	if fails > 0 {
		t.Errorf("%d of %d connections failed: %s", fails, tries, strings.Join(errs, "; "))
	}
	if last.fds > first.fds+5 {
		t.Errorf("descriptors grew from %d to %d", first.fds, last.fds)
	}
	if last.goroutines > first.goroutines+5 {
		t.Errorf("goroutines grew from %d to %d; the first successor's:\n%s\nthe last's:\n%s",
			first.goroutines, last.goroutines, firstStacks, goroutineStacks(h))
	}
	if last.rssKiB > first.rssKiB*3/2+10<<10 {
		t.Errorf("RSS grew from %d KiB to %d KiB", first.rssKiB, last.rssKiB)
	}
}

// keepAlive is one HTTP/1.1 connection through a Service, asked again and
// again: a client that holds its connection across a handover.
type keepAlive struct {
	c  net.Conn
	br *bufio.Reader
}

func dialKeepAlive(t *testing.T, l *Lab, addr string) *keepAlive {
	t.Helper()
	return dialKeepAliveIn(t, l, "client", addr)
}

// dialKeepAliveIn is dialKeepAlive from namespace ns.
func dialKeepAliveIn(t *testing.T, l *Lab, ns, addr string) *keepAlive {
	t.Helper()
	c, err := cluster.DialContextIn(l.NS(ns))(context.Background(), "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	k := &keepAlive{c: c, br: bufio.NewReader(c)}
	if _, err := k.get(); err != nil {
		t.Fatal(err)
	}
	return k
}

// get asks once and returns the pod that answered, within 5 s.
func (k *keepAlive) get() (string, error) {
	pod, _, err := k.ask()
	return pod, err
}

// ask asks once and returns the pod that answered and the client address
// it saw, within 5 s.
func (k *keepAlive) ask() (pod, peer string, err error) {
	_ = k.c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(k.c, "GET / HTTP/1.1\r\nHost: web\r\n\r\n"); err != nil {
		return "", "", err
	}
	resp, err := http.ReadResponse(k.br, nil)
	if err != nil {
		return "", "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", "", err
	}
	if f := strings.Fields(string(b)); len(f) > 0 {
		return f[0], peerOf(string(b)), nil
	}
	return "", "", fmt.Errorf("empty answer")
}

// Either side killed with -9 half-way through a handover. The API server
// is stopped first, so that the successor, once it holds the sockets,
// waits before its first sync: the exchange is open, the running daemon
// still serving. A successor killed there leaves the running daemon
// serving (not one connection refused or lost) and the next successor
// takes over as usual. A running daemon killed there leaves its
// connections closed (never owned twice) and its listening sockets with
// the successor, which serves every Service at its first sync: nothing
// is refused meanwhile, connections wait in the kernel's backlog.
func TestHandoverKilledMidway(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "handover.sock")
	cl := startClusterLab(t, clusterLabOptions{daemonArgs: append([]string{"--handover-socket", socket, "--shutdown-grace", "1s"}, detectionArgs...)})
	cl.pod(t, "pod1", "10.251.19.12", "node", "web")
	cl.service(t, webService("web", "10.96.0.10"))
	cl.expectPods(t, "client", "http://10.96.0.10/", "pod1")
	kc := cl.deployKubeconfig(t, cl.cp.URL)
	start := func() *Proc {
		p := cl.Daemon(append([]string{"--kubeconfig", kc, "--hostname-override", "node", "--min-sync-period", "100ms",
			"--handover-socket", socket, "--shutdown-grace", "1s"}, detectionArgs...)...)
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("daemon %d's log:\n%s", p.Cmd.Process.Pid, tail(p.Output(), 4000))
			}
		})
		return p
	}
	first := cl.daemon
	// Held across the first handover: a pod's connection, whose backend
	// sees the pod, and the node's own.
	held := dialKeepAlive(t, cl.Lab, "10.96.0.10:80")
	heldNode := dialKeepAliveIn(t, cl.Lab, "node", "10.96.0.10:80")
	askBoth := func(when string) {
		t.Helper()
		for _, c := range []struct {
			k    *keepAlive
			sees string
		}{{held, "10.251.19.20"}, {heldNode, ""}} {
			pod, peer, err := c.k.ask()
			if err != nil || pod != "pod1" || c.sees != "" && !seenOK(peer, c.sees) {
				t.Fatalf("the held connection (seeing %q) %s: %q seeing %q, %v", c.sees, when, pod, peer, err)
			}
		}
	}
	askBoth("before the handovers")

	// The successor killed half-way: the first daemon serves on.
	ld := startLoad(cl.Lab, "10.96.0.10:80")
	cl.cp.StopAPIServer()
	waitHandoverSocket(t, first)
	killed := start()
	waitLog(t, killed, "Taking over from the running daemon")
	_ = killed.Cmd.Process.Kill()
	_ = killed.Cmd.Wait()
	waitLog(t, first, "Handover broke off before the successor synced; serving on")
	askBoth("after the successor was killed")
	if err := cl.cp.StartAPIServer(cl.ctx); err != nil {
		t.Fatal(err)
	}
	second := start()
	waitLog(t, second, "Took the predecessor's connections")
	_ = first.Cmd.Process.Signal(syscall.SIGTERM)
	if err := first.Cmd.Wait(); err != nil {
		t.Errorf("the first daemon on SIGTERM: %v", err)
	}
	askBoth("after the next successor took over")
	tries, fails, errs := ld.end()
	t.Logf("successor killed: %d connections, %d failed", tries, fails)
	if fails > 0 {
		t.Errorf("%d of %d connections failed with the successor killed half-way: %s", fails, tries, strings.Join(errs, "; "))
	}

	// The running daemon killed half-way: its connections are closed, the
	// successor serves at its first sync, and nothing is refused.
	ld = startLoad(cl.Lab, "10.96.0.10:80")
	cl.cp.StopAPIServer()
	third := start()
	waitLog(t, third, "Taking over from the running daemon")
	killedAt := time.Now()
	_ = second.Cmd.Process.Kill()
	_ = second.Cmd.Wait()
	gone := time.Now()
	for _, k := range []*keepAlive{held, heldNode} {
		if pod, err := k.get(); err == nil {
			t.Errorf("a held connection answered (%q) after its owner was killed: owned twice", pod)
		}
	}
	if err := cl.cp.StartAPIServer(cl.ctx); err != nil {
		t.Fatal(err)
	}
	waitLog(t, third, "msg=Synced")
	testutil.WaitFor(t, "the ClusterIP right after the survivor's first sync", 3*time.Second, 20*time.Millisecond, func() bool {
		return strings.HasPrefix(cl.Curl("client", "http://10.96.0.10/"), "pod1")
	})
	// Its own source: a Service added after the handover is served.
	cl.pod(t, "pod2", "10.251.19.8", "node", "web2")
	cl.service(t, webService("web2", "10.96.0.11"))
	cl.expectPods(t, "client", "http://10.96.0.11/", "pod2")
	tries, fails, errs = ld.end()
	t.Logf("running daemon killed: %d connections, %d failed (waiting in the backlog for the survivor's first sync, or the killed daemon's own): %s",
		tries, fails, strings.Join(errs, "; "))
	for i, e := range errs {
		// A connection the killed daemon had accepted and not yet
		// answered is closed with it, by a reset (its request unread):
		// closed, never owned twice. Any other reset, and any refusal,
		// is a connection dropped.
		ownAtKill := strings.Contains(e, "reset") && !ld.errAt[i].Before(killedAt) && ld.errAt[i].Before(gone.Add(time.Second))
		if strings.Contains(e, "refused") || strings.Contains(e, "reset") && !ownAtKill {
			t.Errorf("a connection was refused or reset with the running daemon killed half-way: %s", e)
		}
	}
	if strings.Contains(third.Output(), "level=error") {
		t.Errorf("errors in the survivor's log:\n%s", grepLines(third.Output(), "level=error"))
	}
}

// What decides future picks moves with the handover: a drain set by hand
// on the old daemon holds in the new one (every connection to the other
// endpoint), and clients pinned by ClientIP affinity keep their endpoint.
// Without it the successor would start both afresh: the drained endpoint
// back in rotation, the pins made again wherever round-robin stands.
func TestHandoverKeepsPickState(t *testing.T) {
	h := newHandoverLab(t)
	writeManifest(t, h.manifest, pickStateManifest())
	first := h.daemon()
	pinned := setPickState(t, h)
	waitHandoverSocket(t, first)
	second := h.daemon()
	waitLog(t, second, "Took over: the predecessor serves nothing more")
	_ = first.Cmd.Process.Signal(syscall.SIGTERM)
	_ = first.Cmd.Wait()
	checkPickState(t, h, pinned, "the handover")
}

// pickStateManifest is lab/web and lab/sticky (ClientIP affinity).
func pickStateManifest() string {
	return webManifest() + stickyManifest + slices("sticky", `{name: http, port: 8080, protocol: TCP}`, false)
}

// setPickState pins the client's and the node's connections to lab/sticky
// and drains pod1 of lab/web by hand; it returns the pins.
func setPickState(t *testing.T, h *handoverLab) (pinned map[string]string) {
	t.Helper()
	reachesBoth(t, h.Lab, "client", "http://10.96.0.10:80/")
	waitFor(t, "the sticky Service", func() bool { return strings.HasPrefix(h.Curl("client", "http://10.96.0.20/"), "pod") })
	pinned = map[string]string{}
	for _, ns := range []string{"client", "node"} {
		pinned[ns] = strings.Fields(h.Curl(ns, "http://10.96.0.20/"))[0]
	}
	out := h.MustExec("node", "curl", "-s", "--unix-socket", h.AdminSocket, "-X", "POST", "-H", "X-Kube-Userspace-Proxy: drain",
		"http://localhost/debug/drain?service=lab/web:http&endpoint=10.251.19.12:8080")
	if !strings.Contains(out, `"drained": true`) {
		t.Fatalf("drain: %s", out)
	}
	return pinned
}

// checkPickState checks, after what, that setPickState's drain and pins
// hold.
func checkPickState(t *testing.T, h *handoverLab, pinned map[string]string, after string) {
	t.Helper()
	for i := 0; i < 10; i++ {
		if got := h.Curl("client", "http://10.96.0.10/"); !strings.HasPrefix(got, "pod2") {
			t.Fatalf("request %d after %s reached %q: the drain of pod1 was lost", i, after, got)
		}
		for ns, pod := range pinned {
			if got := h.Curl(ns, "http://10.96.0.20/"); !strings.HasPrefix(got, pod) {
				t.Fatalf("%s, pinned to %s, reached %q after %s", ns, pod, got, after)
			}
		}
	}
}

// A half-closed connection goes over too: the client sent its request and
// its FIN, the backend answers slowly for seconds after it. The old daemon
// is stopped right after the handover with a 1 s grace, long before the
// answer ends: every byte arrives, then the backend's FIN, because the
// successor carries the connection on (the direction that ended stays
// ended, the other copies on).
func TestHandoverHalfClosed(t *testing.T) {
	h := newHandoverLab(t)
	first := h.daemon()
	dial := cluster.DialContextIn(h.NS("client"))
	var c net.Conn
	waitFor(t, "the slow echo Service", func() bool {
		var err error
		c, err = dial(context.Background(), "tcp", "10.96.0.21:8")
		return err == nil
	})
	defer c.Close()
	sent := make([]byte, 300<<10) // echoed back in ~3 s
	for i := range sent {
		sent[i] = byte(i * 7)
	}
	if _, err := c.Write(sent); err != nil {
		t.Fatal(err)
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	got := make([]byte, 4096)
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatalf("the first bytes of the answer: %v", err)
	}
	waitHandoverSocket(t, first)
	second := h.daemon()
	waitLog(t, second, "Took the predecessor's connections")
	_ = first.Cmd.Process.Signal(syscall.SIGTERM)
	if err := first.Cmd.Wait(); err != nil {
		t.Errorf("the old daemon: %v", err)
	}
	rest, err := io.ReadAll(c)
	got = append(got, rest...)
	if err != nil || !bytes.Equal(got, sent) {
		t.Fatalf("the half-closed connection across the handover: %d of %d bytes, equal %v, %v\nold daemon:\n%s",
			len(got), len(sent), bytes.Equal(got, sent[:min(len(got), len(sent))]), err, grepLines(first.Output(), "transferred"))
	}
	// Adopted while the answer was still coming (a pair left in the old
	// daemon would be adopted as none, once it had ended there).
	if !strings.Contains(grepLines(second.Output(), "Took the predecessor"), "connections=1") {
		t.Errorf("the successor did not take the half-closed connection:\n%s", grepLines(second.Output(), "Took the predecessor"))
	}
}

// A daemon started by hand beside the running one for a look, with other
// settings (no rules, other HTTP ports), is no successor: it exits non-zero
// with one line naming the running daemon, what differs and how to run
// beside it, and the running daemon, which logs who asked, serves on
// untouched. Started as that line says (an empty --handover-socket), it runs
// beside and its stop leaves the node served. A true successor still takes
// over afterwards.
func TestOnlyATrueSuccessorTakesOver(t *testing.T) {
	h := newHandoverLab(t)
	first := h.daemon()
	waitFor(t, "the ClusterIP", func() bool { return strings.HasPrefix(h.Curl("client", "http://10.96.0.10/"), "pod") })
	held := dialKeepAlive(t, h.Lab, "10.96.0.10:80")
	byHand := append([]string{"--iptables=false", "--metrics-bind-address", "127.0.0.1:10259", "--healthz-bind-address", "127.0.0.1:10266"}, h.args...)

	waitHandoverSocket(t, first)
	look := h.Daemon(append([]string{"--handover-socket", h.socket}, byHand...)...)
	exited := make(chan error, 1)
	go func() { exited <- look.Cmd.Wait() }()
	select {
	case err := <-exited:
		if err == nil {
			t.Fatalf("the daemon started by hand exited 0:\n%s", look.Output())
		}
	case <-time.After(20 * time.Second):
		_ = look.Cmd.Process.Kill()
		<-exited // the lab's cleanup must not Wait on it beside this goroutine
		t.Fatalf("the daemon started by hand did not exit:\n%s", tail(look.Output(), 3000))
	}
	line := grepLines(look.Output(), "level=error")
	t.Logf("the daemon started by hand said: %s", line)
	for _, want := range []string{fmt.Sprintf("pid %d", first.Cmd.Process.Pid), `rules: the running daemon's \"managed\", this one's \"not managed (--iptables=false)\"`,
		"--handover-socket ''", "serves on, untouched"} {
		if !strings.Contains(line, want) {
			t.Errorf("the refused daemon's line lacks %q:\n%s", want, look.Output())
		}
	}
	if strings.Contains(look.Output(), "Taking over") || strings.Count(strings.TrimSpace(line), "\n") > 0 {
		t.Errorf("the refused daemon took something, or said more than one error line:\n%s", look.Output())
	}
	waitLog(t, first, "Handover refused: the successor would serve this node otherwise")
	if !strings.Contains(grepLines(first.Output(), "Handover refused"), "--iptables=false") {
		t.Errorf("the running daemon's refusal does not say who asked:\n%s", grepLines(first.Output(), "Handover refused"))
	}
	if pod, err := held.get(); err != nil || !strings.HasPrefix(pod, "pod") {
		t.Fatalf("the held connection after the refusal: %q %v", pod, err)
	}
	for i := range 10 {
		if got := h.Curl("client", "http://10.96.0.10/"); !strings.HasPrefix(got, "pod") {
			t.Fatalf("request %d after the refusal: %q", i, got)
		}
	}

	// Beside it, as the line says: it serves its own listeners, and its
	// stop leaves the node served.
	beside := h.Daemon(append([]string{"--handover-socket", ""}, byHand...)...)
	waitLog(t, beside, "msg=Synced")
	_ = beside.Cmd.Process.Signal(syscall.SIGTERM)
	if err := beside.Cmd.Wait(); err != nil {
		t.Errorf("the daemon beside: %v", err)
	}
	if strings.Contains(first.Output(), "Serving nothing more") {
		t.Fatal("the running daemon let go of its sockets")
	}
	for i := range 10 {
		if got := h.Curl("client", "http://10.96.0.10/"); !strings.HasPrefix(got, "pod") {
			t.Fatalf("request %d after the daemon beside stopped: %q", i, got)
		}
	}

	// A true successor still takes over.
	waitHandoverSocket(t, first)
	next := h.daemon()
	waitLog(t, next, "Took over: the predecessor serves nothing more")
	_ = first.Cmd.Process.Signal(syscall.SIGTERM)
	_ = first.Cmd.Wait()
	if pod, err := held.get(); err != nil || !strings.HasPrefix(pod, "pod") {
		t.Fatalf("the held connection after the true successor took over: %q %v", pod, err)
	}
}

// A rollout stops the old daemon as soon as the new one is ready, which
// is when the new one has taken over — while the live connections are
// still on their way to it. That stop must not break off their transfer:
// the old daemon finishes moving them, then ends. (It cut every one of
// them: the soak found it, a handover followed by SIGTERM within the
// transfer's few tens of milliseconds.) 400 idle connections (half seeing
// the pod, as detection is on; all through the echo Service), SIGTERM to
// the old daemon within milliseconds of "Took over": every connection
// echoes afterwards, on the successor.
func TestStopDuringTheConnectionsTransfer(t *testing.T) {
	h := newHandoverLab(t)
	old := h.daemon()
	waitFor(t, "the echo Service", func() bool { return strings.HasPrefix(h.Curl("client", "http://10.96.0.10/"), "pod") })
	var conns []net.Conn
	for i, ns := range []string{"client", "node"} {
		dial := cluster.DialContextIn(h.NS(ns))
		for j := 0; j < 200; j++ {
			c, err := dial(context.Background(), "tcp", "10.96.0.20:7")
			if err != nil {
				t.Fatalf("connection %d from %s: %v", j, ns, err)
			}
			t.Cleanup(func() { c.Close() })
			if err := echo(c, fmt.Sprintf("hello %d %d", i, j)); err != nil {
				t.Fatalf("connection %d from %s: %v", j, ns, err)
			}
			conns = append(conns, c)
		}
	}
	waitHandoverSocket(t, old)
	next := h.daemon()
	testutil.WaitFor(t, "the successor taking over", time.Minute, time.Millisecond, func() bool {
		return strings.Contains(next.Output(), "Took over: the predecessor serves nothing more")
	})
	_ = old.Cmd.Process.Signal(syscall.SIGTERM)
	if err := old.Cmd.Wait(); err != nil {
		t.Fatalf("the old daemon: %v\n%s", err, tail(old.Output(), 3000))
	}
	var cut []string
	for i, c := range conns {
		if err := echo(c, fmt.Sprintf("after %d", i)); err != nil {
			cut = append(cut, fmt.Sprintf("%d: %v", i, err))
		}
	}
	if len(cut) > 0 {
		t.Fatalf("%d of %d connections cut by the stop during their transfer (%s …)\nthe old daemon:\n%s\nthe successor:\n%s",
			len(cut), len(conns), cut[0], grepLines(old.Output(), "handover"), grepLines(next.Output(), "handover"))
	}
	if !strings.Contains(next.Output(), "Took the predecessor's connections") {
		t.Errorf("the successor did not say it adopted the connections:\n%s", grepLines(next.Output(), "handover"))
	}
}
