package e2e

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	stdslices "slices" // the package has a func named slices (manifests)
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

// The soak: a mixed load on the cluster lab while the world around the
// daemon misbehaves, for KUP_SOAK (a Go duration; 5 minutes in make test,
// hours in make soak). What it keeps:
//
//   - clients of every kind: new TCP connections from a pod, from the node
//     and from outside (NodePort, externalIP), UDP from one fixed source
//     port and from a new port each time, a long echo stream, an idle
//     connection asked now and then, a ClientIP-affinity client;
//   - one event at a time, each undone before the next: an endpoint going
//     not ready, a Service edited, a backend killed -9 and restarted, a
//     backend stopped (SIGSTOP) for a while, a handover to a second keeper,
//     the daemon's worker killed -9;
//   - after every event, in the lab's resting state, a sample: the
//     worker's and the keeper's descriptors and memory, the worker's
//     goroutines, the node's live conntrack entries (TIME_WAIT and CLOSE
//     ones are the kernel's bounded bookkeeping), its listening sockets,
//     its rules.
//
// It fails on a client error no event explains (each event says which
// clients it may trouble, how and for how long), and on a figure that
// grows. Across the run: the lowest of the last third of the samples above
// the highest of the first third by more than the figure's margin, or any
// sample above twice the first third's highest plus the margin; rules and
// listening sockets, sampled at rest, must not change at all. Within one
// worker's life (a handover or a kill starts the next, which would hide a
// leak behind a sawtooth): the descriptors and goroutines no connection or
// flow owns must not grow by more than their margin.
//
// KUP_SOAK_RECORD=DIR writes the samples (samples.tsv), the errors
// (errors.txt) and the curves (curves.svg) there. KUP_CRASHTEST_LEAK=1
// runs a worker that leaks (cmd/kube-userspace-proxy/crashtest.go): the
// soak must fail on it.
func TestSoak(t *testing.T) {
	if basicKernel {
		t.Skip("the soak looks for leaks in the daemon's own code, which the basic kernel's leg shares; it runs in the main leg")
	}
	dur := soakDuration(t)
	s := newSoak(t, dur)
	s.run()
}

