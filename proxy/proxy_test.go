package proxy

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/sirupsen/logrus"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var loopback = netip.MustParseAddr("127.0.0.1")

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testutil.WaitFor(t, what, 10*time.Second, 10*time.Millisecond, cond)
}

type harness struct {
	t    *testing.T
	p    *Proxier
	logs *testutil.LogHook
}

// startProxier runs a Proxier on loopback until the test ends.
func startProxier(t *testing.T, cfg Config) *harness {
	t.Helper()
	log := logrus.New()
	log.SetOutput(io.Discard)
	log.SetLevel(logrus.DebugLevel)
	h := &harness{t: t, logs: &testutil.LogHook{}}
	log.AddHook(h.logs)
	if !cfg.BindAddress.IsValid() {
		cfg.BindAddress = loopback
	}
	if cfg.MinSyncPeriod == 0 {
		cfg.MinSyncPeriod = time.Millisecond
	}
	if cfg.ConnLogMode == "" {
		cfg.ConnLogMode = ConnLogAll
	}
	cfg.Log = log
	h.p = New(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { h.p.Run(ctx, 0); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return h
}

// apply hands st to the proxier and waits until it is what the listeners serve.
func (h *harness) apply(ports ...*config.ServicePort) {
	h.t.Helper()
	st := &config.State{Ports: map[config.ServicePortName]*config.ServicePort{}, Node: "node-a"}
	for _, sp := range ports {
		st.Ports[sp.Name] = sp
	}
	h.p.Update(st)
	waitFor(h.t, "sync", func() bool {
		view := h.p.Frontends()
		n := 0
		for _, fe := range view {
			if sp := st.Ports[fe.Service.Name]; sp == fe.Service {
				n++
			}
		}
		return n == len(view) && len(view) >= len(ports)
	})
}

func (h *harness) port(name string) int {
	return h.p.ListenPort(config.ServicePortName{Namespace: "ns", Name: name}, 4, KindAll)
}

func (h *harness) addr(name string) string {
	h.t.Helper()
	p := h.port(name)
	if p == 0 {
		h.t.Fatalf("no listener for %s", name)
	}
	return fmt.Sprintf("127.0.0.1:%d", p)
}

func svc(name string, proto config.Protocol, backends ...netip.AddrPort) *config.ServicePort {
	sp := &config.ServicePort{
		Name:       config.ServicePortName{Namespace: "ns", Name: name},
		Protocol:   proto,
		Port:       80,
		ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")},
	}
	for _, b := range backends {
		sp.Endpoints = append(sp.Endpoints, config.Endpoint{Addr: b, Ready: true, Serving: true})
	}
	return sp
}

// tcpBackend answers every connection with its name and a newline, then
// echoes until the client half-closes, then closes. When the test ends it
// closes its open connections too, so a failed test cannot hang in cleanup.
func tcpBackend(t *testing.T, name string) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	open := map[net.Conn]bool{}
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for c := range open {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			open[c] = true
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { mu.Lock(); delete(open, c); mu.Unlock(); c.Close() }()
				fmt.Fprintf(c, "%s\n", name)
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// udpBackend replies to every datagram with "name:" + the datagram.
func udpBackend(t *testing.T, name string) netip.AddrPort {
	t.Helper()
	c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	return serveUDPEcho(t, c, name)
}

// serveUDPEcho replies on c to every datagram with "name:" + the datagram
// until the test ends, and returns c's address.
func serveUDPEcho(t *testing.T, c *net.UDPConn, name string) netip.AddrPort {
	done := make(chan struct{})
	t.Cleanup(func() { c.Close(); <-done })
	go func() {
		defer close(done)
		buf := make([]byte, 70000)
		for {
			n, from, err := c.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			_, _ = c.WriteToUDPAddrPort(append([]byte(name+":"), buf[:n]...), from)
		}
	}()
	return c.LocalAddr().(*net.UDPAddr).AddrPort()
}

// closedPort returns a loopback port nobody listens on (connection refused).
func closedPort(t *testing.T) netip.AddrPort {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ap := ln.Addr().(*net.TCPAddr).AddrPort()
	ln.Close()
	return ap
}

// blackhole returns a loopback address whose SYNs are dropped, so that a dial
// times out: a listener with a full accept queue that never accepts.
func blackhole(t *testing.T) netip.AddrPort {
	ap, _ := fullListener(t)
	return ap
}

// fullListener is blackhole's listener: new SYNs are dropped until one of
// the queued connections is taken with accept(fd).
func fullListener(t *testing.T) (netip.AddrPort, int) {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, _ := syscall.Getsockname(fd)
	ap := netip.AddrPortFrom(loopback, uint16(sa.(*syscall.SockaddrInet4).Port))
	var fillers []net.Conn
	t.Cleanup(func() {
		for _, c := range fillers {
			c.Close()
		}
		syscall.Close(fd)
	})
	// Fill the accept queue until a dial no longer completes.
	for i := 0; i < 8; i++ {
		c, err := net.DialTimeout("tcp4", ap.String(), 200*time.Millisecond)
		if err != nil {
			return ap, fd
		}
		fillers = append(fillers, c)
	}
	t.Fatal("could not fill the accept queue of the blackhole listener")
	return ap, fd
}

// fetchName connects, reads the backend's name line and closes.
func fetchName(t *testing.T, addr string) string {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatalf("read from %s: %v", addr, err)
	}
	return strings.TrimSpace(line)
}

func TestTCPRoundRobin(t *testing.T) {
	h := startProxier(t, Config{})
	h.apply(svc("web", config.TCP, tcpBackend(t, "a"), tcpBackend(t, "b"), tcpBackend(t, "c")))
	addr := h.addr("web")
	counts := map[string]int{}
	for i := 0; i < 30; i++ {
		counts[fetchName(t, addr)]++
	}
	if counts["a"] != 10 || counts["b"] != 10 || counts["c"] != 10 {
		t.Fatalf("spread %v, want 10 each", counts)
	}
}

func TestTCPEchoAndHalfClose(t *testing.T) {
	h := startProxier(t, Config{})
	h.apply(svc("echo", config.TCP, tcpBackend(t, "a")))
	c, err := net.Dial("tcp", h.addr("echo"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	payload := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB: the splice path
	go func() {
		_, _ = c.Write(payload)
		_ = c.(*net.TCPConn).CloseWrite() // half-close: the reply must still come
	}()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	got, err := io.ReadAll(c) // ends only when the backend saw our FIN and closed
	if err != nil {
		t.Fatal(err)
	}
	want := append([]byte("a\n"), payload...)
	if !bytes.Equal(got, want) {
		t.Fatalf("got %d bytes back, want %d", len(got), len(want))
	}
	waitFor(t, "connection log line", func() bool { return len(h.logs.Find("Connection closed")) == 1 })
	f := h.logs.Find("Connection closed")[0]
	if f["bytesUp"] != int64(len(payload)) || f["bytesDown"] != int64(len(want)) || f["cause"] != CauseClientClosed.String() {
		t.Fatalf("log line %v: want bytesUp=%d bytesDown=%d cause=%q", f, len(payload), len(want), CauseClientClosed)
	}
}

// A conversation (reads with TCP_CM_INQ from the second message on) must
// still see a FIN that comes right behind, or with, the last message: the
// read that took the data may have taken the FIN too, and no new wake-up
// would follow.
func TestTCPConversationFINAfterLastMessage(t *testing.T) {
	h := startProxier(t, Config{})
	h.apply(svc("talk", config.TCP, tcpBackend(t, "a")))
	for conn := 0; conn < 20; conn++ {
		c, err := net.Dial("tcp", h.addr("talk"))
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		r := bufio.NewReader(c)
		if _, err := r.ReadString('\n'); err != nil { // the name line
			t.Fatal(err)
		}
		for i := 0; i < 4; i++ {
			fmt.Fprintf(c, "ping %d\n", i)
			if line, err := r.ReadString('\n'); err != nil || line != fmt.Sprintf("ping %d\n", i) {
				t.Fatalf("connection %d round %d: %q %v", conn, i, line, err)
			}
		}
		// The last message and the FIN back to back; the backend echoes
		// it and closes on our FIN, so its reply is followed by its FIN.
		fmt.Fprintf(c, "last\n")
		_ = c.(*net.TCPConn).CloseWrite()
		rest, err := io.ReadAll(r)
		c.Close()
		if err != nil || string(rest) != "last\n" {
			t.Fatalf("connection %d: after the last message got %q, %v; want the echo, then EOF", conn, rest, err)
		}
	}
}

// A client that sends its FIN and leaves resets its socket when the reply
// comes. The proxy must end the pair then, not wait for a backend that keeps
// its side open: before, every such client kept two descriptors for good.
func TestTCPClientResetAfterFINEndsPair(t *testing.T) {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	backendReset := make(chan error, 10)
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(20 * time.Second))
				// Reply only once the client's FIN came through, so the
				// reply always finds the client gone; then keep the
				// connection open and silent until the proxy resets it.
				// (Reads say EOF even then: the kernel reports the FIN
				// before the error. The TCP state tells.)
				if _, err := io.Copy(io.Discard, c); err != nil {
					backendReset <- err
					return
				}
				_, _ = c.Write([]byte("late reply\n"))
				raw, _ := c.(*net.TCPConn).SyscallConn()
				for {
					var state byte
					_ = raw.Control(func(fd uintptr) {
						state, _ = unix.GetsockoptByte(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO)
					})
					if state == tcpClose {
						backendReset <- nil
						return
					}
					if _, err := c.Read(make([]byte, 1)); err != io.EOF {
						backendReset <- err // the deadline
						return
					}
					time.Sleep(10 * time.Millisecond)
				}
			}()
		}
	}()
	h := startProxier(t, Config{})
	h.apply(svc("late", config.TCP, ln.Addr().(*net.TCPAddr).AddrPort()))
	const clients = 5
	for i := 0; i < clients; i++ {
		c, err := net.Dial("tcp", h.addr("late"))
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
	}
	waitFor(t, "every pair ended", func() bool { return len(h.logs.Find("Connection closed")) == clients })
	for _, f := range h.logs.Find("Connection closed") {
		if f["cause"] != CauseClientReset.String() {
			t.Errorf("cause %v, want %q", f["cause"], CauseClientReset)
		}
	}
	for i := 0; i < clients; i++ {
		select {
		case err := <-backendReset:
			if err != nil {
				t.Errorf("backend connection: %v, want the reset passed on", err)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("a backend connection was never reset")
		}
	}
}

// Both sockets of a proxied connection probe a silent peer: the client's
// inherits keep-alive from the listener, the backend's is set at dial.
func TestTCPOptionsOnBothSockets(t *testing.T) {
	h := startProxier(t, Config{})
	h.apply(svc("ka", config.TCP, tcpBackend(t, "a")))
	c, err := net.Dial("tcp", h.addr("ka"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := bufio.NewReader(c).ReadString('\n'); err != nil {
		t.Fatal(err) // the backend's greeting: the connection is spliced
	}
	var rec *connRecord
	waitFor(t, "connection record with both sockets", func() bool {
		for _, r := range h.p.conns.list() {
			r.mu.Lock()
			ok := r.backend != nil
			r.mu.Unlock()
			if ok {
				rec = r
				return true
			}
		}
		return false
	})
	rec.mu.Lock()
	socks := map[string]*sock{"client": rec.client, "backend": rec.backend}
	rec.mu.Unlock()
	for side, sk := range socks {
		_ = sk.control(func(fd int) {
			for _, o := range []struct {
				name       string
				level, opt int
				want       int
			}{
				{"SO_KEEPALIVE", unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
				{"TCP_KEEPIDLE", unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, 15},
				{"TCP_KEEPINTVL", unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, 15},
				{"TCP_NODELAY", unix.IPPROTO_TCP, unix.TCP_NODELAY, 1},
			} {
				got, err := unix.GetsockoptInt(fd, o.level, o.opt)
				if err != nil || got != o.want {
					t.Errorf("%s socket: %s = %d (%v), want %d", side, o.name, got, err, o.want)
				}
			}
			// The accepted socket inherits TCP_INQ too; the copy relies on
			// rec.client.inq matching it.
			if side == "client" {
				got, err := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_INQ)
				if err != nil || (got == 1) != sk.inq {
					t.Errorf("client socket: TCP_INQ = %d (%v), inq flag %v", got, err, sk.inq)
				}
			}
		})
	}
}

func TestTCPMultiPortService(t *testing.T) {
	h := startProxier(t, Config{})
	http := svc("multi", config.TCP, tcpBackend(t, "http"))
	http.Name.Port = "http"
	admin := svc("multi", config.TCP, tcpBackend(t, "admin"))
	admin.Name.Port, admin.Port = "admin", 9090
	h.apply(http, admin)
	for _, tc := range []struct{ port, want string }{{"http", "http"}, {"admin", "admin"}} {
		p := h.p.ListenPort(config.ServicePortName{Namespace: "ns", Name: "multi", Port: tc.port}, 4, KindAll)
		if got := fetchName(t, fmt.Sprintf("127.0.0.1:%d", p)); got != tc.want {
			t.Errorf("port %s reached %q", tc.port, got)
		}
	}
}

func TestTCPNoEndpointsResets(t *testing.T) {
	h := startProxier(t, Config{})
	h.apply(svc("empty", config.TCP))
	expectReset(t, h.addr("empty"))
	waitFor(t, "log", func() bool { return len(h.logs.Find("Connection closed")) == 1 })
	if f := h.logs.Find("Connection closed")[0]; f["cause"] != CauseNoEndpoints.String() {
		t.Fatalf("cause %v", f["cause"])
	}
}

func TestTCPAllDialsFailResets(t *testing.T) {
	h := startProxier(t, Config{DialTimeouts: []time.Duration{100 * time.Millisecond, 100 * time.Millisecond}})
	h.apply(svc("dead", config.TCP, closedPort(t), closedPort(t)))
	expectReset(t, h.addr("dead"))
}

// expectReset connects and expects the proxy to reset the connection (the
// reset can beat connect's return on loopback) rather than close or hang.
func expectReset(t *testing.T, addr string) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err == nil {
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err = c.Read(make([]byte, 1))
	}
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("got %v, want a reset (ECONNRESET)", err)
	}
}

func TestTCPRetryPastDeadEndpoint(t *testing.T) {
	for _, tc := range []struct {
		name string
		dead func(*testing.T) netip.AddrPort
	}{
		{"connection refused", closedPort},
		{"dial timeout", blackhole},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := startProxier(t, Config{DialTimeouts: []time.Duration{100 * time.Millisecond, 5 * time.Second}})
			good := tcpBackend(t, "good")
			h.apply(svc("retry", config.TCP, tc.dead(t), good))
			// Whichever endpoint round-robin starts at, every connection
			// must reach the good one, those that tried the dead one first
			// after a retry.
			for i := 0; i < 4; i++ {
				if got := fetchName(t, h.addr("retry")); got != "good" {
					t.Fatalf("connection %d reached %q", i, got)
				}
			}
			waitFor(t, "logs", func() bool { return len(h.logs.Find("Connection closed")) == 4 })
			retries := 0
			for _, f := range h.logs.Find("Connection closed") {
				if f["reason"] == string(ReasonRetry) {
					retries++
					if f["attempts"] != 2 || f["endpoint"] != good.String() {
						t.Errorf("retry line %v", f)
					}
				}
			}
			if retries == 0 {
				t.Fatal("no connection was retried; the dead endpoint was never picked")
			}
		})
	}
}

