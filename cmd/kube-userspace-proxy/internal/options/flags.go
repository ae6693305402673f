package options

import (
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/clientaddr"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
)

// ErrHelp is Parse's answer to --help, after the usage was written.
var ErrHelp = errors.New("help requested")

// Options are the parsed command line. Flag names follow kube-proxy's.
type Options struct {
	Manifests        string
	Kubeconfig       string
	Master           string
	HostnameOverride string
	BindAddress      netip.Addr
	PortRange        config.PortRange
	UDPTimeout       time.Duration
	UDPMaxFlows      int
	TCPIdleTimeout   time.Duration
	ParkIdleAfter    time.Duration
	Outlier          balance.OutlierConfig
	MinSyncPeriod    time.Duration
	SyncPeriod       time.Duration
	ShutdownGrace    time.Duration
	LogLevel         string
	LogFormat        string
	NodePortCIDRs    []netip.Prefix
	Cleanup          bool
	SysctlsOnly      bool
	AdminSocket      string
	HandoverSocket   string
	ReadyFile        string
	DrainOnMetrics   bool
	ShowRules        bool
	IPTables         bool
	IPTablesBasic    bool
	RestoreCommand   string
	HealthzAddr      string
	MetricsAddr      string
	Profiling        bool
	ConnLog          string
	BackendSource    clientaddr.Mode
	rawBackendSource string
	ConnLogRate      float64
	SchedPolicy      string
	ConfigFile       string
	Conntrack        Conntrack
	OOMScoreAdj      int
	ConfigSync       time.Duration
	API              APISettings
	BindHardFail     bool
	NodePortPrimary  bool // --nodeport-addresses primary: the node's own addresses
	// Local is --detect-local-mode with its values; NodeCIDR's CIDRs come
	// from the Node at start.
	Local        config.LocalTraffic
	ClusterCIDRs []netip.Prefix // --cluster-cidr, as given
	PodBridge    string
	PodIfPrefix  string
	// Families are those with rules and their guard (set at start; nil
	// without --iptables: listeners of both).
	Families []int
	// ConfigWarnings are the --config file's fields that do not apply here,
	// logged once the logger exists.
	ConfigWarnings []string
	// origin names where a flag's value came from, for error messages.
	origin map[string]string
}

// Name returns how to call a setting in an error: --flag, or the config
// file's field when the value came from there.
func (o *Options) Name(flag string) string {
	if n, ok := o.origin[flag]; ok {
		return n
	}
	return "--" + flag
}

// Parse parses the command line, the --config file it names, and checks
// the values against each other.
func Parse(args []string, stderr io.Writer) (*Options, error) {
	o := &Options{origin: map[string]string{}}
	fs := pflag.NewFlagSet("kube-userspace-proxy", pflag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.SortFlags = false
	raw := o.define(fs)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: kube-userspace-proxy --manifests PATH | --kubeconfig PATH [flags]\n\n%s", fs.FlagUsages())
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return nil, ErrHelp
		}
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q (flags only)", fs.Arg(0))
	}
	if o.ConfigFile != "" {
		warnings, err := applyConfigFile(o.ConfigFile, fs, o.origin)
		if err != nil {
			return nil, err
		}
		o.ConfigWarnings = warnings
	}
	if err := o.check(raw); err != nil {
		return nil, err
	}
	return o, nil
}

// apiSettings are the API client's, as kube-proxy's clientConnection.
type APISettings struct {
	QPS                             float32
	Burst                           int32
	ContentType, AcceptContentTypes string
}

// rawFlags are the flags parsed into options by check.
type rawFlags struct {
	bind, portRange string
	nodePortAddrs   []string
	detectLocalMode string
	clusterCIDR     string
	podBridge       string
	podIfPrefix     string
}