func soakDuration(t *testing.T) time.Duration {
	v := os.Getenv("KUP_SOAK")
	if v == "" {
		return 5 * time.Minute
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < time.Minute {
		t.Fatalf("KUP_SOAK=%q: want a duration of at least 1m", v)
	}
	return d
}

const (
	soakWeb    = "10.96.5.10"
	soakSticky = "10.96.5.11"
	soakEcho   = "10.96.5.12"
	soakExtIP  = "203.0.113.50"
	soakNodeIP = "192.168.50.1"
)

// soakError is one client's failure.
type soakError struct {
	client, class string // class: refused, timeout, cut, moved
	begun, at     time.Time
	text          string
}

func (e soakError) String() string {
	return fmt.Sprintf("%s %s %s (begun %s): %s", e.at.Format("15:04:05.000"), e.client, e.class, e.begun.Format("15:04:05.000"), e.text)
}

// soakEvent is one disturbance: while it lasts, and for a grace after,
// the clients it names may fail in the classes it names.
type soakEvent struct {
	name       string
	start, end time.Time
	allowed    map[string][]string // client → classes
}

// soakSample is the lab at rest.
type soakSample struct {
	at                              time.Duration
	worker                          int // its pid: one per life
	workerFDs, workerRSSKiB         int
	goroutines                      int
	conns, flows                    int // TCP connections and UDP flows open
	unownedFDs, unownedGoroutines   int // beyond 2 per connection, 1 per flow
	keeperFDs, keeperRSSKiB         int
	conntrack, listening, rules     int
	errors, unexplained, connsTried int
}

type soak struct {
	t   *testing.T
	cl  *clusterLab
	dur time.Duration

	socket  string // the handover socket both keepers share
	keeper  *Proc
	keepers []*Proc // every keeper started, for the logs around an unexplained error
	handovr int

	mu   sync.Mutex
	errs []soakError
	// unexplainedShown is how many unexplained errors the samples logged.
	unexplainedShown int
	events           []soakEvent
	samples          []soakSample
	tries            int

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	begun  time.Time
}

func newSoak(t *testing.T, dur time.Duration) *soak {
	cl := startClusterLab(t, clusterLabOptions{noDaemon: true})
	s := &soak{t: t, cl: cl, dur: dur, socket: filepath.Join(t.TempDir(), "run", "handover.sock")}
	for _, pod := range []string{"pod1", "pod2"} {
		s.startEcho(pod)
	}
	s.objects()
	s.keeper = s.startKeeper()
	waitFor(t, "the worker's sockets kept", func() bool { return strings.Contains(s.keeper.Output(), "Kept: a keeper holds") })
	s.ctx, s.cancel = context.WithCancel(context.Background())
	t.Cleanup(func() {
		s.cancel()
		s.wg.Wait()
	})
	return s
}

func (s *soak) startEcho(pod string) {
	s.cl.Start(pod, filepath.Join(binDir, "backend"), "--name", pod, "--tcp", "", "--udp", "", "--echo", ":9007")
}

// objects creates the pods and Services the clients use.
func (s *soak) objects() {
	t, cl := s.t, s.cl
	for _, p := range []struct{ name, ip string }{{"web-1", "10.251.19.12"}, {"web-2", "10.251.19.8"}} {
		pod := &v1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: p.name, Namespace: "lab", Labels: map[string]string{"app": "web"}},
			Spec: v1.PodSpec{NodeName: "node", Containers: []v1.Container{{Name: "c", Image: "backend", Ports: []v1.ContainerPort{
				{Name: "http", ContainerPort: 8080}, {Name: "dns", ContainerPort: 8080, Protocol: v1.ProtocolUDP}, {Name: "echo", ContainerPort: 9007},
			}}}},
		}
		if _, err := cl.admin.CoreV1().Pods("lab").Create(cl.ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		cl.setReady(t, p.name, p.ip, true)
	}
	sel := map[string]string{"app": "web"}
	cl.service(t, &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: "web"}, Spec: v1.ServiceSpec{
		Type: v1.ServiceTypeNodePort, ClusterIP: soakWeb, Selector: sel, ExternalIPs: []string{soakExtIP},
		Ports: []v1.ServicePort{
			{Name: "http", Port: 80, TargetPort: intstr.FromString("http"), NodePort: 30080},
			{Name: "dns", Port: 53, Protocol: v1.ProtocolUDP, TargetPort: intstr.FromString("dns"), NodePort: 30053},
		}}})
	cl.service(t, &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: "sticky"}, Spec: v1.ServiceSpec{
		ClusterIP: soakSticky, Selector: sel, SessionAffinity: v1.ServiceAffinityClientIP,
		Ports: []v1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}}}})
	cl.service(t, &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: "echo"}, Spec: v1.ServiceSpec{
		ClusterIP: soakEcho, Selector: sel,
		Ports: []v1.ServicePort{{Name: "echo", Port: 7, TargetPort: intstr.FromString("echo")}}}})
}

// startKeeper runs the daemon under its keeper, at info level (hours of
// debug lines would fill the test's memory), from the crash-on-demand
// build (which leaks when KUP_CRASHTEST_LEAK=1).
func (s *soak) startKeeper() *Proc {
	s.cl.AdminSocket = filepath.Join(s.t.TempDir(), "admin.sock")
	args := append([]string{filepath.Join(binDir, "kube-userspace-proxy-crashtest"), "keep",
		"--log-level", "info", "--admin-socket", s.cl.AdminSocket, "--handover-socket", s.socket,
		"--kubeconfig", s.cl.kubeconfig, "--hostname-override", "node", "--min-sync-period", "100ms", "--shutdown-grace", "1s"},
		detectionArgs...)
	p := s.cl.Start("node", args...)
	s.mu.Lock()
	s.keepers = append(s.keepers, p)
	s.mu.Unlock()
	s.t.Cleanup(func() {
		if s.t.Failed() {
			s.t.Logf("a keeper's log:\n%s", tail(p.Output(), 8000))
		}
	})
	return p
}

