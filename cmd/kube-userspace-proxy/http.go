package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/pprof"
	"net/netip"
	"runtime/debug"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
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
// many there are (at 100 000 connections the whole table is ~35 MB).
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
			conns = []proxy.ConnInfo{}
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

// endpointView is one endpoint of a service port, as the source gave it.
type endpointView struct {
	Address     string `json:"address"`
	Ready       bool   `json:"ready"`
	Serving     bool   `json:"serving"`
	Terminating bool   `json:"terminating,omitempty"`
	Node        string `json:"node,omitempty"`
	// ZoneHints and NodeHints are the EndpointSlice's hints (comma-separated).
	ZoneHints string `json:"zoneHints,omitempty"`
	NodeHints string `json:"nodeHints,omitempty"`
	text      string // as the text view shows it
}

type serviceView struct {
	Service     string           `json:"service"`
	Kind        config.Kind      `json:"kind"`
	Family      int              `json:"family"`
	Protocol    string           `json:"protocol"`
	Listen      string           `json:"listen,omitempty"`
	Error       string           `json:"error,omitempty"`
	NodePortErr string           `json:"nodePortError,omitempty"`
	Port        int              `json:"port"`
	NodePort    int              `json:"nodePort,omitempty"`
	ClusterIPs  []string         `json:"clusterIPs"`
	ExternalIPs []string         `json:"externalIPs,omitempty"`
	LBIPs       []string         `json:"loadBalancerIPs,omitempty"`
	Endpoints   []endpointView   `json:"endpoints"`
	Affinity    string           `json:"affinityTimeout,omitempty"`
	Pins        []proxy.Affinity `json:"affinity,omitempty"`
	UDPFlows    *int             `json:"udpFlows,omitempty"`
	// Refusing: no endpoint can serve, so connections are refused at
	// connect (a TCP reset, a UDP port unreachable).
	Refusing bool `json:"refusing,omitempty"`
	// Scheduler picks among the endpoints: rr, lc, sh or random.
	Scheduler string `json:"scheduler,omitempty"`
	// TrafficDistribution is the Service's; Topology the hints in use for
	// this listener (PreferSameNode, PreferSameZone, or none), for Zone.
	TrafficDistribution string   `json:"trafficDistribution,omitempty"`
	Topology            string   `json:"topology,omitempty"`
	Zone                string   `json:"zone,omitempty"`
	HealthCheckNodePort int      `json:"healthCheckNodePort,omitempty"`
	SourceRanges        []string `json:"loadBalancerSourceRanges,omitempty"`
	// Health is the state of the endpoints this listener picks from:
	// failures in a row, ejection, drain, connections open.
	Health []proxy.EndpointHealth `json:"endpointHealth,omitempty"`
}

// services maps each service port to its listener, addresses, endpoints
// (with their conditions) and affinity table.
// pageOf reads ?limit=N (default 1000) and ?offset=M, or answers 400.
func pageOf(w http.ResponseWriter, r *http.Request) (limit, offset int, ok bool) {
	limit = 1000
	for _, q := range []struct {
		name string
		v    *int
	}{{"limit", &limit}, {"offset", &offset}} {
		if s := r.URL.Query().Get(q.name); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n < 0 {
				http.Error(w, q.name+": want a number ≥ 0", http.StatusBadRequest)
				return 0, 0, false
			}
			*q.v = n
		}
	}
	return limit, offset, true
}