// define defines the flags on fs, into o and the returned raw values.
func (o *Options) define(fs *pflag.FlagSet) *rawFlags {
	raw := &rawFlags{}
	fs.StringVar(&o.ConfigFile, "config", "", "A KubeProxyConfiguration YAML file (kube-proxy's fields that apply here, plus this proxy's own); flags override it.")
	fs.StringVar(&o.Manifests, "manifests", "", "Serve the Services and EndpointSlices in this YAML/JSON file or directory (reloaded on change) instead of a cluster.")
	fs.StringVar(&o.Kubeconfig, "kubeconfig", "", "Path to a kubeconfig file for watching a cluster.")
	fs.StringVar(&o.Master, "master", "", "The address of the Kubernetes API server (overrides the kubeconfig).")
	fs.StringVar(&o.HostnameOverride, "hostname-override", "", "The name of this node, for traffic policies (default: $NODE_NAME, else the hostname).")
	fs.StringVar(&raw.bind, "bind-address", "0.0.0.0", "The address the proxy listeners bind to (0.0.0.0: all IPv4 and IPv6 addresses).")
	fs.StringVar(&raw.portRange, "proxy-port-range", "", "Local ports for the listeners that are not on a NodePort, begin-end or begin+offset (default: 45000-59999). The range is added to ip_local_reserved_ports, and new connections to it from other hosts that were not redirected are dropped.")
	fs.DurationVar(&o.UDPTimeout, "udp-timeout", dataplane.DefaultUDPTimeout, "How long an idle UDP flow is kept.")
	fs.IntVar(&o.UDPMaxFlows, "udp-max-flows", dataplane.DefaultUDPMaxFlows, "UDP flows per service port; the least recently used is evicted beyond this.")
	fs.DurationVar(&o.TCPIdleTimeout, "tcp-idle-timeout", 24*time.Hour, "Close a proxied TCP connection after it carried no data either way this long (0: never).")
	fs.DurationVar(&o.ParkIdleAfter, "park-idle-after", dataplane.DefaultParkIdleAfter, "A direction of a proxied TCP connection with nothing to read for this long gives up its goroutine and waits in an epoll set (an idle connection then costs ~2-3 KiB instead of ~8; waking costs microseconds). 0: never.")
	fs.IntVar(&o.Outlier.ConsecutiveFailures, "outlier-consecutive-failures", balance.DefaultOutlier.ConsecutiveFailures, "Failed dials (or UDP ICMP errors) in a row that eject an endpoint from new connections for a while (0: never eject). A Service opts out with the annotation kube-userspace-proxy.io/outlier-detection: \"off\".")
	fs.DurationVar(&o.Outlier.BaseEjectionTime, "outlier-base-ejection-time", balance.DefaultOutlier.BaseEjectionTime, "How long an endpoint's first ejection lasts; the nth in a row lasts n times as long. When it ends, the next connection is the probe.")
	fs.DurationVar(&o.Outlier.MaxEjectionTime, "outlier-max-ejection-time", balance.DefaultOutlier.MaxEjectionTime, "The longest ejection.")
	fs.DurationVar(&o.MinSyncPeriod, "min-sync-period", time.Second, "The minimum interval between syncs of listeners and rules under churn (changes meanwhile merge into one sync); a lone change, or two in a row such as a Service and its EndpointSlice, is synced at once.")
	fs.DurationVar(&o.SyncPeriod, "sync-period", 30*time.Second, "How often rules are checked and repaired even without changes.")
	fs.DurationVar(&o.ShutdownGrace, "shutdown-grace", 5*time.Second, "On SIGTERM, how long open connections may drain before they are closed.")
	fs.StringVar(&raw.detectLocalMode, "detect-local-mode", "ClusterCIDR", "As kube-proxy's: how this node's pods are told from other clients — ClusterCIDR (--cluster-cidr), NodeCIDR (the Node's spec.podCIDRs), BridgeInterface (--pod-bridge-interface) or InterfaceNamePrefix (--pod-interface-name-prefix). The node and its pods reach the external addresses of an externalTrafficPolicy: Local Service with every endpoint; other clients with this node's only.")
	fs.StringVar(&raw.clusterCIDR, "cluster-cidr", "", "As kube-proxy's: the pods' CIDR range(s) in the cluster, one per IP family, comma-separated (for --detect-local-mode ClusterCIDR; none: only the node's own traffic counts as local).")
	fs.StringVar(&raw.podBridge, "pod-bridge-interface", "", "As kube-proxy's: the bridge this node's pods are on (for --detect-local-mode BridgeInterface).")
	fs.StringVar(&raw.podIfPrefix, "pod-interface-name-prefix", "", "As kube-proxy's: the name prefix of this node's pods' interfaces (for --detect-local-mode InterfaceNamePrefix).")
	fs.StringSliceVar(&raw.nodePortAddrs, "nodeport-addresses", nil, "Serve NodePorts only on node addresses inside these CIDRs (comma-separated), or on the node's primary addresses (primary: the Node's InternalIPs, with --manifests the addresses of the default routes); default: every local address.")
	fs.IntVar(&o.Conntrack.MaxPerCore, "conntrack-max-per-core", 32768, "As kube-proxy's: conntrack entries per CPU for nf_conntrack_max (raised, never lowered; host-wide, so only from the host's network namespace). 0 leaves the limit alone.")
	fs.IntVar(&o.Conntrack.Min, "conntrack-min", 131072, "As kube-proxy's: the least nf_conntrack_max, whatever the CPUs.")
	fs.DurationVar(
		&o.Conntrack.TCPEstablished,
		"conntrack-tcp-timeout-established",
		24*time.Hour,
		"As kube-proxy's: nf_conntrack_tcp_timeout_established (0: leave as is).",
	)
	fs.DurationVar(
		&o.Conntrack.TCPCloseWait,
		"conntrack-tcp-timeout-close-wait",
		time.Hour,
		"As kube-proxy's: nf_conntrack_tcp_timeout_close_wait (0: leave as is).",
	)
	fs.BoolVar(
		&o.Conntrack.TCPBeLiberal,
		"conntrack-tcp-be-liberal",
		false,
		"As kube-proxy's: set nf_conntrack_tcp_be_liberal (out-of-window packets are not marked INVALID).",
	)
	fs.DurationVar(&o.Conntrack.UDPTimeout, "conntrack-udp-timeout", 0, "As kube-proxy's: nf_conntrack_udp_timeout (0: leave as is).")
	fs.DurationVar(&o.Conntrack.UDPStream, "conntrack-udp-timeout-stream", 0, "As kube-proxy's: nf_conntrack_udp_timeout_stream (0: leave as is).")
	fs.IntVar(&o.OOMScoreAdj, "oom-score-adj", -999, "As kube-proxy's: the daemon's oom_score_adj, in [-1000, 1000] (lowering it needs CAP_SYS_RESOURCE: a warning when refused).")
	fs.DurationVar(&o.ConfigSync, "config-sync-period", 15*time.Minute, "As kube-proxy's: how often the informers re-deliver what they hold (an unchanged object costs nothing; 0: never).")
	fs.Float32Var(&o.API.QPS, "kube-api-qps", 5, "As kube-proxy's: queries per second to the API server.")
	fs.Int32Var(&o.API.Burst, "kube-api-burst", 10, "As kube-proxy's: the burst of queries to the API server.")
	fs.StringVar(
		&o.API.ContentType,
		"kube-api-content-type",
		"application/vnd.kubernetes.protobuf",
		"As kube-proxy's: the content type of requests to the API server.",
	)
	fs.StringVar(
		&o.API.AcceptContentTypes,
		"kube-api-accept-content-types",
		"application/vnd.kubernetes.protobuf,application/json",
		"The content types accepted from the API server (clientConnection.acceptContentTypes).",
	)
	fs.BoolVar(
		&o.BindHardFail,
		"bind-address-hard-fail",
		false,
		"As kube-proxy's: exit when the healthz or metrics address cannot be bound; otherwise log it and retry every 5 s (a daemon started beside a running one then serves them once it is gone).",
	)
	fs.BoolVar(
		&o.SysctlsOnly,
		"sysctls-only",
		false,
		"Set the node's settings the daemon needs (the proxy port range in ip_local_reserved_ports, the conntrack sysctls) and exit: for a privileged init container, so that the daemon itself runs unprivileged (docs/deploy).",
	)
	fs.BoolVar(&o.Cleanup, "cleanup", false, "Remove every iptables rule and chain the proxy installs (IPv4 and IPv6), then exit.")
	fs.BoolVar(&o.ShowRules, "show-rules", false, "Print the iptables-restore input the proxy would install for --manifests (proxy ports as placeholders) and exit; needs no root and changes nothing.")
	fs.BoolVar(&o.IPTables, "iptables", true, "Program iptables rules. With false only the listeners run (connect to them directly).")
	fs.BoolVar(&o.IPTablesBasic, "iptables-basic-only", false, "Use only basic netfilter (no comment, addrtype or conntrack matches) even where the kernel has more.")
	_ = fs.MarkHidden("iptables-basic-only") // for tests of kernels without netfilter extras
	fs.StringVar(&o.RestoreCommand, "iptables-restore-command", "", "The iptables-restore binary for IPv4 (default: iptables-restore from PATH).")
	_ = fs.MarkHidden("iptables-restore-command") // tests inject failures with it
	fs.StringVar(&o.HealthzAddr, "healthz-bind-address", "0.0.0.0:10256", "Where /healthz and /livez are served (empty: off).")
	fs.StringVar(&o.MetricsAddr, "metrics-bind-address", "127.0.0.1:10249", "Where /metrics and /debug/... are served (empty: off). The debug pages show client addresses: keep it on localhost.")
	fs.StringVar(&o.AdminSocket, "admin-socket", "/run/kube-userspace-proxy/admin.sock", "The unix socket for what changes the daemon's state (/debug/drain): its folder root-only, its peers checked (SO_PEERCRED). Empty: none.")
	fs.StringVar(&o.HandoverSocket, "handover-socket", "/run/kube-userspace-proxy/handover.sock", "The unix socket through which a daemon started beside a running one takes its listeners over, so that an upgrade or restart refuses no connection (docs/operations.md, Upgrades): its folder root-only, its peers checked (SO_PEERCRED). Empty: no handover, each start binds anew.")
	fs.StringVar(&o.ReadyFile, "ready-file", "", "A file that exists while this daemon serves: after its first sync and, when it took over from a running daemon, once that one let go; removed when it hands over or stops. For an exec readiness probe (the HTTP health port is shared by both daemons of a handover). Empty: none.")
	fs.BoolVar(&o.DrainOnMetrics, "drain-on-metrics-address", false, "Also serve /debug/drain on the metrics address, as before the admin socket: any local process (and any hostNetwork pod) that reaches that address can then drain endpoints.")
	fs.BoolVar(&o.Profiling, "profiling", false, "Serve /debug/pprof on the metrics address.")
	fs.StringVar(&o.rawBackendSource, "backend-source-address", "auto", "Whose address backends see: auto (the client's own where kube-proxy keeps it — a pod of this node or the node itself calling a ClusterIP, any client of an externalTrafficPolicy: Local Service — and the node's elsewhere, as kube-proxy's masquerade) or node (always the node's, as the classic userspace proxy). A Service opts out with the annotation kube-userspace-proxy.io/backend-source-address: \"node\".")
	fs.StringVar(&o.ConnLog, "connection-log", "errors", "Per-connection log lines (info level): errors (resets, failed dials, TCP idle timeouts...), all, or none.")
	fs.Float64Var(&o.ConnLogRate, "connection-log-rate", dataplane.DefaultConnLogRate, "The most connection log lines per second (twice as many in a burst); those over it are counted and the count logged. 0: no limit (with --connection-log all on a busy node, raise it or expect counts).")
	fs.StringVar(&o.SchedPolicy, "scheduling-policy", "normal", "CPU scheduling of the daemon's threads: normal, or batch (SCHED_BATCH: a wake-up does not preempt a running task; on a busy machine data is moved in bigger pieces, at the price of latency up to a time slice; see docs/operations.md).")
	fs.StringVar(&o.LogLevel, "log-level", "info", "Log level: panic, fatal, error, warn, info, debug or trace (the connection lines of --connection-log are info).")
	fs.StringVar(&o.LogFormat, "log-format", "text", "Log format: text or json.")
	return raw
}

