package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"net/netip"
	"os"
	"regexp"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
)

// proxyHealthy is the proxy's own health: no queued change has waited
// longer than 2 × the sync period, the last sync succeeded, every listener
// is open and descriptors did not run out lately.
func proxyHealthy(h proxy.Health, syncPeriod time.Duration, now time.Time) bool {
	return h.LastErr == nil && (h.QueuedAt.IsZero() || now.Sub(h.QueuedAt) <= 2*syncPeriod) && h.ListenFailures == 0 && !h.OutOfFiles
}

// healthHandler serves /healthz (node: true) and /livez with kube-proxy's
// JSON body. Both fail (503) when the proxy is unhealthy; /healthz also
// while the node is being deleted or tainted for removal, so that load
// balancers stop sending to it before it goes (kube-proxy's nodeEligible).
//
// detail adds the last sync error (iptables' stderr, Service names): only
// on the metrics address, never on the health address, which the network
// reaches; the error is in the log either way.
func healthHandler(p *proxy.Proxier, syncPeriod time.Duration, node, detail bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := p.Health()
		now := time.Now()
		healthy := proxyHealthy(h, syncPeriod, now)
		body := map[string]any{"lastUpdated": h.LastUpdated, "currentTime": now}
		if node {
			body["nodeEligible"] = !h.NodeDeleting
			healthy = healthy && !h.NodeDeleting
		}
		body["healthy"] = healthy
		if h.LastErr != nil && detail {
			body["lastError"] = h.LastErr.Error()
		}
		if h.OutOfFiles {
			body["outOfFiles"] = true // accepts or dials failed for want of descriptors, less than 10 s ago
		}
		if h.ListenFailures > 0 {
			// Not one Service's conflict: the daemon cannot open
			// listeners (see the log and /debug/services).
			body["listenFailures"] = h.ListenFailures
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		if !healthy {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(body)
	})
}

// adminRoutes are what changes state, for the admin socket.
func (d *debugServer) adminRoutes() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/drain", d.drain)
	return mux
}

// debugServer serves /metrics and the /debug pages.
type debugServer struct {
	p     *proxy.Proxier
	rules *iptables.Rules // nil with --iptables=false
	node  string          // this node's name, for traffic policies
	log   *recentLog      // the latest connection log lines, for the page
	// conf is the effective configuration, for /configz.
	conf map[string]any
	// health is /healthz with the last error in the body (local only).
	health http.Handler
	// audit logs every change made through these pages, with who asked.
	audit logrus.FieldLogger
	// drainOnMetrics serves /debug/drain on the metrics address too (the
	// old behaviour); adminSocket is where it is served otherwise.
	drainOnMetrics bool
	adminSocket    string
	// guardTCP, guardUDP: the daemon guards the proxy ports itself, for
	// explain (no conntrack match; UDP where conntrack netlink answers).
	guardTCP, guardUDP bool
}

func (d *debugServer) routes(reg *prometheus.Registry, profiling bool) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	shared := newSharedAnswers(time.Second)
	mux.HandleFunc("/debug/connections", shared.wrap(d.connections))
	mux.HandleFunc("/debug/services", shared.wrap(d.services))
	mux.HandleFunc("/debug/rules", shared.wrap(d.showRules))
	if d.drainOnMetrics {
		mux.HandleFunc("/debug/drain", d.drain)
	} else {
		mux.HandleFunc("/debug/drain", func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, "drains are made on the admin socket (curl --unix-socket "+d.adminSocket+
				" http://localhost/debug/drain?...); --drain-on-metrics-address allows them here", http.StatusForbidden)
		})
	}
	// An explanation predicts the next connection from the state of now:
	// never an old answer, but one at a time (each reads every table).
	mux.HandleFunc("/debug/explain", oneAtATime(d.explainHTTP))
	mux.HandleFunc("/debug/log", d.connLog)
	mux.HandleFunc("/proxyMode", proxyMode)
	if d.health != nil {
		mux.Handle("/healthz", d.health)
	}
	mux.HandleFunc("/configz", configzHandler(d.conf))
	mux.HandleFunc("/", page)
	if profiling {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	return mux
}

// proxyMode answers as kube-proxy's /proxyMode does (its mode's name, as
// text), for the tools and the upstream e2e spec that ask it.
func proxyMode(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	fmt.Fprint(w, "userspace")
}

