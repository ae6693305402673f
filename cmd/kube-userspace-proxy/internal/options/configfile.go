package options

import (
	"encoding/json"
	"fmt"
	"os"
	"reflect"
	"sort"
	"strings"
	"time"

	"github.com/spf13/pflag"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// fileConfig is the --config file: every field of kube-proxy's
// KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1, v1.37), plus
// this proxy's own. A field that means something here is applied; one of
// kube-proxy's other modes (ipvs:, nftables:, winkernel:, a mode: other
// than userspace) draws a warning naming it. Unknown fields are rejected,
// so a typo never passes silently. As kube-proxy defaults its config, a
// zero value ("", 0s, null) means the default: kubeadm's config.conf,
// which writes every field, starts the daemon unchanged.
type fileConfig struct {
	APIVersion       string          `json:"apiVersion"`
	Kind             string          `json:"kind"`
	FeatureGates     map[string]bool `json:"featureGates,omitempty"`
	ClientConnection *struct {
		Kubeconfig         string   `json:"kubeconfig"`
		AcceptContentTypes string   `json:"acceptContentTypes"`
		ContentType        string   `json:"contentType"`
		QPS                *float32 `json:"qps"`
		Burst              *int32   `json:"burst"`
	} `json:"clientConnection,omitempty"`
	Logging *struct {
		Format         string          `json:"format"`
		Verbosity      *int            `json:"verbosity"`
		FlushFrequency json.RawMessage `json:"flushFrequency"`
		VModule        json.RawMessage `json:"vmodule"`
		Options        json.RawMessage `json:"options"`
	} `json:"logging,omitempty"`
	HostnameOverride            string `json:"hostnameOverride"`
	BindAddress                 string `json:"bindAddress"`
	HealthzBindAddress          string `json:"healthzBindAddress"`
	MetricsBindAddress          string `json:"metricsBindAddress"`
	BindAddressHardFail         *bool  `json:"bindAddressHardFail"`
	EnableProfiling             *bool  `json:"enableProfiling"`
	ShowHiddenMetricsForVersion string `json:"showHiddenMetricsForVersion"`
	Mode                        string `json:"mode"`
	IPTables                    *struct {
		MasqueradeBit      *int32 `json:"masqueradeBit"`
		MasqueradeAll      *bool  `json:"masqueradeAll"`
		LocalhostNodePorts *bool  `json:"localhostNodePorts"`
		SyncPeriod         string `json:"syncPeriod"`
		MinSyncPeriod      string `json:"minSyncPeriod"`
	} `json:"iptables,omitempty"`
	// kube-proxy's other modes: read only to say that they do not apply.
	IPVS            map[string]any `json:"ipvs,omitempty"`
	NFTables        map[string]any `json:"nftables,omitempty"`
	Winkernel       map[string]any `json:"winkernel,omitempty"`
	DetectLocalMode string         `json:"detectLocalMode"`
	DetectLocal     *struct {
		BridgeInterface     string `json:"bridgeInterface"`
		InterfaceNamePrefix string `json:"interfaceNamePrefix"`
	} `json:"detectLocal,omitempty"`
	ClusterCIDR       string   `json:"clusterCIDR"`
	NodePortAddresses []string `json:"nodePortAddresses"`
	OOMScoreAdj       *int32   `json:"oomScoreAdj"`
	Conntrack         *struct {
		MaxPerCore            *int    `json:"maxPerCore"`
		Min                   *int    `json:"min"`
		TCPEstablishedTimeout *string `json:"tcpEstablishedTimeout"`
		TCPCloseWaitTimeout   *string `json:"tcpCloseWaitTimeout"`
		TCPBeLiberal          *bool   `json:"tcpBeLiberal"`
		UDPTimeout            string  `json:"udpTimeout"`
		UDPStreamTimeout      string  `json:"udpStreamTimeout"`
	} `json:"conntrack,omitempty"`
	ConfigSyncPeriod    string `json:"configSyncPeriod"`
	PortRange           string `json:"portRange"`
	WindowsRunAsService *bool  `json:"windowsRunAsService,omitempty"`
	// Older kube-proxy configs kept the periods at the top, and the
	// userspace mode's udpIdleTimeout.
	SyncPeriod     string `json:"syncPeriod,omitempty"`
	MinSyncPeriod  string `json:"minSyncPeriod,omitempty"`
	UDPIdleTimeout string `json:"udpIdleTimeout,omitempty"`

	// This proxy's own.
	Manifests      *string `json:"manifests,omitempty"`
	TCPIdleTimeout *string `json:"tcpIdleTimeout,omitempty"`
	ParkIdleAfter  *string `json:"parkIdleAfter,omitempty"`
	UDPMaxFlows    *int    `json:"udpMaxFlows,omitempty"`
	ShutdownGrace  *string `json:"shutdownGrace,omitempty"`
	// Outlier is --outlier-*.
	Outlier *struct {
		ConsecutiveFailures *int    `json:"consecutiveFailures,omitempty"`
		BaseEjectionTime    *string `json:"baseEjectionTime,omitempty"`
		MaxEjectionTime     *string `json:"maxEjectionTime,omitempty"`
	} `json:"outlierDetection,omitempty"`
	ConnectionLog     *string  `json:"connectionLog,omitempty"`
	BackendSource     *string  `json:"backendSourceAddress,omitempty"`
	ConnectionLogRate *float64 `json:"connectionLogRate,omitempty"`
	// SchedulingPolicy is --scheduling-policy.
	SchedulingPolicy *string `json:"schedulingPolicy,omitempty"`
	LogLevel         *string `json:"logLevel,omitempty"`
	LogFormat        *string `json:"logFormat,omitempty"`
}

// applyConfigFile sets every flag the command line did not set from the
// file and returns what the file asks that does not apply here; errors
// name the file and the field.
func applyConfigFile(path string, fs *pflag.FlagSet, origin map[string]string) ([]string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--config: %w", err)
	}
	var fc fileConfig
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		return nil, fmt.Errorf("--config %s: %w", path, err)
	}
	strictErrs, err := kjson.UnmarshalStrict(js, &fc)
	if err == nil && len(strictErrs) > 0 {
		err = strictErrs[0] // names the field with its path: iptables.masqueradeAl
	}
	if err != nil {
		return nil, fmt.Errorf("--config %s: %s", path, strings.TrimPrefix(err.Error(), "json: "))
	}
	if fc.Kind != "" && fc.Kind != "KubeProxyConfiguration" {
		return nil, fmt.Errorf("--config %s: kind: %q, want KubeProxyConfiguration", path, fc.Kind)
	}
	if fc.APIVersion != "" && fc.APIVersion != "kubeproxy.config.k8s.io/v1alpha1" {
		return nil, fmt.Errorf("--config %s: apiVersion: %q, want kubeproxy.config.k8s.io/v1alpha1", path, fc.APIVersion)
	}
	settings := fc.settings()
	for _, s := range settings {
		if fs.Changed(s.flag) {
			continue // the command line wins
		}
		if err := fs.Set(s.flag, s.value); err != nil {
			return nil, fmt.Errorf("--config %s: %s: %w", path, s.field, err)
		}
		origin[s.flag] = fmt.Sprintf("%s (in --config %s)", s.field, path)
	}
	var warnings []string
	for _, w := range fc.notApplied() {
		warnings = append(warnings, fmt.Sprintf("--config %s: %s", path, w))
	}
	return warnings, nil
}