func (s *soak) run() {
	t := s.t
	// No client tries a Service before its rules are in: a SYN sent to a
	// ClusterIP no rule catches yet leaves a conntrack entry without NAT,
	// and every later connection the kernel happens to give the same
	// source port matches that entry, skips the REDIRECT and is lost (the
	// entry lives 120 s from its last SYN). kube-proxy's rules have the
	// same window; so the lab waits for the rules, as a node's pods wait
	// for the proxy's readiness.
	waitFor(t, "the Services' rules", func() bool {
		out, _ := s.cl.Exec("node", "iptables-save", "-t", "nat")
		for _, addr := range []string{soakWeb, soakSticky, soakEcho, soakExtIP} {
			if !strings.Contains(out, "-d "+addr+"/32") {
				return false
			}
		}
		return true
	})
	for _, addr := range []string{"http://" + soakWeb + "/", "http://" + soakSticky + "/", "http://" + soakExtIP + "/"} {
		waitFor(t, addr, func() bool { return strings.HasPrefix(s.cl.Curl("node", addr), "pod") })
	}
	s.begun = time.Now()
	s.startClients()
	eventEvery := min(max(s.dur/20, 15*time.Second), time.Minute)
	events := s.eventsChosen()
	// The warm-up: UDP flows and their conntrack entries live 30 s, so the
	// load's steady state begins after that.
	s.pause(30 * time.Second)
	s.settle()
	s.sample()
	for i := 0; time.Since(s.begun) < s.dur; i++ {
		next := time.Now().Add(eventEvery)
		events[i%len(events)]()
		s.settle()
		s.sample()
		if d := time.Until(next); d > 0 {
			select {
			case <-time.After(d):
			case <-s.ctx.Done():
			}
		}
	}
	s.cancel()
	s.wg.Wait()
	s.sample()
	s.report()
}

// eventsChosen is the events' cycle: all of them in turn, or those
// KUP_SOAK_EVENTS names (comma-separated: not-ready, edit, backend-killed,
// backend-stopped, handover, worker-killed), to chase one kind of trouble.
func (s *soak) eventsChosen() []func() {
	all := []struct {
		name string
		do   func()
	}{{"not-ready", s.notReady}, {"edit", s.editService}, {"backend-killed", s.backendKilled},
		{"backend-stopped", s.backendStopped}, {"handover", s.handover}, {"worker-killed", s.workerKilled}}
	want := os.Getenv("KUP_SOAK_EVENTS")
	var events []func()
	for _, e := range all {
		if want == "" || stdslices.Contains(strings.Split(want, ","), e.name) {
			events = append(events, e.do)
		}
	}
	if len(events) == 0 {
		s.t.Fatalf("KUP_SOAK_EVENTS=%q names no event (not-ready, edit, backend-killed, backend-stopped, handover, worker-killed)", want)
	}
	return events
}

// settle waits until the lab is at rest: both pods answer the Service.
func (s *soak) settle() {
	testutil.WaitFor(s.t, "both pods answering after an event", time.Minute, 100*time.Millisecond, func() bool {
		seen := s.cl.answers("node", "http://"+soakWeb+"/", 8)
		return seen["pod1"] > 0 && seen["pod2"] > 0
	})
}

// event runs do as a named disturbance whose clients may fail so.
func (s *soak) event(name string, allowed map[string][]string, do func()) {
	ev := soakEvent{name: name, start: time.Now(), allowed: allowed}
	do()
	ev.end = time.Now()
	s.mu.Lock()
	s.events = append(s.events, ev)
	s.mu.Unlock()
}

// The pod web-2 goes not ready for 5 s, then ready again: its flows move.
func (s *soak) notReady() {
	s.event("web-2 not ready", map[string][]string{"udp-fixed": {"moved"}, "affinity": {"moved"}}, func() {
		s.cl.setReady(s.t, "web-2", "10.251.19.8", false)
		time.Sleep(5 * time.Second) // the disturbance's length, not a synchronisation
		s.cl.setReady(s.t, "web-2", "10.251.19.8", true)
	})
}

// A port added to the web Service and removed 3 s later: nobody notices.
func (s *soak) editService() {
	s.event("web edited", nil, func() {
		s.cl.updateService(s.t, "web", func(svc *v1.Service) {
			svc.Spec.Ports = append(svc.Spec.Ports, v1.ServicePort{Name: "alt", Port: 8080, TargetPort: intstr.FromInt32(8080)})
		})
		time.Sleep(3 * time.Second)
		s.cl.updateService(s.t, "web", func(svc *v1.Service) { svc.Spec.Ports = svc.Spec.Ports[:2] })
	})
}

