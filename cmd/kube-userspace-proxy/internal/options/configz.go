package main

import (
	"encoding/json"
	"net/http"
	"strings"
	"time"
)

// configz is the effective configuration, as kube-proxy's /configz shows
// its own: kube-proxy's fields under "kubeproxy.config.k8s.io" (with the
// values this daemon runs with, whether from flags, --config or
// defaults), this proxy's own beside them.
func (o *options) configz(node string) map[string]any {
	d := func(v time.Duration) string { return v.String() }
	nodePorts := []string{}
	if o.nodePortPrimary {
		nodePorts = append(nodePorts, "primary") // as given: the addresses are resolved at start
	} else {
		for _, p := range o.nodePortCIDRs {
			nodePorts = append(nodePorts, p.String())
		}
	}
	clusterCIDRs := []string{}
	for _, p := range o.clusterCIDRs {
		clusterCIDRs = append(clusterCIDRs, p.String())
	}
	return map[string]any{
		"kubeproxy.config.k8s.io": map[string]any{
			"apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
			"kind":       "KubeProxyConfiguration",
			"clientConnection": map[string]any{
				"kubeconfig": o.kubeconfig, "contentType": o.api.contentType,
				"acceptContentTypes": o.api.acceptContentTypes, "qps": o.api.qps, "burst": o.api.burst,
			},
			"hostnameOverride":    node,
			"bindAddress":         o.bindAddress.String(),
			"healthzBindAddress":  o.healthzAddr,
			"metricsBindAddress":  o.metricsAddr,
			"bindAddressHardFail": o.bindHardFail,
			"enableProfiling":     o.profiling,
			"mode":                "userspace",
			"iptables":            map[string]any{"syncPeriod": d(o.syncPeriod), "minSyncPeriod": d(o.minSyncPeriod)},
			"nodePortAddresses":   nodePorts,
			"oomScoreAdj":         o.oomScoreAdj,
			"detectLocalMode":     string(o.local.Mode),
			"clusterCIDR":         strings.Join(clusterCIDRs, ","),
			"detectLocal":         map[string]any{"bridgeInterface": o.podBridge, "interfaceNamePrefix": o.podIfPrefix},
			"conntrack": map[string]any{
				"maxPerCore": o.conntrack.maxPerCore, "min": o.conntrack.min,
				"tcpEstablishedTimeout": d(o.conntrack.tcpEstablished), "tcpCloseWaitTimeout": d(o.conntrack.tcpCloseWait),
				"tcpBeLiberal": o.conntrack.tcpBeLiberal, "udpTimeout": d(o.conntrack.udpTimeout),
				"udpStreamTimeout": d(o.conntrack.udpStream),
			},
			"configSyncPeriod": d(o.configSync),
			"portRange":        o.portRange.String(),
			"udpIdleTimeout":   d(o.udpTimeout),
		},
		"kube-userspace-proxy": map[string]any{
			"manifests": o.manifests, "tcpIdleTimeout": d(o.tcpIdleTimeout), "parkIdleAfter": d(o.parkIdleAfter),
			"udpMaxFlows": o.udpMaxFlows, "shutdownGrace": d(o.shutdownGrace), "backendSourceAddress": string(o.backendSource),
			"outlierDetection": map[string]any{
				"consecutiveFailures": o.outlier.ConsecutiveFailures,
				"baseEjectionTime":    d(o.outlier.BaseEjectionTime), "maxEjectionTime": d(o.outlier.MaxEjectionTime),
			},
			"connectionLog": o.connLog, "connectionLogRate": o.connLogRate, "schedulingPolicy": o.schedPolicy, "logLevel": o.logLevel, "logFormat": o.logFormat,
			"iptables":     o.iptables,
			"localTraffic": o.local.Describe(),
		},
	}
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