// setting is a file field that sets a flag.
type setting struct{ field, flag, value string }

// settings lists the fields that are set, as flag values. kube-proxy's
// fields count only when not zero (kube-proxy defaults zero values); this
// proxy's own, and kube-proxy's pointer fields, count when present.
func (fc *fileConfig) settings() []setting {
	var out []setting
	text := func(field, flag, v string) {
		if v != "" {
			out = append(out, setting{field, flag, v})
		}
	}
	dur := func(field, flag, v string) {
		if d, err := time.ParseDuration(v); v == "" || (err == nil && d == 0) {
			return
		}
		text(field, flag, v) // a bad value reaches the flag, whose error names the field
	}
	ptr := func(field, flag string, v any) {
		rv := reflect.ValueOf(v)
		if !rv.IsNil() {
			out = append(out, setting{field, flag, fmt.Sprint(rv.Elem().Interface())})
		}
	}
	if c := fc.ClientConnection; c != nil {
		text("clientConnection.kubeconfig", "kubeconfig", c.Kubeconfig)
		text("clientConnection.contentType", "kube-api-content-type", c.ContentType)
		text("clientConnection.acceptContentTypes", "kube-api-accept-content-types", c.AcceptContentTypes)
		if c.QPS != nil && *c.QPS > 0 {
			text("clientConnection.qps", "kube-api-qps", fmt.Sprint(*c.QPS))
		}
		if c.Burst != nil && *c.Burst > 0 {
			text("clientConnection.burst", "kube-api-burst", fmt.Sprint(*c.Burst))
		}
	}
	if l := fc.Logging; l != nil {
		text("logging.format", "log-format", l.Format)
		if l.Verbosity != nil && *l.Verbosity > 0 {
			text("logging.verbosity", "log-level", logLevelOfVerbosity(*l.Verbosity))
		}
	}
	text("hostnameOverride", "hostname-override", fc.HostnameOverride)
	text("bindAddress", "bind-address", fc.BindAddress)
	text("healthzBindAddress", "healthz-bind-address", fc.HealthzBindAddress)
	text("metricsBindAddress", "metrics-bind-address", fc.MetricsBindAddress)
	ptr("bindAddressHardFail", "bind-address-hard-fail", fc.BindAddressHardFail)
	ptr("enableProfiling", "profiling", fc.EnableProfiling)
	if t := fc.IPTables; t != nil {
		dur("iptables.syncPeriod", "sync-period", t.SyncPeriod)
		dur("iptables.minSyncPeriod", "min-sync-period", t.MinSyncPeriod)
	}
	text("detectLocalMode", "detect-local-mode", fc.DetectLocalMode)
	text("clusterCIDR", "cluster-cidr", fc.ClusterCIDR)
	if d := fc.DetectLocal; d != nil {
		text("detectLocal.bridgeInterface", "pod-bridge-interface", d.BridgeInterface)
		text("detectLocal.interfaceNamePrefix", "pod-interface-name-prefix", d.InterfaceNamePrefix)
	}
	if len(fc.NodePortAddresses) > 0 {
		text("nodePortAddresses", "nodeport-addresses", strings.Join(fc.NodePortAddresses, ","))
	}
	ptr("oomScoreAdj", "oom-score-adj", fc.OOMScoreAdj)
	if c := fc.Conntrack; c != nil {
		ptr("conntrack.maxPerCore", "conntrack-max-per-core", c.MaxPerCore)
		ptr("conntrack.min", "conntrack-min", c.Min)
		ptr("conntrack.tcpEstablishedTimeout", "conntrack-tcp-timeout-established", c.TCPEstablishedTimeout)
		ptr("conntrack.tcpCloseWaitTimeout", "conntrack-tcp-timeout-close-wait", c.TCPCloseWaitTimeout)
		ptr("conntrack.tcpBeLiberal", "conntrack-tcp-be-liberal", c.TCPBeLiberal)
		dur("conntrack.udpTimeout", "conntrack-udp-timeout", c.UDPTimeout)
		dur("conntrack.udpStreamTimeout", "conntrack-udp-timeout-stream", c.UDPStreamTimeout)
	}
	dur("configSyncPeriod", "config-sync-period", fc.ConfigSyncPeriod)
	text("portRange", "proxy-port-range", fc.PortRange)
	dur("syncPeriod", "sync-period", fc.SyncPeriod)
	dur("minSyncPeriod", "min-sync-period", fc.MinSyncPeriod)
	dur("udpIdleTimeout", "udp-timeout", fc.UDPIdleTimeout)

	ptr("manifests", "manifests", fc.Manifests)
	ptr("tcpIdleTimeout", "tcp-idle-timeout", fc.TCPIdleTimeout)
	ptr("parkIdleAfter", "park-idle-after", fc.ParkIdleAfter)
	ptr("udpMaxFlows", "udp-max-flows", fc.UDPMaxFlows)
	ptr("shutdownGrace", "shutdown-grace", fc.ShutdownGrace)
	ptr("backendSourceAddress", "backend-source-address", fc.BackendSource)
	if o := fc.Outlier; o != nil {
		ptr("outlierDetection.consecutiveFailures", "outlier-consecutive-failures", o.ConsecutiveFailures)
		ptr("outlierDetection.baseEjectionTime", "outlier-base-ejection-time", o.BaseEjectionTime)
		ptr("outlierDetection.maxEjectionTime", "outlier-max-ejection-time", o.MaxEjectionTime)
	}
	ptr("connectionLog", "connection-log", fc.ConnectionLog)
	ptr("connectionLogRate", "connection-log-rate", fc.ConnectionLogRate)
	ptr("schedulingPolicy", "scheduling-policy", fc.SchedulingPolicy)
	ptr("logLevel", "log-level", fc.LogLevel)
	ptr("logFormat", "log-format", fc.LogFormat)
	return out
}

