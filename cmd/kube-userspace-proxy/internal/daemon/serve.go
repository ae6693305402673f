package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/internal/options"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/healthcheck"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/ports"
)

// Exit codes of the command: 1 for a failure at run time, 2 for bad flags
// or values.
const (
	ExitFailure = 1
	ExitUsage   = 2
)

// UsageError marks an error caused by the command line or its files, which
// exits with ExitUsage.
type UsageError struct{ Err error }

func (e UsageError) Error() string { return e.Err.Error() }
func (e UsageError) Unwrap() error { return e.Err }

// connLogRate maps --connection-log-rate (0: no limit) to proxy.Config's.
func connLogRate(flag float64) float64 {
	if flag <= 0 {
		return -1
	}
	return flag
}

// guardTimeout bounds the guard's installation at start (a held xtables
// lock is waited for that long).
const guardTimeout = 60 * time.Second

// httpBindRetry is kube-proxy's pause between binds of its HTTP addresses.
const httpBindRetry = 5 * time.Second

// Serve runs the daemon of o until ctx ends; an error it returns is the
// daemon's verdict on its run (a UsageError: on its command line).
func Serve(ctx context.Context, o *options.Options, log *logrus.Logger, stdout io.Writer) error {
	keepCrashOutput(log) // a panic from here on is named in the keeper's log
	node := o.NodeName()
	switch {
	case o.Cleanup:
		return cleanup(o, log)
	case o.SysctlsOnly:
		return setSysctls(o, log)
	case o.ShowRules:
		return showRules(o, node, stdout)
	}
	var (
		gc                 *gcTuner
		manifests          *config.ManifestSource
		client             kubernetes.Interface
		report             = &config.KernelReport{}
		rules              proxy.Rules
		ipt                *iptables.Rules
		profile            handover.Profile
		keeper             *handover.KeeperLink
		pred               *predecessor
		handoverSocket     string
		events             func(svc config.ServiceName, reason, message string)
		hc                 *healthcheck.Server
		guard              bool // the daemon guards the proxy ports itself
		p                  *proxy.Proxier
		health, metrics    *httpServing
		stopHTTP           context.CancelFunc
		ready              = readyFile{path: o.ReadyFile, log: log}
		proxierDone        = make(chan struct{})
		stopProxier        context.CancelFunc
		proxierCtx         context.Context
		srcCtx, stopSource = context.WithCancel(ctx)
	)
	defer stopSource()
	run := group{log: log, members: []member{
		{"garbage collection tuner", func() (func(), error) {
			gcCtx, stopGC := context.WithCancel(ctx)
			var gcDone <-chan struct{}
			gc, gcDone = tuneGC(gcCtx, log, gcTunePeriod)
			return func() { stopGC(); <-gcDone }, nil
		}},
		{"inputs", func() (_ func(), err error) {
			manifests, client, err = checkInputs(ctx, o, node, log)
			return nil, err
		}},
		{"process", func() (func(), error) {
			setUpProcess(o, log)
			if crashHooks != nil {
				crashHooks(log)
			}
			return nil, nil
		}},
		{"rules", func() (_ func(), err error) {
			rules, ipt, err = newRules(o, report, log)
			return nil, err
		}},
		// Everything is checked: take the sockets of a daemon that runs,
		// if it serves the node as this one would; else leave it alone,
		// and the node untouched.
		{"predecessor", func() (_ func(), err error) {
			profile = handoverProfile(o, node, ipt)
			keeper = keeperLink(log)
			pred, handoverSocket, err = takeOver(ctx, o.HandoverSocket, profile, log.WithField("component", "handover"))
			return pred.close, err
		}},
		{"node", func() (func(), error) { return nil, prepareNode(o, ipt, report, log) }},
		{"events", func() (func(), error) {
			var stopEvents func()
			events, stopEvents = eventRecorder(ctx, client, node)
			return stopEvents, nil
		}},
		{"proxier", func() (func(), error) {
			hc = &healthcheck.Server{Log: log.WithField("component", "healthcheck")}
			if len(o.NodePortCIDRs) > 0 {
				hc.Addrs = append(iptables.LocalAddrs(4, o.NodePortCIDRs), iptables.LocalAddrs(6, o.NodePortCIDRs)...)
			}
			guard = guardAtAccept(ipt, o.Families)
			probeConntrackNetlink(o, ipt, guard, report)
			p = newProxier(o, rules, hc, events, keeper, guard, report, log)
			pred.inherit(ctx, p)
			gc.whenQuiet(func() bool { return p.Quiet(gcQuietFor) })
			hc.Healthy = func() bool { return proxyHealthy(p.Health(), o.SyncPeriod, time.Now()) }
			return nil, nil
		}},
		{"HTTP", func() (func(), error) {
			var httpCtx context.Context
			httpCtx, stopHTTP = context.WithCancel(context.Background())
			var err error
			health, err = startHTTP(
				httpCtx,
				o.HealthzAddr,
				pred.listener(httpHealthz, o.HealthzAddr),
				healthMux(p, o.SyncPeriod),
				healthLimits,
				o.BindHardFail,
				httpBindRetry,
				log.WithField("component", "healthz"),
			)
			if err != nil {
				stopHTTP()
				return nil, err
			}
			recent := newRecentLog(200)
			log.AddHook(recent)
			dbg := &debugServer{p: p, rules: ipt, node: node, log: recent, conf: o.Configz(node),
				health: healthHandler(p, o.SyncPeriod, true, true), audit: log.WithField("component", "debug"),
				drainOnMetrics: o.DrainOnMetrics, adminSocket: o.AdminSocket, guardTCP: guard, guardUDP: guard && !lacks(report, config.PieceConntrackNL)}
			metrics, err = startHTTP(
				httpCtx,
				o.MetricsAddr,
				pred.listener(httpMetrics, o.MetricsAddr),
				dbg.routes(newRegistry(), o.Profiling),
				metricsLimits,
				o.BindHardFail,
				httpBindRetry,
				log.WithField("component", "metrics"),
			)
			if err != nil {
				stopHTTP()
				<-health.done
				return nil, err
			}
			adminDone := startAdmin(httpCtx, o.AdminSocket, dbg, log)
			return func() { stopHTTP(); <-health.done; <-metrics.done; <-adminDone }, nil
		}},
		{"readiness file", func() (func(), error) { return func() { ready.set(false) }, nil }},
		// The proxier's sync goroutine starts before the source: a source
		// hands it the first State only once it has the whole picture. It
		// stops only once a handover under way has moved the connections
		// (the handovers stop first).
		{"sync goroutine", func() (func(), error) {
			proxierCtx, stopProxier = context.WithCancel(context.WithoutCancel(ctx))
			go func() { defer close(proxierDone); p.Run(proxierCtx, o.ShutdownGrace) }()
			return func() {
				stopProxier()
				<-proxierDone // after the connections drained
				hc.Close()    // the sync goroutine fed it: after that is done
			}, nil
		}},
		{"keeper heartbeat", func() (func(), error) {
			if keeper == nil {
				return nil, nil
			}
			beating := make(chan struct{})
			go func() { defer close(beating); heartbeat(proxierCtx, p, keeper, log.WithField("component", "keeper")) }()
			return func() { stopProxier(); <-beating }, nil
		}},
		{"source", func() (func(), error) {
			watching, err := startSource(srcCtx, manifests, node, client, p, o.MinSyncPeriod, o.ConfigSync, events, log)
			if err != nil {
				return nil, err
			}
			return func() { stopSource(); <-watching }, nil
		}},
		// A stop during a handover's transfer of connections lets the
		// transfer end (bounded) before the proxier drains and closes what
		// is left: a rollout stops the old pod once the new one is ready,
		// mid-transfer.
		{"handovers", func() (func(), error) {
			logStarted(log.WithFields(logrus.Fields{"node": node, "manifests": o.Manifests, "kubeconfig": o.Kubeconfig, "master": o.Master}), report)
			g := &giver{p: p, http: map[string]*httpServing{httpHealthz: health, httpMetrics: metrics},
				addrs: map[string]string{httpHealthz: o.HealthzAddr, httpMetrics: o.MetricsAddr}, stopHTTP: stopHTTP,
				ready: ready, keeper: keeper, log: log.WithField("component", "handover")}
			handoversDone := serveHandovers(srcCtx, handoverSocket, profile, pred, p, g, log.WithField("component", "handover"))
			return func() { stopSource(); <-handoversDone }, nil
		}},
	}}
	if err := run.start(); err != nil {
		return err
	}
	select {
	case <-ctx.Done():
	case <-proxierDone: // it ended by itself
	}
	run.stop()
	log.Info("Stopped")
	return nil
}