func wantsText(r *http.Request) bool {
	return r.URL.Query().Get("format") == "text" || strings.Contains(r.Header.Get("Accept"), "text/plain")
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// connections is the live TCP connection table: JSON, or ?format=text.
// ?limit=N (default 1000) and ?offset=M page it; X-Total-Count says how
// many there are (a busy node's whole table is tens of MB).
func (d *debugServer) connections(w http.ResponseWriter, r *http.Request) {
	limit, offset, ok := pageOf(w, r)
	if !ok {
		return
	}
	conns := d.p.Connections()
	w.Header().Set("X-Total-Count", strconv.Itoa(len(conns)))
	conns = conns[min(offset, len(conns)):]
	conns = conns[:min(limit, len(conns))]
	if !wantsText(r) {
		if conns == nil {
			conns = []dataplane.ConnInfo{}
		}
		writeJSON(w, conns)
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tSERVICE\tCLIENT\tSENT TO\tENDPOINT\tWHY\tTRIES\tDIAL\tAGE\tBYTES UP\tBYTES DOWN\tACKED DOWN")
	for _, c := range conns {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%d\t%d\t%d\n", c.ID, c.Service, c.Client, c.OrigDst, c.Endpoint,
			c.Reason, c.Attempts, c.DialLatency.Round(time.Microsecond), c.Age.Round(time.Millisecond), c.BytesUp, c.BytesDown, c.AckedDown)
	}
	tw.Flush()
}

// showRules prints our rules as last written, with the kernel's packet
// and byte counters: text as iptables-save -c prints it, or JSON with
// ?format=json.
func (d *debugServer) showRules(w http.ResponseWriter, r *http.Request) {
	if d.rules == nil {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintln(w, "# --iptables=false: no rules are programmed")
		return
	}
	rules, errs := d.ruleViews()
	if r.URL.Query().Get("format") == "json" {
		// Compact: indenting 10 000 rules' JSON was most of this
		// answer's garbage, read by the live page.
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"rules": rules, "counterErrors": errs})
		releaseAfterLargeAnswer(len(rules))
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	for _, e := range errs {
		fmt.Fprintf(w, "# counters unavailable: %s\n", e)
	}
	counts := d.rules.Counts()
	fam, table := 0, ""
	for _, v := range rules {
		if v.Family != fam {
			if table != "" {
				fmt.Fprintln(w, "COMMIT")
			}
			fam, table = v.Family, ""
			fmt.Fprintf(w, "# IPv%d: %d nat and %d filter rules in our chains, with [packets:bytes] counters\n", fam, counts[fmt.Sprintf("nat/%d", fam)], counts[fmt.Sprintf("filter/%d", fam)])
		}
		if v.Table != table {
			if table != "" {
				fmt.Fprintln(w, "COMMIT")
			}
			table = v.Table
			fmt.Fprintf(w, "*%s\n", table)
		}
		fmt.Fprintf(w, "[%d:%d] -A %s %s\n", v.Packets, v.Bytes, v.Chain, v.Rule)
	}
	if table != "" {
		fmt.Fprintln(w, "COMMIT")
	}
	releaseAfterLargeAnswer(len(rules))
}

// largeAnswerRules is the rule count from which an answer's garbage
// (iptables-save's output, its parse, the JSON) is collected and handed
// back to the kernel at once.
const largeAnswerRules = 2000

// releaseAfterLargeAnswer collects the garbage of an answer about rules
// rules and returns it to the kernel, when they are many: the runtime gives
// memory back only above its heap goal, so the live page's periodic read of
// the rules would raise the daemon's RSS for good. The forced collection is
// cheap beside the page's period, and concurrent readers share one answer a
// second.
func releaseAfterLargeAnswer(rules int) {
	if rules >= largeAnswerRules {
		debug.FreeOSMemory()
	}
}

// httpServing is one HTTP server started by startHTTP.
type httpServing struct {
	done <-chan struct{} // closed when it has stopped
	mu   sync.Mutex
	ln   net.Listener // once bound
}

// bound reports whether the server has its listener.
func (s *httpServing) bound() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ln != nil
}

// lend returns a duplicate of the server's listening socket for a
// successor (handover.go).
func (s *httpServing) lend() (*os.File, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ln == nil {
		return nil, errors.New("not bound")
	}
	return dupListener(s.ln)
}