// logLevelOfVerbosity maps klog's -v to a log level: kube-proxy logs
// per-change detail from 2 and per-sync detail from 4.
func logLevelOfVerbosity(v int) string {
	switch {
	case v >= 6:
		return "trace"
	case v >= 4:
		return "debug"
	}
	return "info"
}

// notApplied says which fields of the file have no effect here, one
// sentence per topic.
func (fc *fileConfig) notApplied() []string {
	var out []string
	if m := fc.Mode; m != "" && m != "userspace" {
		out = append(out, fmt.Sprintf("mode: %q is one of kube-proxy's modes; this daemon proxies in userspace whatever the mode says", m))
	}
	for _, other := range []struct {
		name string
		m    map[string]any
	}{{"ipvs", fc.IPVS}, {"nftables", fc.NFTables}, {"winkernel", fc.Winkernel}} {
		if set := nonZeroKeys(other.m); len(set) > 0 {
			out = append(out, fmt.Sprintf("%s: %s: settings of kube-proxy's %s mode, ignored here",
				other.name, strings.Join(set, ", "), other.name))
		}
	}
	if len(fc.FeatureGates) > 0 {
		gates := make([]string, 0, len(fc.FeatureGates))
		for g := range fc.FeatureGates {
			gates = append(gates, g)
		}
		sort.Strings(gates)
		out = append(out, fmt.Sprintf("featureGates: %s: kube-proxy's feature gates do not apply here", strings.Join(gates, ", ")))
	}
	if fc.ShowHiddenMetricsForVersion != "" {
		out = append(out, "showHiddenMetricsForVersion: this daemon hides no metrics")
	}
	if t := fc.IPTables; t != nil {
		if t.MasqueradeBit != nil {
			out = append(out, "iptables.masqueradeBit: no masquerade mark is used here (connections to endpoints leave from this node's sockets)")
		}
		if t.MasqueradeAll != nil && *t.MasqueradeAll {
			out = append(out, "iptables.masqueradeAll: endpoints see this node's address for every connection here anyway")
		}
		if t.LocalhostNodePorts != nil && !*t.LocalhostNodePorts {
			out = append(out, "iptables.localhostNodePorts: false cannot be honoured: a NodePort is a listening socket on every local address, 127.0.0.1 included (no route_localnet is set)")
		}
	}
	if l := fc.Logging; l != nil && len(l.VModule) > 0 && string(l.VModule) != "null" && string(l.VModule) != "[]" && string(l.VModule) != `""` {
		out = append(out, "logging.vmodule: per-file verbosity does not exist here (use logLevel)")
	}
	if fc.WindowsRunAsService != nil && *fc.WindowsRunAsService {
		out = append(out, "windowsRunAsService: this daemon runs on Linux only")
	}
	return out
}

// nonZeroKeys lists the keys of m (nested with dots) whose values are not
// zero: "", 0, false, null, "0s", empty lists and maps.
func nonZeroKeys(m map[string]any) []string {
	var out []string
	for k, v := range m {
		switch x := v.(type) {
		case nil:
		case string:
			if d, err := time.ParseDuration(x); x != "" && (err != nil || d != 0) {
				out = append(out, k)
			}
		case bool:
			if x {
				out = append(out, k)
			}
		case float64:
			if x != 0 {
				out = append(out, k)
			}
		case []any:
			if len(x) > 0 {
				out = append(out, k)
			}
		case map[string]any:
			for _, sub := range nonZeroKeys(x) {
				out = append(out, k+"."+sub)
			}
		default:
			out = append(out, k)
		}
	}
	sort.Strings(out)
	return out
}