// setSysctls sets what a daemon without privilege cannot (--sysctls-only):
// /proc/sys is read-only in an unprivileged container. The daemon then
// finds them set and writes nothing. A refusal here is an error: this
// container exists to make these settings.
func setSysctls(o *options.Options, log *logrus.Logger) error {
	if _, err := ports.Reserve(o.PortRange); err != nil {
		return fmt.Errorf("reserving the proxy port range %s in net.ipv4.ip_local_reserved_ports: %w", o.PortRange, err)
	}
	log.WithField("range", o.PortRange.String()).Info("Proxy port range reserved (net.ipv4.ip_local_reserved_ports)")
	applyConntrack(o.Conntrack, log.WithField("component", "conntrack"), nil)
	return nil
}

// cleanup removes what the daemon put on the node (--cleanup).
func cleanup(o *options.Options, log *logrus.Logger) error {
	err := iptables.Cleanup(log)
	if changed, rerr := ports.Unreserve(o.PortRange); rerr != nil {
		log.WithError(rerr).Warn("Cannot take the proxy port range out of ip_local_reserved_ports")
	} else if changed {
		log.WithField("range", o.PortRange.String()).Info("Proxy port range no longer reserved (net.ipv4.ip_local_reserved_ports)")
	}
	return err
}

// checkInputs fails on bad input before the kernel is touched: the bind
// address, the source, the node's addresses and the local-traffic
// detection.
func checkInputs(ctx context.Context, o *options.Options, node string, log *logrus.Logger) (*config.ManifestSource, kubernetes.Interface, error) {
	if err := checkLocal(o.BindAddress); err != nil {
		return nil, nil, UsageError{fmt.Errorf("%s: %w", o.Name("bind-address"), err)}
	}
	for _, w := range o.ConfigWarnings {
		log.Warn(w)
	}
	manifests, client, err := checkSource(o, node, log)
	if err != nil {
		return nil, nil, err
	}
	if o.NodePortPrimary {
		if o.NodePortCIDRs, err = primaryAddrs(ctx, client, node, 30*time.Second); err != nil {
			return nil, nil, err
		}
		log.WithField("addresses", fmt.Sprint(o.NodePortCIDRs)).Info("NodePorts on the node's primary addresses")
	}
	if err := resolveLocal(ctx, o, client, node, log); err != nil {
		return nil, nil, err
	}
	return manifests, client, nil
}

