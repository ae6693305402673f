package daemon

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

func TestHostAllowed(t *testing.T) {
	local := netip.MustParseAddr("127.0.0.1")
	all := netip.MustParseAddr("0.0.0.0")
	node := netip.MustParseAddr("10.0.0.5")
	for _, tc := range []struct {
		host string
		bind netip.Addr
		want bool
	}{
		{"127.0.0.1:10249", local, true},
		{"localhost:10249", local, true},
		{"LOCALHOST.:10249", local, true},
		{"[::1]:10249", local, true},
		{"127.0.0.1", local, true},
		{"evil.example:10249", local, false}, // a rebinding page's own name
		{"127.0.0.1.nip.io:10249", local, false},
		{"10.0.0.5:10249", local, false}, // not the address it is bound to
		{"10.0.0.5:10256", node, true},
		{"10.0.0.9:10256", node, false},
		{"10.0.0.9:10256", all, true}, // a load balancer probing any node address
		{"[fe80::1%eth0]:10256", all, false},
		{"", local, false},
	} {
		if got := hostAllowed(tc.host, tc.bind); got != tc.want {
			t.Errorf("hostAllowed(%q, %s) = %v, want %v", tc.host, tc.bind, got, tc.want)
		}
	}
}

// startTestHTTP serves h as the daemon does on a free loopback port.
func startTestHTTP(t *testing.T, h http.Handler, limits serverLimits) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	log := logrus.New()
	log.SetOutput(io.Discard)
	ctx, cancel := context.WithCancel(context.Background())
	done, err := startHTTP(ctx, addr, nil, h, limits, true, time.Second, log)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() { cancel(); <-done.done })
	return addr
}

// A DNS-rebinding page reaches 127.0.0.1 under its own name: every route
// of both addresses refuses it, drain included, whatever else it sends.
func TestEveryRouteRefusesAForeignHost(t *testing.T) {
	p := proxy.New(proxy.Config{})
	d := &debugServer{p: p, health: healthHandler(p, time.Second, true, true)}
	metrics := startTestHTTP(t, d.routes(prometheus.NewRegistry(), true), metricsLimits)
	health := startTestHTTP(t, healthMux(p, time.Second), healthLimits)
	routes := map[string][]string{
		metrics: {"/", "/metrics", "/debug/connections", "/debug/services", "/debug/rules", "/debug/explain", "/debug/log",
			"/debug/drain?service=ns/web&endpoint=10.0.0.1:80", "/debug/pprof/", "/proxyMode", "/configz", "/healthz"},
		health: {"/healthz", "/livez"},
	}
	for addr, paths := range routes {
		for _, path := range paths {
			for _, method := range []string{http.MethodGet, http.MethodPost} {
				req, _ := http.NewRequest(method, "http://"+addr+path, nil)
				req.Host = "evil.example:10249"
				req.Header.Set("Origin", "http://evil.example:10249")
				req.Header.Set(drainHeader, "drain")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusMisdirectedRequest {
					t.Errorf("%s %s with Host evil.example: %d, want 421", method, path, resp.StatusCode)
				}
			}
		}
	}
	// The same request to the real address gets through the guard.
	resp, err := http.Get("http://" + metrics + "/proxyMode")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/proxyMode on 127.0.0.1: %d", resp.StatusCode)
	}
}

// Idle and silent connections are closed by the server within its
// timeouts, however many a client opens: no one holds the health address.
func TestServerClosesIdleConnections(t *testing.T) {
	limits := serverLimits{readHeader: 300 * time.Millisecond, read: time.Second, write: time.Second,
		idle: 300 * time.Millisecond, maxHeaderBytes: 4 << 10, maxConns: 16}
	addr := startTestHTTP(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }), limits)
	const n = 200
	conns := make([]net.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := 0; i < n; i++ {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		if i%2 == 0 { // half make one keep-alive request, then idle
			io.WriteString(c, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for i, c := range conns {
		_ = c.SetReadDeadline(deadline)
		data, err := io.ReadAll(c)
		if err != nil {
			t.Fatalf("connection %d not closed by the server by the deadline: %v", i, err)
		}
		if i%2 == 0 && !strings.Contains(string(data), "ok") {
			t.Errorf("connection %d: no answer before the close: %q", i, data)
		}
	}
	// A header beyond the limit is refused.
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "+strings.Repeat("a", 64<<10)+"\r\n\r\n")
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	line, _ := io.ReadAll(io.LimitReader(c, 64))
	if !strings.Contains(string(line), "431") {
		t.Errorf("a 64 KiB header: %q, want 431", line)
	}
}

// A costly read is computed once per interval for the same query, however
// many ask at once; another query, or a later one, computes again.
func TestSharedAnswers(t *testing.T) {
	var calls atomic.Int32
	s := newSharedAnswers(time.Hour)
	h := s.wrap(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		time.Sleep(20 * time.Millisecond) // long enough for the others to queue
		w.Header().Set("X-Q", r.URL.RawQuery)
		io.WriteString(w, "answer "+r.URL.RawQuery)
	})
	var wg sync.WaitGroup
	for i := 0; i < 20; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rec := httptest.NewRecorder()
			h(rec, httptest.NewRequest(http.MethodGet, "/debug/services?a=1", nil))
			if rec.Body.String() != "answer a=1" || rec.Header().Get("X-Q") != "a=1" {
				t.Errorf("answer %q %v", rec.Body.String(), rec.Header())
			}
		}()
	}
	wg.Wait()
	if n := calls.Load(); n != 1 {
		t.Fatalf("computed %d times for 20 requests at once, want 1", n)
	}
	h(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/debug/services?a=2", nil))
	if n := calls.Load(); n != 2 {
		t.Fatalf("another query: computed %d times in all, want 2", n)
	}
	s.interval = 0
	h(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/debug/services?a=1", nil))
	if n := calls.Load(); n != 3 {
		t.Fatalf("after the interval: computed %d times in all, want 3", n)
	}
}

// A client that asks for a big answer and never reads it holds only its
// own connection: the same answer is served to the next client at once.
func TestSlowReaderDoesNotHoldTheServer(t *testing.T) {
	big := strings.Repeat("x", 16<<20)
	shared := newSharedAnswers(time.Second)
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/connections", shared.wrap(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, big) }))
	addr := startTestHTTP(t, mux, metricsLimits)
	slow, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	io.WriteString(slow, "GET /debug/connections HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n") // and never read
	client := &http.Client{Timeout: 10 * time.Second}
	resp, err := client.Get("http://" + addr + "/debug/connections")
	if err != nil {
		t.Fatalf("a second reader while the first does not read: %v", err)
	}
	n, _ := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if n != int64(len(big)) {
		t.Fatalf("read %d bytes, want %d", n, len(big))
	}
}