// pod1's processes killed -9, started again 2 s later.
func (s *soak) backendKilled() {
	s.event("pod1's backends killed", map[string][]string{
		"tcp-new": {"cut"}, "udp-fixed": {"timeout", "moved"}, "udp-new": {"timeout"},
		"stream": {"cut", "refused"}, "idle": {"cut", "refused"}, "affinity": {"cut", "moved"},
	}, func() {
		s.signalPod("pod1", syscall.SIGKILL)
		time.Sleep(2 * time.Second)
		s.cl.Start("pod1", filepath.Join(binDir, "backend"), "--name", "pod1", "--tcp", ":8080", "--udp", ":8080")
		s.startEcho("pod1")
	})
}

// pod2's processes stopped for 3 s: whatever reaches pod2 meanwhile waits.
func (s *soak) backendStopped() {
	s.event("pod2's backends stopped", map[string][]string{
		"tcp-new": {"timeout"}, "udp-fixed": {"timeout"}, "udp-new": {"timeout"},
		"stream": {"timeout"}, "idle": {"timeout"}, "affinity": {"timeout"},
	}, func() {
		s.signalPod("pod2", syscall.SIGSTOP)
		time.Sleep(3 * time.Second)
		s.signalPod("pod2", syscall.SIGCONT)
	})
}

// A second keeper takes over; the first is stopped. Nobody notices.
func (s *soak) handover() {
	s.event("handover", nil, func() {
		s.handovr++
		next := s.startKeeper()
		deadline := time.Now().Add(time.Minute)
		for !strings.Contains(next.Output(), "Took over: the predecessor serves nothing more") {
			if time.Now().After(deadline) {
				s.t.Fatalf("handover %d: the new keeper's worker not serving after a minute; its log:\n%s\nthe old keeper's log:\n%s",
					s.handovr, tail(next.Output(), 6000), tail(s.keeper.Output(), 6000))
			}
			time.Sleep(50 * time.Millisecond)
		}
		_ = s.keeper.Cmd.Process.Signal(syscall.SIGTERM)
		if err := s.keeper.Cmd.Wait(); err != nil {
			s.t.Errorf("handover %d: the old keeper: %v", s.handovr, err)
		}
		s.keeper = next
	})
}

// The worker killed -9: what it held is cut, nothing else fails.
func (s *soak) workerKilled() {
	s.event("the worker killed", map[string][]string{
		"tcp-new": {"cut"}, "stream": {"cut"}, "idle": {"cut"}, "affinity": {"cut"},
		// The flow table dies with the worker: the next one may pick another pod.
		"udp-fixed": {"timeout", "moved"}, "udp-new": {"timeout"},
	}, func() {
		before := countIn(s.keeper, "Took over: the predecessor serves nothing more")
		_ = syscall.Kill(workerOf(s.t, s.keeper, 0), syscall.SIGKILL)
		waitFor(s.t, "the keeper's next worker serving", func() bool {
			return countIn(s.keeper, "Took over: the predecessor serves nothing more") > before
		})
	})
}

// signalPod sends sig to every process in a pod's namespace.
func (s *soak) signalPod(pod string, sig syscall.Signal) {
	out, err := exec.Command("ip", "netns", "pids", s.cl.NS(pod)).Output()
	if err != nil {
		s.t.Fatalf("ip netns pids %s: %v", pod, err)
	}
	for _, f := range strings.Fields(string(out)) {
		if pid, err := strconv.Atoi(f); err == nil {
			_ = syscall.Kill(pid, sig)
		}
	}
}

// fail records a client's error.
func (s *soak) fail(client string, begun time.Time, err error) {
	if s.ctx.Err() != nil {
		return // the soak is ending: the clients are being stopped
	}
	s.mu.Lock()
	s.errs = append(s.errs, soakError{client: client, class: classify(err), begun: begun, at: time.Now(), text: err.Error()})
	s.mu.Unlock()
}