// startAdmin serves the admin socket; the channel closes once it stopped
// (at once without one). Without it the daemon still serves; only drains
// are unavailable.
func startAdmin(ctx context.Context, path string, dbg *debugServer, log *logrus.Logger) <-chan struct{} {
	if path != "" {
		ln, err := listenAdmin(path)
		if err == nil {
			return serveAdmin(ctx, ln, dbg.adminRoutes(), log.WithField("component", "admin"))
		}
		log.WithError(err).Warn("No admin socket: drains cannot be made")
	}
	closed := make(chan struct{})
	close(closed)
	return closed
}

// checkSource checks the manifests (--manifests) or makes the API client:
// bad input fails here, before the kernel is touched.
func checkSource(o *options.Options, node string, log *logrus.Logger) (*config.ManifestSource, kubernetes.Interface, error) {
	if o.Manifests != "" {
		manifests := &config.ManifestSource{Path: o.Manifests, Node: node, Log: log.WithField("component", "manifests")}
		if err := manifests.Check(); err != nil {
			return nil, nil, fmt.Errorf("loading --manifests: %w", err)
		}
		return manifests, nil, nil
	}
	rc, err := config.ClientConfig(o.Master, o.Kubeconfig)
	var kerr *config.KubeconfigError
	switch {
	case errors.As(err, &kerr):
		return nil, nil, UsageError{fmt.Errorf("loading %s %q: %w", o.Name("kubeconfig"), kerr.Path, kerr.Err)}
	case errors.Is(err, config.ErrNotInCluster):
		return nil, nil, UsageError{fmt.Errorf("no %s or %s, and not running in a pod: %w", o.Name("kubeconfig"), o.Name("master"), err)}
	case err != nil:
		return nil, nil, UsageError{err}
	}
	rc.UserAgent = "kube-userspace-proxy"
	rc.QPS, rc.Burst = o.API.QPS, int(o.API.Burst)
	rc.ContentType, rc.AcceptContentTypes = o.API.ContentType, o.API.AcceptContentTypes
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, nil, UsageError{fmt.Errorf("API client: %w", err)}
	}
	return nil, client, nil
}