// services is every listener with its Service port, endpoints and their
// health: JSON, or ?format=text. ?limit=N (default 1000) and ?offset=M page
// it; X-Total-Count says how many there are (at 10 000 service ports the
// whole list is ~13 MB of JSON, and building it doubled the daemon's RSS).
func (d *debugServer) services(w http.ResponseWriter, r *http.Request) {
	limit, offset, ok := pageOf(w, r)
	if !ok {
		return
	}
	page, total := d.p.StatusPage(offset, limit)
	w.Header().Set("X-Total-Count", strconv.Itoa(total))
	out := make([]serviceView, 0, len(page))
	for _, fe := range page {
		out = append(out, newServiceView(fe))
	}
	if !wantsText(r) {
		writeJSON(w, out)
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	for _, v := range out {
		v.writeText(w)
	}
	if len(out) < total {
		fmt.Fprintf(w, "(%d of %d listeners from offset %d: ?limit= and ?offset= show others)\n", len(out), total, offset)
	}
}

// newServiceView is the view of one frontend's status.
func newServiceView(fe proxy.FrontendStatus) serviceView {
	sp := fe.Service
	v := serviceView{Service: sp.Name.String(), Kind: fe.Kind, Family: fe.Family, Protocol: string(fe.Protocol),
		Port: sp.Port, NodePort: sp.NodePort, Pins: fe.Affinities, Health: fe.EndpointHealth,
		Scheduler: fe.Scheduler}
	if fe.Err != nil {
		v.Error = fe.Err.Error()
	} else {
		v.Listen = fe.Listen.String()
	}
	v.Refusing = fe.Refusing
	if fe.NodePortErr != nil {
		v.NodePortErr = fe.NodePortErr.Error()
	}
	for _, ip := range sp.ClusterIPs {
		v.ClusterIPs = append(v.ClusterIPs, ip.String())
	}
	for _, ip := range sp.ExternalIPs {
		v.ExternalIPs = append(v.ExternalIPs, ip.String())
	}
	for _, ip := range sp.LoadBalancerIPs {
		v.LBIPs = append(v.LBIPs, ip.String())
	}
	v.Endpoints = []endpointView{}
	for _, ep := range sp.Endpoints {
		text := ep.String()
		if ep.NodeName != "" {
			text += " node=" + ep.NodeName
		}
		if ep.ZoneHints != "" || ep.NodeHints != "" {
			text += " hints=" + strings.Trim(ep.ZoneHints+"/"+ep.NodeHints, "/")
		}
		v.Endpoints = append(v.Endpoints, endpointView{Address: ep.Addr.String(), Ready: ep.Ready, Serving: ep.Serving,
			Terminating: ep.Terminating, Node: ep.NodeName, ZoneHints: ep.ZoneHints, NodeHints: ep.NodeHints, text: text})
	}
	if sp.AffinityTimeout > 0 {
		v.Affinity = sp.AffinityTimeout.String()
	}
	v.TrafficDistribution, v.HealthCheckNodePort = sp.TrafficDistribution, sp.HealthCheckNodePort
	v.Topology, v.Zone = fe.Topology, fe.Zone
	for _, r := range sp.SourceRanges {
		v.SourceRanges = append(v.SourceRanges, r.String())
	}
	if fe.Protocol == config.UDP {
		v.UDPFlows = &fe.UDPFlows
	}
	return v
}

// writeText writes v as the text page's lines.
func (v serviceView) writeText(w io.Writer) {
	fmt.Fprintf(w, "%s %s (IPv%d, %s) listen %s port %d", v.Service, v.Protocol, v.Family, v.Kind, v.Listen, v.Port)
	if v.NodePort != 0 {
		fmt.Fprintf(w, " nodePort %d", v.NodePort)
	}
	fmt.Fprintf(w, "\n  addresses: %s\n", strings.Join(append(append(append([]string(nil), v.ClusterIPs...), v.ExternalIPs...), v.LBIPs...), " "))
	for _, e := range []string{v.Error, v.NodePortErr} {
		if e != "" {
			fmt.Fprintf(w, "  ERROR: %s\n", e)
		}
	}
	texts := make([]string, len(v.Endpoints))
	for i, e := range v.Endpoints {
		texts[i] = e.text
	}
	fmt.Fprintf(w, "  endpoints: %s\n", strings.Join(texts, " "))
	if v.Refusing {
		fmt.Fprintf(w, "  refusing: no endpoint can serve; connections are refused at connect\n")
	}
	if v.Scheduler != "" {
		fmt.Fprintf(w, "  scheduler: %s\n", v.Scheduler)
	}
	if v.Topology != "" || v.TrafficDistribution != "" {
		mode := v.Topology
		if mode == "" {
			mode = "none used (every endpoint counts)"
		}
		fmt.Fprintf(w, "  topology: trafficDistribution %q, hints %s, zone %q\n", v.TrafficDistribution, mode, v.Zone)
	}
	if v.HealthCheckNodePort != 0 {
		fmt.Fprintf(w, "  healthCheckNodePort: %d\n", v.HealthCheckNodePort)
	}
	if len(v.SourceRanges) > 0 {
		fmt.Fprintf(w, "  loadBalancerSourceRanges: %s\n", strings.Join(v.SourceRanges, " "))
	}
	for _, h := range v.Health {
		var notes []string
		if h.EjectedUntil != nil {
			notes = append(notes, fmt.Sprintf("EJECTED until %s (ejection %d in a row)", h.EjectedUntil.Format(time.RFC3339), h.Ejections))
		} else if h.Failures > 0 {
			notes = append(notes, fmt.Sprintf("%d failure(s) in a row", h.Failures))
		}
		if h.Drained {
			notes = append(notes, "DRAINED")
		}
		if len(notes) > 0 || h.Active > 0 {
			fmt.Fprintf(w, "    %s %d open %s\n", h.Endpoint, h.Active, strings.Join(notes, ", "))
		}
	}
	if v.Affinity != "" {
		fmt.Fprintf(w, "  affinity: ClientIP for %s\n", v.Affinity)
		for _, pin := range v.Pins {
			fmt.Fprintf(w, "    %s -> %s until %s\n", pin.Client, pin.Endpoint, pin.Expires.Format(time.RFC3339))
		}
	}
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

// largeAnswerRules is the rule count from which an answer's garbage (~1 KiB
// a rule: iptables-save's output, its parse, the JSON) is collected and
// handed back to the kernel at once.
const largeAnswerRules = 2000

// releaseAfterLargeAnswer collects the garbage of an answer about rules
// rules and returns it to the kernel, when they are many. At 10 000 service
// ports one answer made ~12 MB that the heap kept (the runtime gives memory
// back only above its heap goal, twice the live heap): the live page's
// periodic read of the rules raised the daemon's RSS by 15 % for good. A
// forced collection there costs ~20 ms of CPU; the live page asks every
// 10 s, and concurrent readers share one answer a second.
func releaseAfterLargeAnswer(rules int) {
	if rules >= largeAnswerRules {
		debug.FreeOSMemory()
	}
}

// startHTTP serves h on addr until ctx ends. A bind error is returned at
// once with hardFail (kube-proxy's bindAddressHardFail); otherwise it is
// logged and the bind retried every retry until it succeeds, as
// kube-proxy does, so that a daemon started beside a running one takes
// the address over once the other is gone.
func startHTTP(ctx context.Context, addr string, h http.Handler, limits serverLimits, hardFail bool, retry time.Duration, log logrus.FieldLogger) (<-chan struct{}, error) {
	done := make(chan struct{})
	if addr == "" {
		close(done)
		return done, nil
	}
	ln, err := net.Listen("tcp", addr)
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
		log.WithField("address", ln.Addr().String()).Info("Serving HTTP")
		if err := srv.Serve(limits.listener(ln)); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.WithError(err).Error("HTTP server failed")
		}
	}()
	return done, nil
}

// newRegistry holds every metric the daemon exports.
func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		healthzTotal, livezTotal, buildInfo())
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