func TestTCPAffinity(t *testing.T) {
	a, b := tcpBackend(t, "a"), tcpBackend(t, "b")
	for _, tc := range []struct {
		name  string
		steps []*config.ServicePort
	}{
		{"affinity before endpoints", []*config.ServicePort{
			func() *config.ServicePort { s := svc("sticky", config.TCP); s.AffinityTimeout = time.Hour; return s }(),
			func() *config.ServicePort {
				s := svc("sticky", config.TCP, a, b)
				s.AffinityTimeout = time.Hour
				return s
			}(),
		}},
		{"endpoints before affinity", []*config.ServicePort{
			svc("sticky", config.TCP, a, b),
			func() *config.ServicePort {
				s := svc("sticky", config.TCP, a, b)
				s.AffinityTimeout = time.Hour
				return s
			}(),
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := startProxier(t, Config{})
			for _, st := range tc.steps {
				h.apply(st)
			}
			first := fetchName(t, h.addr("sticky"))
			for i := 0; i < 10; i++ {
				if got := fetchName(t, h.addr("sticky")); got != first {
					t.Fatalf("connection %d went to %s, pinned to %s", i, got, first)
				}
			}
			// Switching affinity off restores round-robin.
			h.apply(svc("sticky", config.TCP, a, b))
			seen := map[string]bool{}
			for i := 0; i < 4; i++ {
				seen[fetchName(t, h.addr("sticky"))] = true
			}
			if len(seen) != 2 {
				t.Fatalf("affinity off: reached only %v", seen)
			}
		})
	}
}