// check parses raw into o and checks the flags against each other.
func (o *Options) check(raw *rawFlags) error {
	var err error
	if o.BindAddress, err = netip.ParseAddr(raw.bind); err != nil {
		return fmt.Errorf("%s: %q is not an IP address", o.Name("bind-address"), raw.bind)
	}
	if o.PortRange, err = config.ParsePortRange(raw.portRange); err != nil {
		return fmt.Errorf("%s: %w", o.Name("proxy-port-range"), err)
	}
	if o.PortRange.Size == 0 { // "", "0" and "0-0", kube-proxy's "pick any"
		o.PortRange = config.DefaultPortRange
	}
	for _, d := range []struct {
		flag string
		v    time.Duration
		min  time.Duration
	}{
		{"udp-timeout", o.UDPTimeout, time.Millisecond},
		{"min-sync-period", o.MinSyncPeriod, 0},
		{"sync-period", o.SyncPeriod, time.Second},
		{"tcp-idle-timeout", o.TCPIdleTimeout, 0},
		{"park-idle-after", o.ParkIdleAfter, 0},
		{"shutdown-grace", o.ShutdownGrace, 0},
		{"outlier-base-ejection-time", o.Outlier.BaseEjectionTime, time.Millisecond},
		{"outlier-max-ejection-time", o.Outlier.MaxEjectionTime, o.Outlier.BaseEjectionTime},
	} {
		if d.v < d.min {
			return fmt.Errorf("%s: %s is below the minimum %s", o.Name(d.flag), d.v, d.min)
		}
	}
	if o.Outlier.ConsecutiveFailures < 0 {
		return fmt.Errorf("%s: %d must not be negative", o.Name("outlier-consecutive-failures"), o.Outlier.ConsecutiveFailures)
	}
	if o.UDPMaxFlows < 1 {
		return fmt.Errorf("%s: %d must be at least 1", o.Name("udp-max-flows"), o.UDPMaxFlows)
	}
	switch o.ConnLog {
	case "errors", "all", "none":
	default:
		return fmt.Errorf("%s: %q is not errors, all or none", o.Name("connection-log"), o.ConnLog)
	}
	switch o.SchedPolicy {
	case "normal", "batch":
	default:
		return fmt.Errorf("%s: %q is not normal or batch", o.Name("scheduling-policy"), o.SchedPolicy)
	}
	for _, a := range []struct{ flag, v string }{{"healthz-bind-address", o.HealthzAddr}, {"metrics-bind-address", o.MetricsAddr}} {
		if a.v == "" {
			continue
		}
		if _, err := netip.ParseAddrPort(a.v); err != nil {
			return fmt.Errorf("%s: %q is not ip:port", o.Name(a.flag), a.v)
		}
	}
	if reason := o.portRangeConflict(); reason != "" {
		return fmt.Errorf("%s %s overlaps %s: the guard would drop their connections from other hosts; choose a range clear of them", o.Name("proxy-port-range"), o.PortRange, reason)
	}
	if o.OOMScoreAdj < -1000 || o.OOMScoreAdj > 1000 {
		return fmt.Errorf("%s: %d is outside [-1000, 1000]", o.Name("oom-score-adj"), o.OOMScoreAdj)
	}
	if o.ConfigSync < 0 || o.API.QPS < 0 || o.API.Burst < 0 {
		return fmt.Errorf("%s, %s and %s must not be negative", o.Name("config-sync-period"), o.Name("kube-api-qps"), o.Name("kube-api-burst"))
	}
	for _, a := range raw.nodePortAddrs {
		if strings.TrimSpace(a) == "primary" {
			if len(raw.nodePortAddrs) > 1 {
				return fmt.Errorf("%s: primary stands alone (as kube-proxy's), not beside CIDRs", o.Name("nodeport-addresses"))
			}
			o.NodePortPrimary = true
			continue
		}
		pfx, err := netip.ParsePrefix(strings.TrimSpace(a))
		if err != nil {
			return fmt.Errorf("%s: %q is not a CIDR", o.Name("nodeport-addresses"), a)
		}
		o.NodePortCIDRs = append(o.NodePortCIDRs, pfx.Masked())
	}
	if o.BackendSource, err = clientaddr.ParseMode(o.rawBackendSource); err != nil {
		return fmt.Errorf("%s: %w", o.Name("backend-source-address"), err)
	}
	if err := o.checkLocal(raw); err != nil {
		return err
	}
	if o.Cleanup || o.SysctlsOnly {
		return nil
	}
	if o.ShowRules && o.Manifests == "" {
		return errors.New("--show-rules needs --manifests")
	}
	cluster := o.Kubeconfig != "" || o.Master != ""
	switch {
	case o.Manifests != "" && cluster:
		return errors.New("give one source: --manifests PATH, or --kubeconfig/--master for a cluster, not both")
	case o.Manifests == "" && !cluster && os.Getenv("KUBERNETES_SERVICE_HOST") == "":
		return errors.New("no source: give --manifests PATH, or --kubeconfig/--master for a cluster (in a pod the service account is used)")
	}
	return nil
}

