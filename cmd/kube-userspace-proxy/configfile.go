package main

import (
	"fmt"
	"os"
	"strings"

	"github.com/spf13/pflag"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// fileConfig is the --config file: kube-proxy's KubeProxyConfiguration
// (kubeproxy.config.k8s.io/v1alpha1) fields that apply to this proxy, plus
// this proxy's own. Unknown fields are rejected, so a typo never passes
// silently; fields of kube-proxy's other modes are unknown here on purpose.
type fileConfig struct {
	APIVersion       string `json:"apiVersion"`
	Kind             string `json:"kind"`
	ClientConnection *struct {
		Kubeconfig string `json:"kubeconfig"`
	} `json:"clientConnection,omitempty"`
	HostnameOverride   *string  `json:"hostnameOverride,omitempty"`
	BindAddress        *string  `json:"bindAddress,omitempty"`
	HealthzBindAddress *string  `json:"healthzBindAddress,omitempty"`
	MetricsBindAddress *string  `json:"metricsBindAddress,omitempty"`
	NodePortAddresses  []string `json:"nodePortAddresses,omitempty"`
	PortRange          *string  `json:"portRange,omitempty"`
	EnableProfiling    *bool    `json:"enableProfiling,omitempty"`
	// Older kube-proxy configs keep the periods under iptables:, newer ones
	// at the top; both are read.
	IPTables *struct {
		SyncPeriod    *string `json:"syncPeriod,omitempty"`
		MinSyncPeriod *string `json:"minSyncPeriod,omitempty"`
	} `json:"iptables,omitempty"`
	SyncPeriod     *string `json:"syncPeriod,omitempty"`
	MinSyncPeriod  *string `json:"minSyncPeriod,omitempty"`
	UDPIdleTimeout *string `json:"udpIdleTimeout,omitempty"`
	Conntrack      *struct {
		MaxPerCore            *int    `json:"maxPerCore,omitempty"`
		Min                   *int    `json:"min,omitempty"`
		TCPEstablishedTimeout *string `json:"tcpEstablishedTimeout,omitempty"`
		TCPCloseWaitTimeout   *string `json:"tcpCloseWaitTimeout,omitempty"`
		TCPBeLiberal          *bool   `json:"tcpBeLiberal,omitempty"`
		UDPTimeout            *string `json:"udpTimeout,omitempty"`
		UDPStreamTimeout      *string `json:"udpStreamTimeout,omitempty"`
	} `json:"conntrack,omitempty"`

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
	ConnectionLog *string `json:"connectionLog,omitempty"`
	// SchedulingPolicy is --scheduling-policy.
	SchedulingPolicy *string `json:"schedulingPolicy,omitempty"`
	LogLevel         *string `json:"logLevel,omitempty"`
	LogFormat        *string `json:"logFormat,omitempty"`
}

// applyConfigFile sets every flag the command line did not set from the
// file; errors name the file and the field.
func applyConfigFile(path string, fs *pflag.FlagSet, origin map[string]string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("--config: %w", err)
	}
	var fc fileConfig
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		return fmt.Errorf("--config %s: %w", path, err)
	}
	strictErrs, err := kjson.UnmarshalStrict(js, &fc)
	if err == nil && len(strictErrs) > 0 {
		err = strictErrs[0] // names the field with its path: iptables.masqueradeAll
	}
	if err != nil {
		return fmt.Errorf("--config %s: %s", path, strings.TrimPrefix(err.Error(), "json: "))
	}
	if fc.Kind != "" && fc.Kind != "KubeProxyConfiguration" {
		return fmt.Errorf("--config %s: kind: %q, want KubeProxyConfiguration", path, fc.Kind)
	}
	if fc.APIVersion != "" && fc.APIVersion != "kubeproxy.config.k8s.io/v1alpha1" {
		return fmt.Errorf("--config %s: apiVersion: %q, want kubeproxy.config.k8s.io/v1alpha1", path, fc.APIVersion)
	}
	str := func(p *string) *string { return p }
	dur := str // durations stay text: the flag parses them, so errors name the field
	type setting struct {
		field, flag string
		value       *string
	}
	var settings []setting
	if fc.ClientConnection != nil && fc.ClientConnection.Kubeconfig != "" {
		settings = append(settings, setting{"clientConnection.kubeconfig", "kubeconfig", &fc.ClientConnection.Kubeconfig})
	}
	if fc.IPTables != nil {
		settings = append(settings,
			setting{"iptables.syncPeriod", "sync-period", dur(fc.IPTables.SyncPeriod)},
			setting{"iptables.minSyncPeriod", "min-sync-period", dur(fc.IPTables.MinSyncPeriod)})
	}
	if len(fc.NodePortAddresses) > 0 {
		v := strings.Join(fc.NodePortAddresses, ",")
		settings = append(settings, setting{"nodePortAddresses", "nodeport-addresses", &v})
	}
	if fc.EnableProfiling != nil {
		v := fmt.Sprint(*fc.EnableProfiling)
		settings = append(settings, setting{"enableProfiling", "profiling", &v})
	}
	if c := fc.Conntrack; c != nil {
		num := func(p *int) *string {
			if p == nil {
				return nil
			}
			v := fmt.Sprint(*p)
			return &v
		}
		var liberal *string
		if c.TCPBeLiberal != nil {
			v := fmt.Sprint(*c.TCPBeLiberal)
			liberal = &v
		}
		settings = append(settings,
			setting{"conntrack.maxPerCore", "conntrack-max-per-core", num(c.MaxPerCore)},
			setting{"conntrack.min", "conntrack-min", num(c.Min)},
			setting{"conntrack.tcpEstablishedTimeout", "conntrack-tcp-timeout-established", dur(c.TCPEstablishedTimeout)},
			setting{"conntrack.tcpCloseWaitTimeout", "conntrack-tcp-timeout-close-wait", dur(c.TCPCloseWaitTimeout)},
			setting{"conntrack.tcpBeLiberal", "conntrack-tcp-be-liberal", liberal},
			setting{"conntrack.udpTimeout", "conntrack-udp-timeout", dur(c.UDPTimeout)},
			setting{"conntrack.udpStreamTimeout", "conntrack-udp-timeout-stream", dur(c.UDPStreamTimeout)})
	}
	if fc.UDPMaxFlows != nil {
		v := fmt.Sprint(*fc.UDPMaxFlows)
		settings = append(settings, setting{"udpMaxFlows", "udp-max-flows", &v})
	}
	if o := fc.Outlier; o != nil {
		if o.ConsecutiveFailures != nil {
			v := fmt.Sprint(*o.ConsecutiveFailures)
			settings = append(settings, setting{"outlierDetection.consecutiveFailures", "outlier-consecutive-failures", &v})
		}
		settings = append(settings,
			setting{"outlierDetection.baseEjectionTime", "outlier-base-ejection-time", dur(o.BaseEjectionTime)},
			setting{"outlierDetection.maxEjectionTime", "outlier-max-ejection-time", dur(o.MaxEjectionTime)})
	}
	settings = append(settings,
		setting{"hostnameOverride", "hostname-override", str(fc.HostnameOverride)},
		setting{"bindAddress", "bind-address", str(fc.BindAddress)},
		setting{"healthzBindAddress", "healthz-bind-address", str(fc.HealthzBindAddress)},
		setting{"metricsBindAddress", "metrics-bind-address", str(fc.MetricsBindAddress)},
		setting{"portRange", "proxy-port-range", str(fc.PortRange)},
		setting{"syncPeriod", "sync-period", dur(fc.SyncPeriod)},
		setting{"minSyncPeriod", "min-sync-period", dur(fc.MinSyncPeriod)},
		setting{"udpIdleTimeout", "udp-timeout", dur(fc.UDPIdleTimeout)},
		setting{"manifests", "manifests", str(fc.Manifests)},
		setting{"tcpIdleTimeout", "tcp-idle-timeout", dur(fc.TCPIdleTimeout)},
		setting{"parkIdleAfter", "park-idle-after", dur(fc.ParkIdleAfter)},
		setting{"shutdownGrace", "shutdown-grace", dur(fc.ShutdownGrace)},
		setting{"connectionLog", "connection-log", str(fc.ConnectionLog)},
		setting{"schedulingPolicy", "scheduling-policy", str(fc.SchedulingPolicy)},
		setting{"logLevel", "log-level", str(fc.LogLevel)},
		setting{"logFormat", "log-format", str(fc.LogFormat)},
	)
	for _, s := range settings {
		if s.value == nil || fs.Changed(s.flag) {
			continue // absent, or the command line wins
		}
		if err := fs.Set(s.flag, *s.value); err != nil {
			return fmt.Errorf("--config %s: %s: %w", path, s.field, err)
		}
		origin[s.flag] = fmt.Sprintf("%s (in --config %s)", s.field, path)
	}
	return nil
}
