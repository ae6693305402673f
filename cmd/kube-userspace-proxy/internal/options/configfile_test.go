package options

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
)

func writeConfig(t *testing.T, content string) string {
	t.Helper()
	f := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(f, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return f
}

func TestConfigFileAndFlagPrecedence(t *testing.T) {
	f := writeConfig(t, `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: /etc/kube/config}
hostnameOverride: node-7
bindAddress: 10.0.0.5
healthzBindAddress: 0.0.0.0:12256
metricsBindAddress: 127.0.0.1:12249
nodePortAddresses: [192.168.0.0/16]
portRange: 40000-40100
iptables: {syncPeriod: 45s, minSyncPeriod: 2s}
udpIdleTimeout: 10s
tcpIdleTimeout: 1h
parkIdleAfter: 250ms
shutdownGrace: 9s
outlierDetection: {consecutiveFailures: 3, baseEjectionTime: 10s, maxEjectionTime: 1m}
`)
	o, err := Parse([]string{"--config", f, "--sync-period", "60s", "--hostname-override", "from-flag"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if o.Kubeconfig != "/etc/kube/config" || o.BindAddress.String() != "10.0.0.5" || o.HealthzAddr != "0.0.0.0:12256" ||
		o.MetricsAddr != "127.0.0.1:12249" || o.PortRange.String() != "40000-40100" || len(o.NodePortCIDRs) != 1 ||
		o.MinSyncPeriod != 2*time.Second || o.UDPTimeout != 10*time.Second || o.TCPIdleTimeout != time.Hour || o.ShutdownGrace != 9*time.Second ||
		o.ParkIdleAfter != 250*time.Millisecond {
		t.Fatalf("file values not applied: %+v", o)
	}
	if o.Outlier != (balance.OutlierConfig{ConsecutiveFailures: 3, BaseEjectionTime: 10 * time.Second, MaxEjectionTime: time.Minute}) {
		t.Fatalf("outlierDetection not applied: %+v", o.Outlier)
	}
	if o.SyncPeriod != 60*time.Second || o.NodeName() != "from-flag" {
		t.Fatalf("flags must override the file: syncPeriod %s node %s", o.SyncPeriod, o.NodeName())
	}
}

func TestConfigFileRejectsBadFields(t *testing.T) {
	for _, tc := range []struct{ content, want string }{
		{"kind: KubeProxyConfiguration\nmodes: ipvs\n", `unknown field "modes"`},
		{"kind: KubeProxyConfiguration\niptables: {syncPeriod: 30s, masqueradeAl: true}\n", `unknown field "iptables.masqueradeAl"`},
		{"kind: KubeProxyConfiguration\nconntrack: {tcpCloseWaitTimeout: soon}\nmanifests: m.yaml\n", `conntrack.tcpCloseWaitTimeout: invalid argument "soon"`},
		{"kind: KubeProxyConfiguration\noomScoreAdj: -2000\nmanifests: m.yaml\n", `oomScoreAdj (in --config`},
		{"kind: KubeProxyConfiguration\nnodePortAddresses: [primary, 10.0.0.0/8]\nmanifests: m.yaml\n", `nodePortAddresses (in --config`},
		{"kind: KubeProxyConfiguration\nbindAddress: nowhere\nmanifests: m.yaml\n", `bindAddress (in --config`},
		{"kind: KubeProxyConfiguration\nportRange: 9-1\nmanifests: m.yaml\n", `portRange (in --config`},
		{"kind: KubeProxyConfiguration\nsyncPeriod: soon\n", `syncPeriod`},
		{"kind: KubeProxyConfiguration\nudpMaxFlows: 0\nmanifests: m.yaml\n", `udpMaxFlows (in --config`},
		{"kind: KubeletConfiguration\n", `kind: "KubeletConfiguration"`},
		{"kind: KubeProxyConfiguration\noutlierDetection: {maxEjectionTime: 1s}\nmanifests: m.yaml\n", `outlierDetection.maxEjectionTime (in --config`},
		{"kind: KubeProxyConfiguration\noutlierDetection: {interval: 1s}\n", `unknown field "outlierDetection.interval"`},
	} {
		f := writeConfig(t, tc.content)
		_, err := Parse([]string{"--config", f}, &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: got %v, want an error containing %q", tc.content, err, tc.want)
		}
	}
}

// kubeadmConfigConf is the config.conf of kubeadm v1.37's kube-proxy
// ConfigMap for a cluster with podSubnet 10.244.0.0/16: every field of
// KubeProxyConfiguration, most of them zero.
const kubeadmConfigConf = `apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: ""
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
`

// kubeadm's config.conf, which names every field with zero values, starts
// the daemon with kube-proxy's defaults and without a single warning: a
// zero means the default, as in kube-proxy.
func TestKubeadmConfigConf(t *testing.T) {
	o, err := Parse([]string{"--config", writeConfig(t, kubeadmConfigConf)}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	defaults, err := Parse([]string{"--kubeconfig", "/var/lib/kube-proxy/kubeconfig.conf"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if len(o.ConfigWarnings) > 0 {
		t.Errorf("warnings for kubeadm's config.conf: %q", o.ConfigWarnings)
	}
	got, want := o.Configz("n"), defaults.Configz("n")
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("kubeadm's config.conf does not give the defaults:\n got %v\nwant %v", got, want)
	}
	if o.HealthzAddr != "0.0.0.0:10256" || o.MetricsAddr != "127.0.0.1:10249" || o.SyncPeriod != 30*time.Second ||
		o.OOMScoreAdj != -999 || o.Conntrack.TCPCloseWait != time.Hour || o.ConfigSync != 15*time.Minute {
		t.Errorf("not kube-proxy's defaults: %+v", o)
	}
}

// The fields of kube-proxy's other modes and the ones that cannot apply
// here are named in one warning each; the ones that apply are applied.
func TestConfigFileWarnsWhatDoesNotApply(t *testing.T) {
	o, err := Parse([]string{"--config", writeConfig(t, `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: /k, qps: 50, burst: 100, contentType: application/json}
mode: ipvs
ipvs: {scheduler: lc, strictARP: true, syncPeriod: 0s}
nftables: {syncPeriod: 0s}
featureGates: {SomeGate: true}
iptables: {masqueradeBit: 14, localhostNodePorts: false, syncPeriod: 1m}
logging: {format: json, verbosity: 4}
oomScoreAdj: -500
configSyncPeriod: 1h
nodePortAddresses: [primary]
conntrack: {maxPerCore: 0, tcpCloseWaitTimeout: 0s}
`)}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	joined := strings.Join(o.ConfigWarnings, "\n")
	for _, want := range []string{`mode: "ipvs"`, "ipvs: scheduler, strictARP: settings of kube-proxy's ipvs mode", "featureGates: SomeGate",
		"iptables.masqueradeBit", "iptables.localhostNodePorts"} {
		if !strings.Contains(joined, want) {
			t.Errorf("no warning naming %q in:\n%s", want, joined)
		}
	}
	if strings.Contains(joined, "nftables") {
		t.Errorf("nftables: holds only zero values, yet warned:\n%s", joined)
	}
	if len(o.ConfigWarnings) != 5 {
		t.Errorf("%d warnings, want 5:\n%s", len(o.ConfigWarnings), joined)
	}
	if o.API.QPS != 50 || o.API.Burst != 100 || o.API.ContentType != "application/json" || o.LogFormat != "json" ||
		o.LogLevel != "debug" || o.OOMScoreAdj != -500 || o.ConfigSync != time.Hour || !o.NodePortPrimary ||
		o.SyncPeriod != time.Minute || o.Conntrack.MaxPerCore != 0 || o.Conntrack.TCPCloseWait != 0 {
		t.Errorf("fields not applied: %+v", o)
	}
}

// A proxy port range over the daemon's own ports, a node's servers or the
// NodePort range is refused with what it overlaps.
func TestProxyPortRangeOverlapsRefused(t *testing.T) {
	for _, tc := range []struct{ args, want string }{
		{"--proxy-port-range 10250-10251", "the kubelet's API (10250)"},
		{"--proxy-port-range 31000-31999", "the NodePort range (30000-32767)"},
		{"--proxy-port-range 40000-40999 --metrics-bind-address 127.0.0.1:40500", "this daemon's own --metrics-bind-address (40500)"},
		{"--proxy-port-range 2000+500", "etcd (2379)"},
	} {
		_, err := Parse(append([]string{"--manifests", "m.yaml"}, strings.Fields(tc.args)...), &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error naming %s", tc.args, err, tc.want)
		}
	}
	if _, err := Parse([]string{"--manifests", "m.yaml", "--proxy-port-range", "45000-59999"}, &bytes.Buffer{}); err != nil {
		t.Errorf("the default range refused: %v", err)
	}
}