func (s *soak) tried() {
	s.mu.Lock()
	s.tries++
	s.mu.Unlock()
}

// classify names what the client saw.
func classify(err error) string {
	var moved errMoved
	switch {
	case errors.As(err, &moved):
		return "moved"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return "timeout"
	}
	return "cut" // a reset, an EOF, a wrong answer
}

type errMoved struct{ from, to string }

func (e errMoved) Error() string { return fmt.Sprintf("answered by %s, before by %s", e.to, e.from) }

// every runs f every d until the soak ends, in a goroutine the soak owns.
func (s *soak) every(d time.Duration, f func()) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		tick := time.NewTicker(d)
		defer tick.Stop()
		for {
			select {
			case <-s.ctx.Done():
				return
			case <-tick.C:
				f()
			}
		}
	}()
}

func (s *soak) startClients() {
	// New connections, each one HTTP request, 10 a second from each place.
	for _, c := range []struct{ ns, addr string }{
		{"client", soakWeb + ":80"}, {"node", soakWeb + ":80"},
		{"ext", soakNodeIP + ":30080"}, {"ext", soakExtIP + ":80"},
	} {
		dial := cluster.DialContextIn(s.cl.NS(c.ns))
		s.every(100*time.Millisecond, func() {
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				s.tried()
				begun := time.Now()
				if err := request(dial, c.addr); err != nil {
					s.fail("tcp-new", begun, fmt.Errorf("%s → %s: %w", c.ns, c.addr, err))
				}
			}()
		})
	}
	s.udpFixed()
	udpNew := cluster.DialContextIn(s.cl.NS("ext"))
	s.every(200*time.Millisecond, func() {
		s.tried()
		begun := time.Now()
		if _, err := udpAsk(udpNew, soakNodeIP+":30053"); err != nil {
			s.fail("udp-new", begun, fmt.Errorf("ext → %s:30053: %w", soakNodeIP, err))
		}
	})
	s.stream()
	s.idle()
	s.affinity()
}

// udpAsk sends one datagram from a new socket and returns the pod that
// answered within 1 s.
func udpAsk(dial func(ctx context.Context, network, addr string) (net.Conn, error), addr string) (string, error) {
	c, err := dial(context.Background(), "udp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	return udpRoundTrip(c)
}

func udpRoundTrip(c net.Conn) (string, error) {
	_ = c.SetDeadline(time.Now().Add(time.Second))
	if _, err := c.Write([]byte("soak")); err != nil {
		return "", err
	}
	buf := make([]byte, 512)
	n, err := c.Read(buf)
	if err != nil {
		return "", err
	}
	pod, _, _ := strings.Cut(string(buf[:n]), ":")
	return pod, nil
}

// udpFixed asks every 100 ms from one source port of the pod client and
// expects the same pod every time.
func (s *soak) udpFixed() {
	var c net.Conn
	err := cluster.InNetns(s.cl.NS("client"), func() error {
		var err error
		c, err = (&net.Dialer{LocalAddr: &net.UDPAddr{Port: 45400}}).Dial("udp", soakWeb+":53")
		return err
	})
	if err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() { c.Close() })
	last := ""
	s.every(100*time.Millisecond, func() {
		s.tried()
		begun := time.Now()
		pod, err := udpRoundTrip(c)
		switch {
		case err != nil:
			s.fail("udp-fixed", begun, err)
		case last != "" && pod != last:
			s.fail("udp-fixed", begun, errMoved{from: last, to: pod})
		}
		if err == nil {
			last = pod
		}
	})
}

// stream echoes 16 KiB every 10 ms (1.6 MB/s: a long stream, not a
// benchmark that would starve the rest of the 2-core machine) through the
// echo Service from the pod client, for as long as the soak lasts,
// dialling again after a failure.
func (s *soak) stream() {
	dial := cluster.DialContextIn(s.cl.NS("client"))
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		out := make([]byte, 16<<10)
		in := make([]byte, len(out))
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for s.ctx.Err() == nil {
			begun := time.Now()
			c, err := dial(s.ctx, "tcp", soakEcho+":7")
			if err != nil {
				s.fail("stream", begun, err)
				s.pause(200 * time.Millisecond)
				continue
			}
			for i := byte(0); s.ctx.Err() == nil; i++ {
				s.tried()
				for j := range out {
					out[j] = i + byte(j)
				}
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				if _, err = c.Write(out); err == nil {
					_, err = io.ReadFull(c, in)
				}
				if err == nil && string(in) != string(out) {
					err = fmt.Errorf("echoed other bytes")
				}
				if err != nil {
					s.fail("stream", begun, err)
					break
				}
				begun = time.Now()
				select {
				case <-tick.C:
				case <-s.ctx.Done():
				}
			}
			c.Close()
		}
	}()
}