func TestUpdateDeleteUpdate(t *testing.T) {
	h := startProxier(t, Config{})
	a := tcpBackend(t, "a")
	h.apply(svc("svc", config.TCP, a))
	addr1 := h.addr("svc")

	// An established connection survives its service's removal.
	c, err := net.Dial("tcp", addr1)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	if line, _ := r.ReadString('\n'); line != "a\n" {
		t.Fatalf("got %q", line)
	}
	h.apply()
	if h.port("svc") != 0 {
		t.Fatal("listener still reported after removal")
	}
	if _, err := net.DialTimeout("tcp", addr1, time.Second); err == nil {
		t.Fatal("removed service's listener still accepts")
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "still here\n")
	if line, err := r.ReadString('\n'); err != nil || line != "still here\n" {
		t.Fatalf("established connection broke with its service: %q %v", line, err)
	}

	h.apply(svc("svc", config.TCP, a))
	if got := fetchName(t, h.addr("svc")); got != "a" {
		t.Fatalf("re-added service reached %q", got)
	}
}

// probeRules records, when each Sync runs, whether the probed addresses
// accept a connection: it sees the listeners exactly as the kernel rules
// change.
type probeRules struct {
	mu      sync.Mutex
	probe   []string
	accepts map[string]bool // as of the last Sync
}