// checkLocal reads --detect-local-mode and the flag of its mode, as
// kube-proxy validates them: a mode's own value is required, except
// ClusterCIDR's (without one, only the node's own traffic is local, as
// kube-proxy's no-op detector).
func (o *Options) checkLocal(raw *rawFlags) error {
	mode, err := config.ParseLocalMode(raw.detectLocalMode)
	if err != nil {
		return fmt.Errorf("%s: %w", o.Name("detect-local-mode"), err)
	}
	o.Local = config.LocalTraffic{Mode: mode}
	if o.ClusterCIDRs, err = config.ParseCIDRs(raw.clusterCIDR); err != nil {
		return fmt.Errorf("%s: %w", o.Name("cluster-cidr"), err)
	}
	o.PodBridge, o.PodIfPrefix = raw.podBridge, raw.podIfPrefix
	switch mode {
	case config.LocalModeClusterCIDR:
		o.Local.CIDRs = o.ClusterCIDRs
	case config.LocalModeNodeCIDR:
		// The Node's, at start.
	case config.LocalModeBridgeInterface, config.LocalModeInterfaceNamePrefix:
		flag, field, v := "pod-bridge-interface", "detectLocal.bridgeInterface", raw.podBridge
		if mode == config.LocalModeInterfaceNamePrefix {
			flag, field, v = "pod-interface-name-prefix", "detectLocal.interfaceNamePrefix", raw.podIfPrefix
		}
		if err := checkInterfaceName(v); err != nil {
			name := o.Name(flag)
			if _, fromFile := o.origin[flag]; !fromFile {
				name = "--" + flag + " (" + field + " in --config)"
			}
			return fmt.Errorf("%s %s needs %s: %w", o.Name("detect-local-mode"), mode, name, err)
		}
		o.Local.Interface = v
	}
	return nil
}