// idle holds a connection to the echo Service from the node and asks it
// every 15 s. What cut it may have happened any time since its last
// answer: that is when its trouble begun.
func (s *soak) idle() {
	dial := cluster.DialContextIn(s.cl.NS("node"))
	var c net.Conn
	lastOK := time.Now()
	s.every(15*time.Second, func() {
		s.tried()
		begun := lastOK
		var err error
		if c == nil {
			c, err = dial(s.ctx, "tcp", soakEcho+":7")
		}
		if err == nil {
			err = echo(c, "still there?")
		}
		if err != nil {
			s.fail("idle", begun, err)
			if c != nil {
				c.Close()
			}
			c = nil
		}
		lastOK = time.Now()
	})
}

// affinity asks the ClientIP-affinity Service from the pod client twice a
// second, on a new connection each time, and expects one pod.
func (s *soak) affinity() {
	dial := cluster.DialContextIn(s.cl.NS("client"))
	last := ""
	s.every(500*time.Millisecond, func() {
		s.tried()
		begun := time.Now()
		k, err := dial(s.ctx, "tcp", soakSticky+":80")
		pod := ""
		if err == nil {
			ka := &keepAlive{c: k, br: bufio.NewReader(k)}
			pod, err = ka.get()
			k.Close()
		}
		switch {
		case err != nil:
			s.fail("affinity", begun, err)
		case last != "" && pod != last:
			s.fail("affinity", begun, errMoved{from: last, to: pod})
		}
		if err == nil {
			last = pod
		}
	})
}

func (s *soak) pause(d time.Duration) {
	select {
	case <-time.After(d):
	case <-s.ctx.Done():
	}
}

// explained says whether an event explains e.
func (s *soak) explained(e soakError) string {
	const grace = 5 * time.Second // a client's longest deadline, and then some
	for _, ev := range s.events {
		if e.at.Before(ev.start) || e.begun.After(ev.end.Add(grace)) {
			continue
		}
		if stdslices.Contains(ev.allowed[e.client], e.class) {
			return ev.name
		}
	}
	return ""
}

// sample records the lab at rest. What an event left in flight (dials to a
// backend that was stopped, connections it queued) ends within seconds,
// where a leak stays: while a worker's figure is above its life's first
// sample by more than its margin, it is read again, for up to 30 s.
func (s *soak) sample() {
	deadline := time.Now().Add(30 * time.Second)
	for {
		sm := s.read()
		s.mu.Lock()
		life := []soakSample{}
		for _, prev := range s.samples {
			if prev.worker == sm.worker {
				life = append(life, prev)
			}
		}
		life = append(life, sm)
		grew := false
		for _, f := range soakLifeFigures {
			grew = grew || lifeGrowth(f, life) != ""
		}
		if !grew || time.Now().After(deadline) {
			s.samples = append(s.samples, sm)
			s.mu.Unlock()
			s.t.Logf("soak %v: %+v", sm.at, sm)
			return
		}
		s.mu.Unlock()
		time.Sleep(time.Second) // the poll's interval; the deadline bounds it
	}
}