func (r *probeRules) Sync(_ context.Context, _ []Frontend, _ bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.accepts = map[string]bool{}
	for _, a := range r.probe {
		c, err := net.DialTimeout("tcp", a, time.Second)
		if err == nil {
			c.Close()
		}
		r.accepts[a] = err == nil
	}
	return nil
}

func (r *probeRules) set(probe ...string) {
	r.mu.Lock()
	r.probe, r.accepts = probe, nil
	r.mu.Unlock()
}

func (r *probeRules) accepted(a string) (accepts, synced bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	accepts, synced = r.accepts[a]
	return accepts, synced
}

// A removed Service is refused before its rules go (the rule transaction
// takes tens of ms at 10k service ports); a replaced one keeps serving until
// the rules point at its successor.
func TestRemovedListenerStopsBeforeRulesReplacedOneAfter(t *testing.T) {
	rules := &probeRules{}
	h := startProxier(t, Config{Rules: rules})
	a := tcpBackend(t, "a")
	h.apply(svc("gone", config.TCP, a), svc("moved", config.TCP, a))
	gone, moved := h.addr("gone"), h.addr("moved")

	rules.set(gone, moved)
	next := svc("moved", config.TCP, a)
	next.Port = 8080
	h.apply(next)
	accepts, synced := rules.accepted(gone)
	if !synced {
		t.Fatal("rules were not synced")
	}
	if accepts {
		t.Fatal("the removed Service's listener still accepted while its rules were being removed")
	}
	if accepts, _ := rules.accepted(moved); !accepts {
		t.Fatal("the replaced listener was closed before the rules pointed at its successor")
	}
	if _, err := net.DialTimeout("tcp", moved, time.Second); err == nil {
		t.Fatal("the replaced listener still accepts after the sync")
	}
}