// checkInterfaceName refuses what the kernel would not take as an interface
// name (IFNAMSIZ; no slash, blank or colon).
func checkInterfaceName(v string) error {
	switch {
	case v == "":
		return errors.New("it is empty")
	case len(v) > 15:
		return fmt.Errorf("%q is longer than 15 characters", v)
	case strings.ContainsAny(v, "/: \t\n+") || v == "." || v == "..":
		return fmt.Errorf("%q is not an interface name", v)
	}
	return nil
}

// wellKnownNodePorts are servers a node runs whose ports the proxy range
// must keep clear of: the guard drops connections to the range that did
// not come through a redirect.
var wellKnownNodePorts = []struct {
	port int
	what string
}{
	{10250, "the kubelet's API (10250)"}, {10248, "the kubelet's healthz (10248)"}, {10255, "the kubelet's read-only port (10255)"},
	{10257, "kube-controller-manager (10257)"}, {10259, "kube-scheduler (10259)"}, {2379, "etcd (2379)"}, {2380, "etcd's peers (2380)"},
	{6443, "the API server (6443)"},
}

// portRangeConflict names what the proxy port range overlaps: the
// daemon's own HTTP ports, a node's well-known servers, or the NodePort
// range (kube-apiserver's default 30000-32767, where NodePort listeners
// sit). "" when it is clear.
func (o *Options) portRangeConflict() string {
	r := o.PortRange
	in := func(p int) bool { return p >= r.Base && p < r.Base+r.Size }
	for _, a := range []struct{ flag, v string }{{"healthz-bind-address", o.HealthzAddr}, {"metrics-bind-address", o.MetricsAddr}} {
		if ap, err := netip.ParseAddrPort(a.v); err == nil && in(int(ap.Port())) {
			return fmt.Sprintf("this daemon's own %s (%d)", o.Name(a.flag), ap.Port())
		}
	}
	for _, w := range wellKnownNodePorts {
		if in(w.port) {
			return w.what
		}
	}
	if r.Base <= 32767 && r.Base+r.Size-1 >= 30000 {
		return "the NodePort range (30000-32767)"
	}
	return ""
}

// NodeName is --hostname-override, else $NODE_NAME, else the hostname.
func (o *Options) NodeName() string {
	if o.HostnameOverride != "" {
		return strings.ToLower(strings.TrimSpace(o.HostnameOverride))
	}
	if n := os.Getenv("NODE_NAME"); n != "" {
		return strings.ToLower(strings.TrimSpace(n))
	}
	h, _ := os.Hostname()
	return strings.ToLower(h)
}
