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
	"os"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

// tcpClose is the kernel's TCP state CLOSE (testutil.TCPState).
const tcpClose = 7

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
	if f["bytesUp"] != int64(len(payload)) || f["bytesDown"] != int64(len(want)) || f["cause"] != dataplane.CauseClientClosed.String() {
		t.Fatalf("log line %v: want bytesUp=%d bytesDown=%d cause=%q", f, len(payload), len(want), dataplane.CauseClientClosed)
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
	backendReset := make(chan error, 10)
	backend := serveBackend(t, func(c net.Conn, _ <-chan struct{}) {
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		// Reply only once the client's FIN came through, so the reply
		// always finds the client gone; then keep the connection open
		// and silent until the proxy resets it. (Reads say EOF even then:
		// the kernel reports the FIN before the error. The TCP state tells.)
		if _, err := io.Copy(io.Discard, c); err != nil {
			backendReset <- err
			return
		}
		_, _ = c.Write([]byte("late reply\n"))
		for {
			if testutil.TCPState(c.(*net.TCPConn)) == tcpClose {
				backendReset <- nil
				return
			}
			if _, err := c.Read(make([]byte, 1)); err != io.EOF {
				backendReset <- err // the deadline
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
	h := startProxier(t, Config{})
	h.apply(svc("late", config.TCP, backend))
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
		if f["cause"] != dataplane.CauseClientReset.String() {
			t.Errorf("cause %v, want %q", f["cause"], dataplane.CauseClientReset)
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

func TestTCPMultiPortService(t *testing.T) {
	h := startProxier(t, Config{})
	http := svc("multi", config.TCP, tcpBackend(t, "http"))
	http.Name.Port = "http"
	admin := svc("multi", config.TCP, tcpBackend(t, "admin"))
	admin.Name.Port, admin.Port = "admin", 9090
	h.apply(http, admin)
	for _, tc := range []struct{ port, want string }{{"http", "http"}, {"admin", "admin"}} {
		p := h.p.ListenPort(config.ServicePortName{Namespace: "ns", Name: "multi", Port: tc.port}, 4, config.KindAll)
		if got := fetchName(t, fmt.Sprintf("127.0.0.1:%d", p)); got != tc.want {
			t.Errorf("port %s reached %q", tc.port, got)
		}
	}
}

// A service port without endpoints refuses at connect, as kube-proxy's
// REJECT does: a client (nc -z, a readiness check, a pool) must not see the
// port open. Once an endpoint appears it serves, within the sync that brought
// it; when the endpoint goes it refuses again.
func TestTCPNoEndpointsRefuses(t *testing.T) {
	h := startProxier(t, Config{})
	empty := svc("empty", config.TCP)
	h.apply(empty)
	expectRefused(t, h.addr("empty"))
	if st := h.p.status(h.frontend("empty")); !st.Refusing {
		t.Fatal("the status does not say the port refuses")
	}
	served := svc("empty", config.TCP, tcpBackend(t, "a"))
	h.apply(served)
	if got := fetchName(t, h.addr("empty")); got != "a" {
		t.Fatalf("after an endpoint appeared: reached %q, want a", got)
	}
	h.apply(empty)
	expectRefused(t, h.addr("empty"))
}

// While a port refuses, another socket can listen on it (the refusing socket
// binds with SO_REUSEADDR, as the listener did, for the connections it
// accepted). When an endpoint then comes, the listener cannot open again:
// the frontend leaves the live set, the view and the log say why, and the
// sync goroutine opens it again on another port, where it serves. The
// intruder's port is never given to the Service again.
func TestTCPRefusingPortTakenMeanwhile(t *testing.T) {
	h := startProxier(t, Config{})
	h.apply(svc("empty", config.TCP))
	port := h.port("empty")
	expectRefused(t, h.addr("empty"))
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1) }); err != nil {
			return err
		}
		return serr
	}}
	intruder, err := lc.Listen(context.Background(), "tcp4", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatalf("another socket on the refusing port %d: %v", port, err)
	}
	defer intruder.Close()

	served := svc("empty", config.TCP, tcpBackend(t, "a"))
	h.apply(served)
	if len(h.logs.Find("Cannot open listener; service port not served, retrying")) == 0 {
		t.Fatalf("no error logged for the listener that could not open again; log: %q", h.logs.Entries())
	}
	waitFor(t, "the Service served on another port", func() bool {
		p := h.port("empty")
		return p != 0 && p != port
	})
	if got := fetchName(t, h.addr("empty")); got != "a" {
		t.Fatalf("reached %q, want a", got)
	}
	for _, f := range h.p.Frontends() {
		if f.Err != nil || int(f.Listen.Port()) == port {
			t.Fatalf("after the retry the view holds %+v", f)
		}
	}
}

// expectRefused connects and expects the connect itself to fail with
// ECONNREFUSED (a reset to the SYN), within a bound.
func expectRefused(t *testing.T, addr string) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err == nil {
		c.Close()
		t.Fatalf("connect to %s succeeded, want connection refused", addr)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("connect to %s: %v, want connection refused", addr, err)
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
				if f["reason"] == string(balance.ReasonRetry) {
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
	if f := h.logs.Find("Connection closed")[0]; f["cause"] != dataplane.CauseIdleTimeout.String() {
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

// stuckBackend accepts connections and never reads from them: a client that
// keeps sending fills every buffer on the way, and the proxy's upstream copy
// parks writing to it.
func stuckBackend(t *testing.T) netip.AddrPort {
	t.Helper()
	return serveBackend(t, func(_ net.Conn, done <-chan struct{}) { <-done })
}

// pushUntilStuck connects to addr and writes until the writes stall (every
// buffer between it and a backend that does not read is full). The writer
// goes on in the background until the connection ends.
func pushUntilStuck(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	var written atomic.Int64
	go func() {
		buf := make([]byte, 64<<10)
		for {
			n, err := c.Write(buf)
			written.Add(int64(n))
			if err != nil {
				return
			}
		}
	}()
	testutil.WaitStalled(t, "the client's writes to stall", 20*time.Second, 200*time.Millisecond, written.Load)
	return c
}

// The idle timeout ends a pair whose bytes stopped moving although a copy is
// parked writing to a backend that stopped reading (no read deadline of its
// could fire), and the teardown does not wait for that write.
func TestTCPIdleTimeoutStuckBackend(t *testing.T) {
	const idle = time.Second
	h := startProxier(t, Config{TCPIdleTimeout: idle})
	h.apply(svc("stuck", config.TCP, stuckBackend(t)))
	c := pushUntilStuck(t, h.addr("stuck"))
	stalled := time.Now()
	waitFor(t, "the pair to end", func() bool { return len(h.logs.Find("Connection closed")) == 1 })
	// The stall began up to ~0.4 s before it was seen; the watch ends a
	// quiet pair within 1.25 idle of its last byte. Loaded machines add
	// scheduling delay only, so the bound is one-sided and generous.
	if d := time.Since(stalled); d > 5*idle {
		t.Errorf("ended %v after the stall, want about %v", d, idle)
	}
	if f := h.logs.Find("Connection closed")[0]; f["cause"] != dataplane.CauseIdleTimeout.String() {
		t.Fatalf("cause %v, want %q", f["cause"], dataplane.CauseIdleTimeout)
	}
	// The client sees its connection end.
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("client read after the idle timeout: %v, want EOF or a reset", err)
	}
}

// Shutdown with a pair parked writing to a stuck backend ends within the
// grace period plus a little: the grace is a hard bound.
func TestShutdownGraceIsHardBound(t *testing.T) {
	log := logrus.New()
	log.SetOutput(io.Discard)
	p := New(Config{BindAddress: loopback, MinSyncPeriod: time.Millisecond, Log: log})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	const grace = 500 * time.Millisecond
	go func() { p.Run(ctx, grace); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	st := &config.State{Ports: map[config.ServicePortName]*config.ServicePort{}, Node: "node-a"}
	sp := svc("stuck", config.TCP, stuckBackend(t))
	st.Ports[sp.Name] = sp
	p.Update(st)
	var port int
	waitFor(t, "the listener", func() bool { port = p.ListenPort(sp.Name, 4, config.KindAll); return port != 0 })
	pushUntilStuck(t, fmt.Sprintf("127.0.0.1:%d", port))
	start := time.Now()
	cancel()
	select {
	case <-done:
		if d := time.Since(start); d < grace {
			t.Errorf("Run returned after %v, before the grace period (%v) for a live connection", d, grace)
		}
	case <-time.After(grace + 5*time.Second):
		t.Fatalf("Run still running %v after shutdown began (grace %v)", grace+5*time.Second, grace)
	}
}

// TCP connections stop at the descriptor budget: past it a new connection
// is reset at once, so that the reserve stays for accepts, rule syncs and
// the API watch; one that ends gives its place back.
func TestTCPWithinDescriptorBudget(t *testing.T) {
	h := startProxier(t, Config{FileLimit: 200}) // reserve 64: 136 for listeners and connections
	h.apply(svc("full", config.TCP, tcpBackend(t, "a")))
	room := (h.p.dp.Budget().Limit - h.p.dp.Budget().Reserve - 1) / 2 // one listener, two descriptors a connection
	var open []net.Conn
	defer func() {
		for _, c := range open {
			c.Close()
		}
	}()
	served := 0
	for i := 0; i < room+5; i++ {
		c, err := net.Dial("tcp", h.addr("full"))
		if errors.Is(err, syscall.ECONNRESET) {
			continue // the reset beat connect's return
		}
		if err != nil {
			t.Fatal(err)
		}
		open = append(open, c)
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if line, err := bufio.NewReader(c).ReadString('\n'); err == nil && line == "a\n" {
			served++
		} else if !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("connection %d: %q %v, want the name or a reset", i, line, err)
		}
	}
	if served != room {
		t.Fatalf("%d connections served, want %d (the budget's room)", served, room)
	}
	// One ends: its place goes to the next.
	open[0].Close()
	waitFor(t, "a place freed", func() bool { return h.p.dp.Budget().TCPConns < int64(room) })
	if got := fetchName(t, h.addr("full")); got != "a" {
		t.Fatalf("after a connection ended: %q", got)
	}
}

// Idle connections give up their copies' goroutines: with parking, 100 idle
// connections have no goroutine in sock.Copy (without, 200), and each one
// still carries data at once when it wakes, parks again, counts its bytes
// and ends with its client.
func TestIdleConnectionsParkWithoutGoroutines(t *testing.T) {
	const conns = 100
	copies := func() int {
		buf := make([]byte, 8<<20)
		return strings.Count(string(buf[:runtime.Stack(buf, true)]), "proxy/internal/sock.Copy(")
	}
	for _, tc := range []struct {
		name    string
		park    time.Duration
		copying int // goroutines in sock.Copy while the connections are idle
	}{
		{"parked", 30 * time.Millisecond, 0},
		{"never", -1, 2 * conns},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := startProxier(t, Config{ParkIdleAfter: tc.park})
			h.apply(svc("idle", config.TCP, tcpBackend(t, "a")))
			var cs []net.Conn
			var rs []*bufio.Reader
			for i := 0; i < conns; i++ {
				c, err := net.Dial("tcp", h.addr("idle"))
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(30 * time.Second))
				r := bufio.NewReader(c)
				if line, err := r.ReadString('\n'); line != "a\n" || err != nil {
					t.Fatalf("connection %d: %q %v", i, line, err)
				}
				cs, rs = append(cs, c), append(rs, r)
			}
			quiet := func() {
				t.Helper()
				if tc.park > 0 {
					waitFor(t, "every socket parked", func() bool { return h.p.dp.Parked() == 2*conns })
				} else {
					time.Sleep(100 * time.Millisecond) // a parker, had there been one, would have parked them
				}
				if n := copies(); n != tc.copying {
					t.Fatalf("%d goroutines in sock.Copy with %d idle connections, want %d", n, conns, tc.copying)
				}
			}
			quiet()
			for i, c := range cs {
				fmt.Fprintf(c, "ping %d\n", i)
				if line, err := rs[i].ReadString('\n'); line != fmt.Sprintf("ping %d\n", i) || err != nil {
					t.Fatalf("connection %d after a pause: %q %v", i, line, err)
				}
			}
			quiet()
			for _, c := range cs {
				c.Close()
			}
			waitFor(t, "every connection logged", func() bool { return len(h.logs.Find("Connection closed")) == conns })
			for _, f := range h.logs.Find("Connection closed") {
				up, down := f["bytesUp"].(int64), f["bytesDown"].(int64)
				if f["cause"] != dataplane.CauseClientClosed.String() || up < 7 || up > 8 || down != up+2 {
					t.Fatalf("connection closed: cause %v, %d bytes up, %d down; want client closed, 7-8 up and 2 more down", f["cause"], up, down)
				}
			}
			if n := h.p.dp.Parked(); n != 0 {
				t.Fatalf("%d sockets still parked after every connection ended", n)
			}
		})
	}
}