// setUpProcess sets the scheduling policy and raises the open-file limit.
func setUpProcess(o *options.Options, log *logrus.Logger) {
	if o.SchedPolicy == "batch" {
		if n, err := kernel.SetBatchScheduling(); err != nil {
			log.WithError(err).Warn("Cannot switch to SCHED_BATCH; running with the normal policy")
		} else {
			log.WithField("threads", n).Info("Scheduling policy batch (SCHED_BATCH)")
		}
	}
	if err := os.WriteFile("/proc/self/oom_score_adj", []byte(strconv.Itoa(o.OOMScoreAdj)), 0o644); err != nil {
		log.WithError(err).WithField("oomScoreAdj", o.OOMScoreAdj).Warn("Cannot set the daemon's oom_score_adj (lowering it needs CAP_SYS_RESOURCE)")
	}
	if limit, err := kernel.RaiseFileLimit(); err != nil {
		log.WithError(err).Warn("Cannot raise the open-file limit")
	} else {
		log.WithField("limit", limit).Debug("Open-file limit")
	}
}

// newRules probes iptables (--iptables), changing nothing on the node, or
// returns no rules.
func newRules(o *options.Options, report *config.KernelReport, log *logrus.Logger) (proxy.Rules, *iptables.Rules, error) {
	if !o.IPTables {
		log.Warn("--iptables=false: no rules are programmed; only the listeners serve")
		return nil, nil, nil
	}
	// The guard covers the whole range with one rule: nobody else's
	// socket may sit in it. Without rules there is no guard, and the
	// node's settings are left alone.
	if ok, err := hasNetAdmin(); err == nil && !ok {
		return nil, nil, fmt.Errorf("programming iptables needs CAP_NET_ADMIN: run as root or grant the capability " +
			"(--iptables=false runs the listeners only)")
	}
	if err := checkEphemeralOverlap(o.PortRange, o.Name("proxy-port-range")); err != nil {
		return nil, nil, err
	}
	r, err := iptables.New(iptables.Config{NodePortAddresses: o.NodePortCIDRs, LocalTraffic: o.Local, BasicOnly: o.IPTablesBasic,
		ProxyPorts: o.PortRange, RestoreCommand: o.RestoreCommand, Kernel: report, Log: log.WithField("component", "iptables")})
	if err != nil {
		return nil, nil, err
	}
	return r, r, nil
}

// prepareNode makes the node ready for the rules r (none without
// --iptables): the guard of the proxy port range, the range reserved,
// kube-proxy's conntrack settings, what could not be done told to report;
// it sets the families served.
func prepareNode(o *options.Options, r *iptables.Rules, report *config.KernelReport, log *logrus.Logger) error {
	if r == nil {
		return nil
	}
	// The guard first: no listener may open before it, nor for a family
	// without it (other hosts would reach ClusterIP-only listeners).
	gctx, cancel := context.WithTimeout(context.Background(), guardTimeout)
	failed := r.InstallGuards(gctx)
	cancel()
	o.Families = nil
	for _, fam := range r.Families() {
		if err, bad := failed[fam]; bad {
			if fam == 4 {
				return fmt.Errorf("installing the guard of the proxy port range: %w", err)
			}
			log.WithError(err).Warn("IPv6 disabled: its guard could not be installed, so no IPv6 listener opens")
			continue
		}
		o.Families = append(o.Families, fam)
	}
	// Only once iptables is known to work: a daemon that cannot start
	// leaves the node's settings alone.
	if changed, err := ports.Reserve(o.PortRange); err != nil {
		report.Lacks(config.PieceReservedPorts, "the proxy port range "+o.PortRange.String()+" is not reserved (net.ipv4.ip_local_reserved_ports): "+
			"outgoing connections of this node may take ports of it, and new connections from other hosts to a socket bound there by port 0 are dropped", err)
	} else {
		report.Present(config.PieceReservedPorts)
		if changed {
			log.WithField("range", o.PortRange.String()).Info("Proxy port range reserved (net.ipv4.ip_local_reserved_ports)")
		}
	}
	// Redirected connections are conntrack entries: kube-proxy's timeouts.
	applyConntrack(o.Conntrack, log.WithField("component", "conntrack"), report)
	return nil
}

