package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
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
	o, err := parseFlags([]string{"--config", f, "--sync-period", "60s", "--hostname-override", "from-flag"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if o.kubeconfig != "/etc/kube/config" || o.bindAddress.String() != "10.0.0.5" || o.healthzAddr != "0.0.0.0:12256" ||
		o.metricsAddr != "127.0.0.1:12249" || o.portRange.String() != "40000-40100" || len(o.nodePortCIDRs) != 1 ||
		o.minSyncPeriod != 2*time.Second || o.udpTimeout != 10*time.Second || o.tcpIdleTimeout != time.Hour || o.shutdownGrace != 9*time.Second ||
		o.parkIdleAfter != 250*time.Millisecond {
		t.Fatalf("file values not applied: %+v", o)
	}
	if o.outlier != (balance.OutlierConfig{ConsecutiveFailures: 3, BaseEjectionTime: 10 * time.Second, MaxEjectionTime: time.Minute}) {
		t.Fatalf("outlierDetection not applied: %+v", o.outlier)
	}
	if o.syncPeriod != 60*time.Second || o.nodeName() != "from-flag" {
		t.Fatalf("flags must override the file: syncPeriod %s node %s", o.syncPeriod, o.nodeName())
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
		_, err := parseFlags([]string{"--config", f}, &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: got %v, want an error containing %q", tc.content, err, tc.want)
		}
	}
	var stderr bytes.Buffer
	if code := run([]string{"--config", writeConfig(t, "mdoe: ipvs\n")}, &bytes.Buffer{}, &stderr); code != exitUsage {
		t.Errorf("bad config file: exit %d, want %d", code, exitUsage)
	}
}

// --park-idle-after 0 turns parking off: proxy.Config says so with a
// negative duration (its zero is the default).
func TestParkIdleAfterZeroMeansNever(t *testing.T) {
	for flag, want := range map[string]time.Duration{"0": -1, "250ms": 250 * time.Millisecond} {
		o, err := parseFlags([]string{"--manifests", "x", "--park-idle-after", flag}, &bytes.Buffer{})
		if err != nil {
			t.Fatal(err)
		}
		if got := parkIdleAfter(o.parkIdleAfter); got != want {
			t.Errorf("--park-idle-after %s: proxy.Config.ParkIdleAfter %v, want %v", flag, got, want)
		}
	}
	if o, err := parseFlags([]string{"--manifests", "x"}, &bytes.Buffer{}); err != nil || o.parkIdleAfter != dataplane.DefaultParkIdleAfter {
		t.Errorf("default --park-idle-after %v (%v), want %v", o.parkIdleAfter, err, dataplane.DefaultParkIdleAfter)
	}
	if _, err := parseFlags([]string{"--manifests", "x", "--park-idle-after", "-1s"}, &bytes.Buffer{}); err == nil {
		t.Error("a negative --park-idle-after was accepted")
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
	o, err := parseFlags([]string{"--config", writeConfig(t, kubeadmConfigConf)}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	defaults, err := parseFlags([]string{"--kubeconfig", "/var/lib/kube-proxy/kubeconfig.conf"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if len(o.configWarnings) > 0 {
		t.Errorf("warnings for kubeadm's config.conf: %q", o.configWarnings)
	}
	got, want := o.configz("n"), defaults.configz("n")
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("kubeadm's config.conf does not give the defaults:\n got %v\nwant %v", got, want)
	}
	if o.healthzAddr != "0.0.0.0:10256" || o.metricsAddr != "127.0.0.1:10249" || o.syncPeriod != 30*time.Second ||
		o.oomScoreAdj != -999 || o.conntrack.tcpCloseWait != time.Hour || o.configSync != 15*time.Minute {
		t.Errorf("not kube-proxy's defaults: %+v", o)
	}
}

// The fields of kube-proxy's other modes and the ones that cannot apply
// here are named in one warning each; the ones that apply are applied.
func TestConfigFileWarnsWhatDoesNotApply(t *testing.T) {
	o, err := parseFlags([]string{"--config", writeConfig(t, `apiVersion: kubeproxy.config.k8s.io/v1alpha1
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
	joined := strings.Join(o.configWarnings, "\n")
	for _, want := range []string{`mode: "ipvs"`, "ipvs: scheduler, strictARP: settings of kube-proxy's ipvs mode", "featureGates: SomeGate",
		"iptables.masqueradeBit", "iptables.localhostNodePorts"} {
		if !strings.Contains(joined, want) {
			t.Errorf("no warning naming %q in:\n%s", want, joined)
		}
	}
	if strings.Contains(joined, "nftables") {
		t.Errorf("nftables: holds only zero values, yet warned:\n%s", joined)
	}
	if len(o.configWarnings) != 5 {
		t.Errorf("%d warnings, want 5:\n%s", len(o.configWarnings), joined)
	}
	if o.api.qps != 50 || o.api.burst != 100 || o.api.contentType != "application/json" || o.logFormat != "json" ||
		o.logLevel != "debug" || o.oomScoreAdj != -500 || o.configSync != time.Hour || !o.nodePortPrimary ||
		o.syncPeriod != time.Minute || o.conntrack.maxPerCore != 0 || o.conntrack.tcpCloseWait != 0 {
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
		_, err := parseFlags(append([]string{"--manifests", "m.yaml"}, strings.Fields(tc.args)...), &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error naming %s", tc.args, err, tc.want)
		}
	}
	if _, err := parseFlags([]string{"--manifests", "m.yaml", "--proxy-port-range", "45000-59999"}, &bytes.Buffer{}); err != nil {
		t.Errorf("the default range refused: %v", err)
	}
}