// The socket dialled to a backend is probed with keep-alive as the
// client's is, from the dial where copies never park, else from the
// first time the backend goes quiet (a short connection never pays for
// it): either way an idle connection's backend socket has the kernel's
// keep-alive timer running.
func TestBackendSocketProbedWhenQuiet(t *testing.T) {
	for _, tc := range []struct {
		name string
		park time.Duration
	}{{"parked", 30 * time.Millisecond}, {"never parked", -1}} {
		t.Run(tc.name, func(t *testing.T) {
			h := startProxier(t, Config{ParkIdleAfter: tc.park})
			ep := tcpBackend(t, "a")
			h.apply(svc("quiet", config.TCP, ep))
			c, err := net.Dial("tcp", h.addr("quiet"))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(30 * time.Second))
			if line, err := bufio.NewReader(c).ReadString('\n'); line != "a\n" || err != nil {
				t.Fatalf("%q %v", line, err)
			}
			waitFor(t, "the keep-alive timer on the socket to the backend", func() bool { return tcpTimerTo(t, ep) == "02" })
		})
	}
}

// tcpTimerTo is the timer (/proc/net/tcp's "tr": 00 none, 01 retransmit,
// 02 keep-alive) of the established IPv4 socket connected to ep.
func tcpTimerTo(t *testing.T, ep netip.AddrPort) string {
	t.Helper()
	data, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	a := ep.Addr().As4()
	rem := fmt.Sprintf("%02X%02X%02X%02X:%04X", a[3], a[2], a[1], a[0], ep.Port())
	for _, line := range strings.Split(string(data), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) > 5 && f[2] == rem && f[3] == "01" {
			return strings.SplitN(f[5], ":", 2)[0]
		}
	}
	return ""
}

// A shutdown ends connections whose sockets are parked: Run returns at once
// (grace 0) and the client sees the connection end.
func TestShutdownEndsParkedConnections(t *testing.T) {
	h := startProxier(t, Config{ParkIdleAfter: 20 * time.Millisecond})
	h.apply(svc("svc", config.TCP, tcpBackend(t, "a")))
	c, err := net.Dial("tcp", h.addr("svc"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	r := bufio.NewReader(c)
	if _, err := r.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "both sockets parked", func() bool { return h.p.dp.Parked() == 2 })
	stopped := make(chan struct{})
	go func() { h.stop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		// The test binary's timeout ends it: Run is stuck for good.
		panic("Run did not return within 10 s with a parked connection")
	}
	if _, err := r.ReadString('\n'); err == nil {
		t.Fatal("the connection is still open after the shutdown")
	}
	if f := h.logs.Find("Connection closed"); len(f) != 1 || f[0]["cause"] != dataplane.CauseShutdown.String() {
		t.Fatalf("connection log %v, want one line with cause shutdown", f)
	}
}