// checkEphemeralOverlap refuses a proxy port range that overlaps the
// kernel's ephemeral range where its ports are not reserved and cannot be:
// the node's outgoing connections would take them, and listeners could not
// bind. Checked before the node is touched; where the daemon may write
// ip_local_reserved_ports it reserves the range (newRules) instead.
func checkEphemeralOverlap(r config.PortRange, name string) error {
	if r.Size == 0 {
		return nil // the kernel's own choice: no range of ours
	}
	ephemeral, unreserved, err := ports.UnreservedEphemeral(r)
	if err != nil || !unreserved || ports.CanReserve() {
		return nil
	}
	return fmt.Errorf("%s %s overlaps the kernel's ephemeral port range %s (net.ipv4.ip_local_port_range), its ports there are not in "+
		"net.ipv4.ip_local_reserved_ports, and this daemon cannot write it (a read-only /proc/sys): the node's own outgoing connections "+
		"would take ports from the listeners; reserve the range first (kube-userspace-proxy --sysctls-only in a privileged init container, "+
		"as docs/deploy does) or choose a range outside %s", name, r, ephemeral, ephemeral)
}

// eventRecorder turns a Service's problems (a NodePort another process or
// Service holds, ports it asks for that are not proxied) into Warning
// Events on the Service, where its owner looks; none without an API client.
func eventRecorder(ctx context.Context, client kubernetes.Interface, node string) (events func(svc config.ServiceName, reason, message string), stop func()) {
	if client == nil {
		return nil, func() {}
	}
	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	recorder := broadcaster.NewRecorder(scheme.Scheme, v1.EventSource{Component: "kube-userspace-proxy", Host: node})
	return func(svc config.ServiceName, reason, message string) {
		recorder.Event(&v1.ObjectReference{Kind: "Service", APIVersion: "v1", Namespace: svc.Namespace, Name: svc.Name},
			v1.EventTypeWarning, reason, message)
	}, broadcaster.Shutdown
}

// guardAtAccept says whether the daemon guards the proxy ports itself: a
// family served without the filter table's guard (no conntrack match).
func guardAtAccept(ipt *iptables.Rules, families []int) bool {
	if ipt == nil {
		return false // no rules: the listeners are meant to be reached directly
	}
	for _, fam := range families {
		if !ipt.KernelGuard(fam) {
			return true
		}
	}
	return false
}

// newProxier makes the proxier of the flags.
func newProxier(
	o *options.Options,
	rules proxy.Rules,
	hc *healthcheck.Server,
	events func(svc config.ServiceName, reason, message string),
	keeper *handover.KeeperLink,
	guard bool,
	report *config.KernelReport,
	log *logrus.Logger,
) *proxy.Proxier {
	var portEvents func(sp *config.ServicePort, reason, message string)
	if events != nil {
		portEvents = func(sp *config.ServicePort, reason, message string) { events(sp.Name.Service(), reason, message) }
	}
	return proxy.New(proxy.Config{
		Events:              portEvents,
		ServiceHealth:       hc,
		Rules:               rules,
		Keeper:              socketKeeper(keeper),
		GuardAtAccept:       guard,
		Kernel:              report,
		NodePortsRestricted: len(o.NodePortCIDRs) > 0,
		BindAddress:         o.BindAddress,
		Families:            o.Families,
		PortRange:           o.PortRange,
		TCPIdleTimeout:      o.TCPIdleTimeout,
		ParkIdleAfter:       parkIdleAfter(o.ParkIdleAfter),
		Outlier:             o.Outlier,
		UDPTimeout:          o.UDPTimeout,
		UDPMaxFlows:         o.UDPMaxFlows,
		MinSyncPeriod:       o.MinSyncPeriod,
		SyncPeriod:          o.SyncPeriod,
		Log:                 log.WithField("component", "proxier"),
		ConnLog:             log.WithField("component", "conn"),
		ConnLogMode:         dataplane.ConnLogMode(o.ConnLog),
		ConnLogRate:         connLogRate(o.ConnLogRate),
		BackendSource:       o.BackendSource,
		LocalTraffic:        o.Local,
	})
}