// startHTTP serves h on addr until ctx ends, on inherited when a
// predecessor handed that over. A bind error is returned at
// once with hardFail (kube-proxy's bindAddressHardFail); otherwise it is
// logged and the bind retried every retry until it succeeds, as
// kube-proxy does, so that a daemon started beside a running one takes
// the address over once the other is gone.
func startHTTP(
	ctx context.Context,
	addr string,
	inherited net.Listener,
	h http.Handler,
	limits serverLimits,
	hardFail bool,
	retry time.Duration,
	log logrus.FieldLogger,
) (*httpServing, error) {
	done := make(chan struct{})
	s := &httpServing{done: done}
	if addr == "" {
		close(done)
		return s, nil
	}
	ln, err := inherited, error(nil)
	if ln == nil {
		ln, err = net.Listen("tcp", addr)
	}
	if err != nil && hardFail {
		return nil, fmt.Errorf("serving on %s: %w", addr, err)
	}
	if err != nil {
		log.WithError(err).WithField("address", addr).Error("Cannot serve HTTP yet; retrying")
	}
	srv := limits.server(guardHost(bindOf(addr), h))
	go shutdownWith(ctx, srv)
	go func() {
		defer close(done)
		for ln == nil {
			select {
			case <-ctx.Done():
				return
			case <-time.After(retry):
			}
			if ln, err = net.Listen("tcp", addr); err != nil {
				log.WithError(err).WithField("address", addr).Debug("Cannot serve HTTP yet; retrying")
			}
		}
		s.mu.Lock()
		s.ln = ln
		s.mu.Unlock()
		log.WithField("address", ln.Addr().String()).WithField("inherited", inherited != nil).Info("Serving HTTP")
		if err := srv.Serve(limits.listener(ln)); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.WithError(err).Error("HTTP server failed")
		}
	}()
	return s, nil
}

// runtimeCounters are the Go runtime's counts of what was allocated
// (go_gc_heap_allocs_bytes_total, _objects_total) and collected
// (go_gc_cycles_total_gc_cycles_total); with runtimeTailCollector's
// histograms make bench reads them around each run.
var runtimeCounters = collectors.GoRuntimeMetricsRule{Matcher: regexp.MustCompile(
	`^/gc/heap/allocs:(bytes|objects)$|^/gc/cycles/total:gc-cycles$`)}

// newRegistry holds every metric the daemon exports.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(runtimeCounters)), newRuntimeTailCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		healthzTotal, livezTotal, kernelPieceAvailable, buildInfo())
	proxy.RegisterMetrics(reg)
	iptables.RegisterMetrics(reg)
	return reg
}

// drainHeader must be on a drain request: a cross-site form cannot send a
// custom header, nor DELETE, and a script that could would need a CORS
// preflight, which this server never answers.
const drainHeader = "X-Kube-Userspace-Proxy"

// drain is POST (drain) or DELETE (undo) /debug/drain?service=ns/name[:port]&endpoint=ip:port
// with the header X-Kube-Userspace-Proxy: drain. It answers the connections
// still open to the endpoint.
func (d *debugServer) drain(w http.ResponseWriter, r *http.Request) {
	var drained bool
	switch r.Method {
	case http.MethodPost:
		drained = true
	case http.MethodDelete:
	default:
		w.Header().Set("Allow", "POST, DELETE")
		http.Error(w, "POST drains an endpoint, DELETE undoes it", http.StatusMethodNotAllowed)
		return
	}
	if r.Header.Get(drainHeader) != "drain" {
		http.Error(w, "state-changing request without the header "+drainHeader+": drain", http.StatusForbidden)
		return
	}
	if o := r.Header.Get("Origin"); o != "" && o != "http://"+r.Host {
		http.Error(w, "cross-origin request refused", http.StatusForbidden)
		return
	}
	name, err := parseServicePortName(r.URL.Query().Get("service"))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	ep, err := netip.ParseAddrPort(r.URL.Query().Get("endpoint"))
	if err != nil {
		http.Error(w, "endpoint: want ip:port", http.StatusBadRequest)
		return
	}
	active, err := d.p.Drain(name, ep, drained)
	if err != nil {
		http.Error(w, err.Error(), http.StatusNotFound)
		return
	}
	if d.audit != nil {
		d.audit.WithFields(logrus.Fields{"service": name.String(), "endpoint": ep.String(), "drained": drained,
			"peer": who(r), "userAgent": r.UserAgent()}).Warn("Drain changed")
	}
	writeJSON(w, map[string]any{"service": name.String(), "endpoint": ep.String(), "drained": drained, "active": active})
}

// parseServicePortName reads "namespace/name" or "namespace/name:port".
func parseServicePortName(s string) (config.ServicePortName, error) {
	ns, rest, ok := strings.Cut(s, "/")
	name, port, _ := strings.Cut(rest, ":")
	if !ok || ns == "" || name == "" {
		return config.ServicePortName{}, fmt.Errorf("service: want namespace/name or namespace/name:port, got %q", s)
	}
	return config.ServicePortName{Namespace: ns, Name: name, Port: port}, nil
}

// configzHandler serves a configuration fixed at start.
func configzHandler(conf map[string]any) http.HandlerFunc {
	body, err := json.MarshalIndent(conf, "", "  ")
	return func(w http.ResponseWriter, r *http.Request) {
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		_, _ = w.Write(body)
	}
}