// read reads the figures a sample holds.
func (s *soak) read() soakSample {
	t := s.t
	worker := workerOf(t, s.keeper, 0)
	sm := soakSample{at: time.Since(s.begun).Round(time.Second), worker: worker}
	metrics := s.cl.Curl("node", "http://127.0.0.1:10249/metrics")
	sm.workerFDs, sm.workerRSSKiB = procUsage(t, worker)
	sm.keeperFDs, sm.keeperRSSKiB = procUsage(t, s.keeper.Cmd.Process.Pid)
	for _, line := range strings.Split(metrics, "\n") {
		name, v, _ := strings.Cut(line, " ")
		n, _ := strconv.ParseFloat(v, 64)
		switch {
		case name == "go_goroutines":
			sm.goroutines = int(n)
		case strings.HasPrefix(name, "kube_userspace_proxy_connections_active{"):
			sm.conns += int(n)
		case name == "kube_userspace_proxy_udp_flows_open":
			sm.flows = int(n)
		}
	}
	sm.unownedFDs = sm.workerFDs - 2*sm.conns - sm.flows
	sm.unownedGoroutines = sm.goroutines - 2*sm.conns - sm.flows
	sm.conntrack = s.count("conntrack -L 2>/dev/null | grep -cvE ' (TIME_WAIT|CLOSE) '", false)
	sm.listening = s.count("ss -Hltun", true)
	sm.rules = s.count("{ iptables-save; ip6tables-save; } | grep -c '^-A'", false)
	s.mu.Lock()
	sm.errors, sm.connsTried = len(s.errs), s.tries
	var fresh []string
	var around []soakError
	for _, e := range s.errs {
		if s.explained(e) == "" {
			if sm.unexplained++; sm.unexplained > s.unexplainedShown {
				fresh = append(fresh, e.String())
				around = append(around, e)
			}
		}
	}
	s.unexplainedShown = sm.unexplained
	keepers := stdslices.Clone(s.keepers)
	events := stdslices.Clone(s.events)
	s.mu.Unlock()
	if len(fresh) > 0 { // said as they come: a long run that fails has told why by then
		s.t.Logf("client errors no event explains:\n%s\nthe last events: %s\nthe keepers' log lines from 3 s before to 3 s after:\n%s",
			strings.Join(fresh, "\n"), lastEvents(events, 3), keeperLinesAround(keepers, around, 3*time.Second))
	}
	return sm
}

// lastEvents names the last n events with their times.
func lastEvents(events []soakEvent, n int) string {
	var b strings.Builder
	for _, ev := range events[max(len(events)-n, 0):] {
		fmt.Fprintf(&b, "%s %s–%s; ", ev.name, ev.start.Format("15:04:05.000"), ev.end.Format("15:04:05.000"))
	}
	return b.String()
}

// keeperLinesAround picks from the keepers' logs (logrus text, time="…")
// the lines within margin of each error, from its begin to when it was
// seen: what the daemon said while a client was cut.
func keeperLinesAround(keepers []*Proc, errs []soakError, margin time.Duration) string {
	var b strings.Builder
	for i, k := range keepers {
		for _, line := range strings.Split(k.Output(), "\n") {
			at, ok := logLineTime(line)
			if !ok {
				continue
			}
			for _, e := range errs {
				if !at.Before(e.begun.Add(-margin)) && !at.After(e.at.Add(margin)) {
					fmt.Fprintf(&b, "keeper %d (pid %d): %s\n", i+1, k.Cmd.Process.Pid, line)
					break
				}
			}
		}
	}
	return b.String()
}

// logLineTime reads the time="2006-01-02T15:04:05Z07:00" field of a logrus
// text line.
func logLineTime(line string) (time.Time, bool) {
	_, rest, ok := strings.Cut(line, `time="`)
	if !ok {
		return time.Time{}, false
	}
	value, _, ok := strings.Cut(rest, `"`)
	if !ok {
		return time.Time{}, false
	}
	at, err := time.Parse(time.RFC3339Nano, value)
	return at, err == nil
}

// count runs a shell line in the node's namespace and returns the number
// it prints, or (lines) how many lines it prints.
func (s *soak) count(script string, lines bool) int {
	out, err := s.cl.Exec("node", "bash", "-c", script)
	if err != nil {
		s.t.Fatalf("%s: %v\n%s", script, err, out)
	}
	if lines {
		return len(strings.Split(strings.TrimSpace(out), "\n"))
	}
	n, _ := strconv.Atoi(strings.TrimSpace(out))
	return n
}

// soakFigure is one sampled figure and how much it may move.
type soakFigure struct {
	name   string
	get    func(soakSample) int
	margin int // -1: must not change at all
}