// startSource starts the manifests source (already checked) or the cluster
// source, feeding p.
func startSource(
	ctx context.Context,
	manifests *config.ManifestSource,
	node string,
	client kubernetes.Interface,
	p config.Sink,
	minSyncPeriod, resync time.Duration,
	events func(svc config.ServiceName, reason, message string),
	log *logrus.Logger,
) (<-chan struct{}, error) {
	if manifests != nil {
		manifests.Sink = p
		done, err := manifests.Start(ctx)
		if err != nil {
			return nil, fmt.Errorf("loading --manifests: %w", err)
		}
		return done, nil
	}
	src := &config.ClusterSource{Client: client, Node: node, Sink: p, Log: log.WithField("component", "cluster"),
		BuildInterval: minSyncPeriod / 4, Resync: resync}
	if events != nil {
		src.Unserved = func(svc config.ServiceName, message string) { events(svc, "ProtocolNotProxied", message) }
	}
	return src.Start(ctx)
}

// showRules prints the rules for --manifests as iptables-restore input,
// touching nothing: optional matches are assumed present.
func showRules(o *options.Options, node string, w io.Writer) error {
	st, _, err := config.LoadManifests(o.Manifests, node)
	if err != nil {
		return err
	}
	frontends := proxy.Plan(st, o.BindAddress, len(o.NodePortCIDRs) > 0)
	local := o.Local
	if local.Mode == config.LocalModeNodeCIDR {
		local.CIDRs = st.PodCIDRs
	}
	for _, fam := range []int{4, 6} {
		ro := iptables.RenderOptions{
			Family:       fam,
			Features:     iptables.Features{Comment: true, Addrtype: true, Conntrack: true},
			AllLocal:     len(o.NodePortCIDRs) == 0,
			Placeholders: true,
			ProxyPorts:   o.PortRange,
			LocalTraffic: local,
		}
		if !ro.AllLocal {
			ro.NodePortAddresses = iptables.LocalAddrs(fam, o.NodePortCIDRs)
		}
		bin := map[int]string{4: "iptables-restore", 6: "ip6tables-restore"}[fam]
		fmt.Fprintf(w, "# IPv%d: %s --noflush input for %s (node %s)\n", fam, bin, o.Manifests, node)
		fmt.Fprint(w, iptables.Render(frontends, ro).RestoreInput())
		for _, j := range iptables.JumpRules(ro.Features, fam) {
			fmt.Fprintf(w, "# and, once: %s\n", j)
		}
	}
	return nil
}

func healthMux(p *proxy.Proxier, syncPeriod time.Duration) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/healthz", counted(healthzTotal, healthHandler(p, syncPeriod, true, false)))
	mux.Handle("/livez", counted(livezTotal, healthHandler(p, syncPeriod, false, false)))
	return mux
}

// checkLocal refuses a bind address that no interface of this node has:
// every listener would fail, and the daemon would look alive serving
// nothing. The unspecified addresses bind everywhere.
func checkLocal(a netip.Addr) error {
	if !a.IsValid() || a.IsUnspecified() {
		return nil
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return fmt.Errorf("listing the node's addresses: %w", err)
	}
	for _, ia := range addrs {
		if n, ok := ia.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Unmap() == a.Unmap() {
				return nil
			}
		}
	}
	return fmt.Errorf("%s is not an address of this node (listeners could not bind to it)", a)
}

// capNetAdmin is CAP_NET_ADMIN's bit in the capability sets.
const capNetAdmin = 12

// hasNetAdmin reports whether the process has CAP_NET_ADMIN in its effective
// set (/proc/self/status, CapEff); an error when that cannot be read.
func hasNetAdmin() (bool, error) {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				return false, fmt.Errorf("CapEff %q: %w", v, err)
			}
			return caps&(1<<capNetAdmin) != 0, nil
		}
	}
	return false, errors.New("no CapEff in /proc/self/status")
}

// parkIdleAfter maps the flag (0: never) to proxy.Config's (negative: never).
func parkIdleAfter(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

// The iptables package writes the proxier's rules.
var _ proxy.Rules = (*iptables.Rules)(nil)