func TestEndpointChangeKeepsListenerPortChangeReplacesIt(t *testing.T) {
	h := startProxier(t, Config{})
	a, b := tcpBackend(t, "a"), tcpBackend(t, "b")
	h.apply(svc("svc", config.TCP, a))
	port := h.port("svc")
	h.apply(svc("svc", config.TCP, b))
	if h.port("svc") != port {
		t.Fatal("an endpoint change replaced the listener")
	}
	if got := fetchName(t, h.addr("svc")); got != "b" {
		t.Fatalf("after the endpoint change: reached %q", got)
	}
	moved := svc("svc", config.TCP, b)
	moved.Port = 8080
	h.apply(moved)
	if p := h.port("svc"); p == port || p == 0 {
		t.Fatalf("a port change kept listener %d (now %d)", port, p)
	}
	if got := fetchName(t, h.addr("svc")); got != "b" {
		t.Fatalf("after the port change: reached %q", got)
	}
	udp := svc("svc", config.UDP, b)
	h.apply(udp)
	if fe := h.p.Frontends(); len(fe) != 1 || fe[0].Protocol != config.UDP {
		t.Fatalf("protocol change: frontends %+v", fe)
	}
}

func TestTCPIdleTimeout(t *testing.T) {
	// Generous against a loaded machine: only a stall of over a second
	// between two pings could cut the connection early.
	h := startProxier(t, Config{TCPIdleTimeout: 1500 * time.Millisecond})
	h.apply(svc("idle", config.TCP, tcpBackend(t, "a")))
	c, err := net.Dial("tcp", h.addr("idle"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	r := bufio.NewReader(c)
	// Keep talking for longer than the idle timeout: the connection must live.
	for i := 0; i < 10; i++ {
		fmt.Fprintf(c, "ping %d\n", i)
		if line, err := r.ReadString('\n'); err != nil {
			t.Fatalf("active connection cut at round %d: %q %v", i, line, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
	// Then go quiet: the proxy closes it.
	_, _ = r.ReadString('\n') // the name line
	if _, err := r.ReadString('\n'); err != io.EOF {
		t.Fatalf("idle connection: read got %v, want EOF", err)
	}
	waitFor(t, "log", func() bool { return len(h.logs.Find("Connection closed")) == 1 })
	if f := h.logs.Find("Connection closed")[0]; f["cause"] != CauseIdleTimeout.String() {
		t.Fatalf("cause %v", f["cause"])
	}
}

func TestShutdownClosesConnections(t *testing.T) {
	h := startProxier(t, Config{})
	h.apply(svc("svc", config.TCP, tcpBackend(t, "a")))
	c, err := net.Dial("tcp", h.addr("svc"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	if _, err := r.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	// The cleanup of startProxier cancels Run; goleak in TestMain proves
	// the connection's goroutines ended with it.
}

func TestPortRangeReleasedAndReused(t *testing.T) {
	base := closedPort(t).Port()
	h := startProxier(t, Config{PortRange: PortRange{Base: int(base), Size: 1}})
	a := tcpBackend(t, "a")
	h.apply(svc("one", config.TCP, a))
	if h.port("one") != int(base) {
		t.Fatalf("listener on %d, want %d from the range", h.port("one"), base)
	}
	// The range is full: a second service cannot be served...
	h.apply(svc("one", config.TCP, a), svc("two", config.TCP, a))
	for _, fe := range h.p.Frontends() {
		if fe.Service.Name.Name == "two" && !errors.Is(fe.Err, ErrPortsExhausted) {
			t.Fatalf("service two: err %v, want ErrPortsExhausted", fe.Err)
		}
	}
	// ...until the first one goes and gives its port back.
	h.apply(svc("two", config.TCP, a))
	waitFor(t, "port reuse", func() bool {
		h.p.Update(&config.State{Ports: map[config.ServicePortName]*config.ServicePort{{Namespace: "ns", Name: "two"}: svc("two", config.TCP, a)}})
		return h.port("two") == int(base)
	})
}

// failingRules fails every Sync while fail is set.
type failingRules struct{ fail atomic.Bool }

func (r *failingRules) Sync(context.Context, []Frontend, bool) error {
	if r.fail.Load() {
		return errors.New("injected rule failure")
	}
	return nil
}

// A closed listener's port is not handed to another Service while the rules
// may still send the old Service's traffic there: not before a rule sync
// succeeded without it.
func TestPortHeldUntilRulesSyncedWithoutIt(t *testing.T) {
	base := closedPort(t).Port()
	rules := &failingRules{}
	h := startProxier(t, Config{PortRange: PortRange{Base: int(base), Size: 1}, Rules: rules})
	a := tcpBackend(t, "a")
	h.apply(svc("one", config.TCP, a))
	if h.port("one") != int(base) {
		t.Fatalf("listener on %d, want %d", h.port("one"), base)
	}
	rules.fail.Store(true)
	// One's rules could not be removed, in this sync nor in the next.
	for range 2 {
		h.apply(svc("two", config.TCP, a))
		for _, fe := range h.p.Frontends() {
			if fe.Service.Name.Name == "two" && !errors.Is(fe.Err, ErrPortsExhausted) {
				t.Fatalf("service two got a port (err %v) while the rules may still point one's traffic at it", fe.Err)
			}
		}
	}
	if _, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", base), time.Second); err == nil {
		t.Fatal("the removed Service's listener still accepts")
	}
	rules.fail.Store(false)
	waitFor(t, "the port after a successful rule sync", func() bool {
		h.p.Update(&config.State{Ports: map[config.ServicePortName]*config.ServicePort{{Namespace: "ns", Name: "two"}: svc("two", config.TCP, a)}})
		return h.port("two") == int(base)
	})
}

func TestNodePortListenerHoldsThePort(t *testing.T) {
	h := startProxier(t, Config{})
	a := tcpBackend(t, "a")
	free := closedPort(t).Port()
	sp := svc("np", config.TCP, a)
	sp.NodePort = int(free)
	h.apply(sp)
	if h.port("np") != int(free) {
		t.Fatalf("listener on %d, want the NodePort %d", h.port("np"), free)
	}
	if _, err := net.Listen("tcp4", fmt.Sprintf("127.0.0.1:%d", free)); err == nil {
		t.Fatal("another process could take the NodePort")
	}
	if got := fetchName(t, h.addr("np")); got != "a" {
		t.Fatalf("reached %q", got)
	}

	// A NodePort someone else holds: the service is served on another port
	// and the NodePort error is reported for it alone.
	other, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	taken := svc("taken", config.TCP, a)
	taken.NodePort = other.Addr().(*net.TCPAddr).Port
	h.apply(sp, taken)
	fe, ok := h.p.Lookup(taken.Name, 4, KindAll)
	if !ok || fe.NodePortErr == nil || int(fe.Listen.Port()) == taken.NodePort {
		t.Fatalf("frontend %+v: want a NodePort error and another port", fe)
	}
	if got := fetchName(t, h.addr("taken")); got != "a" {
		t.Fatalf("reached %q", got)
	}
	if fe, _ := h.p.Lookup(sp.Name, 4, KindAll); fe.NodePortErr != nil {
		t.Fatalf("the other service got an error: %v", fe.NodePortErr)
	}

	// Changing the Service port keeps the NodePort: the listener is
	// replaced on the same port.
	moved := svc("np", config.TCP, a)
	moved.NodePort, moved.Port = int(free), 8080
	h.apply(moved, taken)
	if h.port("np") != int(free) {
		t.Fatalf("after a port change the listener is on %d, want %d", h.port("np"), free)
	}
	if got := fetchName(t, h.addr("np")); got != "a" {
		t.Fatalf("reached %q", got)
	}
}

func TestRestrictedNodePortIsHeldNotServed(t *testing.T) {
	h := startProxier(t, Config{NodePortsRestricted: true})
	free := closedPort(t).Port()
	sp := svc("np", config.TCP, tcpBackend(t, "a"))
	sp.NodePort = int(free)
	h.apply(sp)
	if p := h.port("np"); p == int(free) || p == 0 {
		t.Fatalf("listener on %d; with restricted NodePorts it must not sit on the NodePort", p)
	}
	if _, err := net.Listen("tcp4", fmt.Sprintf("127.0.0.1:%d", free)); err == nil {
		t.Fatal("another process could take the held NodePort")
	}
	if c, err := net.DialTimeout("tcp4", fmt.Sprintf("127.0.0.1:%d", free), time.Second); err == nil {
		c.Close()
		t.Fatal("the held NodePort accepted a connection directly")
	}
	h.apply()
	waitFor(t, "NodePort released", func() bool {
		ln, err := net.Listen("tcp4", fmt.Sprintf("127.0.0.1:%d", free))
		if err == nil {
			ln.Close()
		}
		return err == nil
	})
}

// The default connection log leaves normal closes out and logs the rest.
func TestConnLogErrorsOnly(t *testing.T) {
	h := startProxier(t, Config{ConnLogMode: ConnLogErrors})
	h.apply(svc("ok", config.TCP, tcpBackend(t, "a")), svc("empty", config.TCP))
	fetchName(t, h.addr("ok"))
	expectReset(t, h.addr("empty"))
	waitFor(t, "the reset's line", func() bool { return len(h.logs.Find("Connection closed")) == 1 })
	time.Sleep(100 * time.Millisecond) // proving an absence: the normal close's line
	if lines := h.logs.Find("Connection closed"); len(lines) != 1 || lines[0]["cause"] != CauseNoEndpoints.String() {
		t.Fatalf("lines %v: want only the no-endpoints reset", lines)
	}
}

// seriesOf counts the series of the per-service metrics labelled service.
func seriesOf(service string) int {
	n := 0
	for _, c := range []prometheus.Collector{connsAccepted, connsActive, dialAttempts, dialFailures, retries,
		noEndpointResets, bytesTotal, udpFlowsActive, udpFlowsEvicted, connDuration} {
		ch := make(chan prometheus.Metric, 1024)
		c.Collect(ch)
		close(ch)
		for m := range ch {
			var d dto.Metric
			_ = m.Write(&d)
			for _, l := range d.GetLabel() {
				if l.GetName() == "service" && l.GetValue() == service {
					n++
				}
			}
		}
	}
	return n
}

// A service port's series appear with its first connection and go when the
// service port is no longer served.
func TestServiceMetricsCreatedOnUseDeletedOnRemoval(t *testing.T) {
	h := startProxier(t, Config{})
	backend := tcpBackend(t, "a")
	h.apply(svc("gone", config.TCP, backend), svc("stays", config.TCP, backend))
	name := config.ServicePortName{Namespace: "ns", Name: "gone"}.String()
	if n := seriesOf(name); n != 0 {
		t.Fatalf("%d series before any traffic, want 0", n)
	}
	c, err := net.Dial("tcp", h.addr("gone"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(c).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	c.Close()
	waitFor(t, "the connection's series", func() bool { return seriesOf(name) >= 5 })
	h.apply(svc("stays", config.TCP, backend))
	waitFor(t, "the removed service's series to go", func() bool { return seriesOf(name) == 0 })
}

// A bulk sync (≥ bulkSync frontends opened or closed) collects its garbage at
// once, so that the next small change does not share the CPU with that
// collection; a small sync does not.
func TestBulkSyncCollectsGarbage(t *testing.T) {
	h := startProxier(t, Config{})
	syncs := func() []logrus.Fields { return h.logs.Find("Synced") }
	many := make([]*config.ServicePort, bulkSync)
	for i := range many {
		many[i] = svc(fmt.Sprintf("s%d", i), config.TCP)
	}
	h.apply(many...)
	var bulk logrus.Fields
	waitFor(t, "the bulk sync's log line", func() bool {
		for _, f := range syncs() {
			if f["frontends"] == bulkSync {
				bulk = f
			}
		}
		return bulk != nil
	})
	if _, ok := bulk["gcAfterBulk"]; !ok {
		t.Fatalf("bulk sync %v: no collection", bulk)
	}
	before := len(syncs())
	h.apply(append(many, svc("one-more", config.TCP))...)
	waitFor(t, "the small sync's log line", func() bool { return len(syncs()) > before })
	for _, f := range syncs()[before:] {
		if _, ok := f["gcAfterBulk"]; ok {
			t.Fatalf("sync %v opened one frontend and collected", f)
		}
	}
}