var soakFigures = []soakFigure{
	{"worker descriptors", func(s soakSample) int { return s.workerFDs }, 100},
	{"worker RSS KiB", func(s soakSample) int { return s.workerRSSKiB }, 40 << 10},
	{"worker goroutines", func(s soakSample) int { return s.goroutines }, 150},
	{"keeper descriptors", func(s soakSample) int { return s.keeperFDs }, 5},
	{"keeper RSS KiB", func(s soakSample) int { return s.keeperRSSKiB }, 10 << 10},
	{"live conntrack entries", func(s soakSample) int { return s.conntrack }, 1000},
	{"listening sockets", func(s soakSample) int { return s.listening }, -1},
	{"rules", func(s soakSample) int { return s.rules }, -1},
}

// soakLifeFigures must not grow within one worker's life.
var soakLifeFigures = []soakFigure{
	{"descriptors no connection or flow owns", func(s soakSample) int { return s.unownedFDs }, 40},
	{"goroutines no connection or flow owns", func(s soakSample) int { return s.unownedGoroutines }, 60},
}

// lifeGrowth says how a figure grew within one worker's life, or "".
func lifeGrowth(f soakFigure, samples []soakSample) string {
	for i := 0; i < len(samples); {
		j := i
		for j < len(samples) && samples[j].worker == samples[i].worker {
			j++
		}
		first := f.get(samples[i])
		for _, sm := range samples[i+1 : j] {
			if v := f.get(sm); v > first+f.margin {
				return fmt.Sprintf("%s grew in worker %d's life: %d at %v, %d at %v (margin %d)", f.name, sm.worker, first, samples[i].at, v, sm.at, f.margin)
			}
		}
		i = j
	}
	return ""
}

// growth says how a figure grew over the samples, or "".
func growth(f soakFigure, samples []soakSample) string {
	var v []int
	for _, s := range samples {
		v = append(v, f.get(s))
	}
	if f.margin < 0 {
		for i, x := range v {
			if x != v[0] {
				return fmt.Sprintf("%s changed at rest: %d at the first sample, %d at sample %d (%v)", f.name, v[0], x, i, samples[i].at)
			}
		}
		return ""
	}
	third := max(len(v)/3, 1)
	firstHigh := stdslices.Max(v[:third])
	if hi := stdslices.Max(v); hi > 2*firstHigh+f.margin {
		return fmt.Sprintf("%s reached %d, over twice the first third's highest (%d) and %d more", f.name, hi, firstHigh, f.margin)
	}
	if len(v) >= 3 {
		if lastLow := stdslices.Min(v[len(v)-third:]); lastLow > firstHigh+f.margin {
			return fmt.Sprintf("%s grew: the last third's lowest %d is over the first third's highest %d by more than %d", f.name, lastLow, firstHigh, f.margin)
		}
	}
	return ""
}

func (s *soak) report() {
	t := s.t
	s.mu.Lock()
	defer s.mu.Unlock()
	byEvent := map[string]int{}
	var unexplained []string
	for _, e := range s.errs {
		if ev := s.explained(e); ev != "" {
			byEvent[ev+" / "+e.client+" "+e.class]++
		} else {
			unexplained = append(unexplained, e.String())
		}
	}
	kinds := map[string]int{}
	for _, ev := range s.events {
		kinds[ev.name]++
	}
	t.Logf("soak: %v, %d client operations, %d events %v, %d client errors explained by an event %v",
		time.Since(s.begun).Round(time.Second), s.tries, len(s.events), kinds, len(s.errs)-len(unexplained), byEvent)
	if dir := os.Getenv("KUP_SOAK_RECORD"); dir != "" {
		if err := writeSoakRecord(dir, s.samples, s.events, s.errs, s.explained); err != nil {
			t.Errorf("KUP_SOAK_RECORD: %v", err)
		}
	}
	if len(unexplained) > 0 {
		t.Errorf("%d client errors no event explains:\n%s", len(unexplained), strings.Join(unexplained[:min(len(unexplained), 50)], "\n"))
	}
	for _, f := range soakFigures {
		if g := growth(f, s.samples); g != "" {
			t.Error(g)
		}
	}
	for _, f := range soakLifeFigures {
		if g := lifeGrowth(f, s.samples); g != "" {
			t.Error(g)
		}
	}
}
