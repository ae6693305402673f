package options

import (
	"strings"
	"time"
)

// Configz is the effective configuration, as kube-proxy's /configz shows
// its own: kube-proxy's fields under "kubeproxy.config.k8s.io" (with the
// values this daemon runs with, whether from flags, --config or
// defaults), this proxy's own beside them.
func (o *Options) Configz(node string) map[string]any {
	d := func(v time.Duration) string { return v.String() }
	nodePorts := []string{}
	if o.NodePortPrimary {
		nodePorts = append(nodePorts, "primary") // as given: the addresses are resolved at start
	} else {
		for _, p := range o.NodePortCIDRs {
			nodePorts = append(nodePorts, p.String())
		}
	}
	clusterCIDRs := []string{}
	for _, p := range o.ClusterCIDRs {
		clusterCIDRs = append(clusterCIDRs, p.String())
	}
	return map[string]any{
		"kubeproxy.config.k8s.io": map[string]any{
			"apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
			"kind":       "KubeProxyConfiguration",
			"clientConnection": map[string]any{
				"kubeconfig": o.Kubeconfig, "contentType": o.API.ContentType,
				"acceptContentTypes": o.API.AcceptContentTypes, "qps": o.API.QPS, "burst": o.API.Burst,
			},
			"hostnameOverride":    node,
			"bindAddress":         o.BindAddress.String(),
			"healthzBindAddress":  o.HealthzAddr,
			"metricsBindAddress":  o.MetricsAddr,
			"bindAddressHardFail": o.BindHardFail,
			"enableProfiling":     o.Profiling,
			"mode":                "userspace",
			"iptables":            map[string]any{"syncPeriod": d(o.SyncPeriod), "minSyncPeriod": d(o.MinSyncPeriod)},
			"nodePortAddresses":   nodePorts,
			"oomScoreAdj":         o.OOMScoreAdj,
			"detectLocalMode":     string(o.Local.Mode),
			"clusterCIDR":         strings.Join(clusterCIDRs, ","),
			"detectLocal":         map[string]any{"bridgeInterface": o.PodBridge, "interfaceNamePrefix": o.PodIfPrefix},
			"conntrack": map[string]any{
				"maxPerCore": o.Conntrack.MaxPerCore, "min": o.Conntrack.Min,
				"tcpEstablishedTimeout": d(o.Conntrack.TCPEstablished), "tcpCloseWaitTimeout": d(o.Conntrack.TCPCloseWait),
				"tcpBeLiberal": o.Conntrack.TCPBeLiberal, "udpTimeout": d(o.Conntrack.UDPTimeout),
				"udpStreamTimeout": d(o.Conntrack.UDPStream),
			},
			"configSyncPeriod": d(o.ConfigSync),
			"portRange":        o.PortRange.String(),
			"udpIdleTimeout":   d(o.UDPTimeout),
		},
		"kube-userspace-proxy": map[string]any{
			"manifests": o.Manifests, "tcpIdleTimeout": d(o.TCPIdleTimeout), "parkIdleAfter": d(o.ParkIdleAfter),
			"udpMaxFlows": o.UDPMaxFlows, "shutdownGrace": d(o.ShutdownGrace), "backendSourceAddress": string(o.BackendSource),
			"outlierDetection": map[string]any{
				"consecutiveFailures": o.Outlier.ConsecutiveFailures,
				"baseEjectionTime":    d(o.Outlier.BaseEjectionTime), "maxEjectionTime": d(o.Outlier.MaxEjectionTime),
			},
			"connectionLog": o.ConnLog, "connectionLogRate": o.ConnLogRate, "schedulingPolicy": o.SchedPolicy, "logLevel": o.LogLevel, "logFormat": o.LogFormat,
			"iptables":     o.IPTables,
			"localTraffic": o.Local.Describe(),
		},
	}
}
