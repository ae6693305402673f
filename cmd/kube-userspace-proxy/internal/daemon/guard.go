package daemon

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/netutil"
)

// hostAllowed says whether a request's Host names this server: localhost,
// a loopback address, or the address it is bound to (any address literal
// when bound to all of them). A DNS name other than localhost is refused:
// that is what a DNS-rebinding page sends, having pointed its own name at
// 127.0.0.1, and no one reaches the daemon by a name of their own.
func hostAllowed(hostport string, bind netip.Addr) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.ToLower(strings.Trim(host, "[]")), ".")
	if host == "localhost" {
		return true
	}
	ip, err := netip.ParseAddr(host)
	if err != nil || ip.Zone() != "" {
		return false
	}
	ip = ip.Unmap()
	return ip.IsLoopback() || (bind.IsValid() && (bind.IsUnspecified() || ip == bind.Unmap()))
}

// guardHost answers 421 to a request whose Host is not this server's.
func guardHost(bind netip.Addr, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !hostAllowed(r.Host, bind) {
			http.Error(w, fmt.Sprintf("Host %q is not this daemon's address (use 127.0.0.1 or localhost)", r.Host), http.StatusMisdirectedRequest)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// serverLimits bound what one client can hold of an HTTP server: how long
// it may take to send its request and read the answer, how long an idle
// keep-alive connection stays, the header size, and how many connections
// are open at once (beyond that, new ones wait in the accept queue). The
// idle timeouts are short: keep-alive clients that go quiet (a browser, a
// scraper, a test's client) would otherwise fill the limit and make
// everyone else wait. The descriptors stay inside the budget's reserve.
type serverLimits struct {
	readHeader, read, write, idle time.Duration
	maxHeaderBytes, maxConns      int
}

var (
	// The health address is probed by load balancers across the network:
	// small answers, short timeouts.
	healthLimits = serverLimits{readHeader: 5 * time.Second, read: 10 * time.Second, write: 10 * time.Second,
		idle: 10 * time.Second, maxHeaderBytes: 8 << 10, maxConns: 64}
	// The metrics address (local by default) also serves the debug pages:
	// a CPU profile writes for its duration, a big connection table for a
	// while.
	metricsLimits = serverLimits{readHeader: 5 * time.Second, read: 30 * time.Second, write: 2 * time.Minute,
		idle: 5 * time.Second, maxHeaderBytes: 16 << 10, maxConns: 64}
)

func (l serverLimits) server(h http.Handler) *http.Server {
	return &http.Server{Handler: h, ReadHeaderTimeout: l.readHeader, ReadTimeout: l.read, WriteTimeout: l.write,
		IdleTimeout: l.idle, MaxHeaderBytes: l.maxHeaderBytes}
}

// shutdownWith shuts srv down when ctx ends, giving its requests 2 s.
func shutdownWith(ctx context.Context, srv *http.Server) {
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = srv.Shutdown(sctx)
}

func (l serverLimits) listener(ln net.Listener) net.Listener {
	return netutil.LimitListener(ln, l.maxConns)
}

// bindOf is the address part of an ip:port flag (checked at parse).
func bindOf(addr string) netip.Addr {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return netip.Addr{}
	}
	return ap.Addr()
}

// sharedAnswers computes a costly read at most once per interval for the
// same route and query, however many ask: concurrent callers wait for the
// one computing and get the same bytes. A page polling every second on a
// node with 10 000 service ports then costs one answer a second, not one
// per tab, and four iptables-save runs are never started twice at once.
type sharedAnswers struct {
	interval time.Duration
	mu       sync.Mutex // guards byKey; one answer computed at a time
	byKey    map[string]*sharedAnswer
}

type sharedAnswer struct {
	at     time.Time
	status int
	header http.Header
	body   []byte
}

func newSharedAnswers(interval time.Duration) *sharedAnswers {
	return &sharedAnswers{interval: interval, byKey: map[string]*sharedAnswer{}}
}

// wrap serves h's answers through the cache.
func (s *sharedAnswers) wrap(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			h(w, r)
			return
		}
		key := r.URL.Path + "?" + r.URL.RawQuery + "\x00" + r.Header.Get("Accept")
		s.mu.Lock()
		a := s.byKey[key]
		if a == nil || time.Since(a.at) >= s.interval {
			rec := &recorder{header: http.Header{}, status: http.StatusOK}
			h(rec, r)
			a = &sharedAnswer{at: time.Now(), status: rec.status, header: rec.header, body: rec.body.Bytes()}
			for k, old := range s.byKey { // forget what nobody asked for lately
				if time.Since(old.at) > 10*s.interval {
					delete(s.byKey, k)
				}
			}
			s.byKey[key] = a
		}
		s.mu.Unlock()
		for k, v := range a.header {
			w.Header()[k] = v
		}
		w.WriteHeader(a.status)
		_, _ = w.Write(a.body)
	}
}

// recorder keeps a handler's answer.
type recorder struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (r *recorder) Header() http.Header         { return r.header }
func (r *recorder) WriteHeader(status int)      { r.status = status }
func (r *recorder) Write(b []byte) (int, error) { return r.body.Write(b) }

// oneAtATime runs h for one request at a time; the others wait their turn.
func oneAtATime(h http.HandlerFunc) http.HandlerFunc {
	var mu sync.Mutex
	return func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		h(w, r)
	}
}
