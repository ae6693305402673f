package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
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
portRange: 30000-30100
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
		o.metricsAddr != "127.0.0.1:12249" || o.portRange.String() != "30000-30100" || len(o.nodePortCIDRs) != 1 ||
		o.minSyncPeriod != 2*time.Second || o.udpTimeout != 10*time.Second || o.tcpIdleTimeout != time.Hour || o.shutdownGrace != 9*time.Second ||
		o.parkIdleAfter != 250*time.Millisecond {
		t.Fatalf("file values not applied: %+v", o)
	}
	if o.outlier != (proxy.OutlierConfig{ConsecutiveFailures: 3, BaseEjectionTime: 10 * time.Second, MaxEjectionTime: time.Minute}) {
		t.Fatalf("outlierDetection not applied: %+v", o.outlier)
	}
	if o.syncPeriod != 60*time.Second || o.nodeName() != "from-flag" {
		t.Fatalf("flags must override the file: syncPeriod %s node %s", o.syncPeriod, o.nodeName())
	}
}

func TestConfigFileRejectsBadFields(t *testing.T) {
	for _, tc := range []struct{ content, want string }{
		{"kind: KubeProxyConfiguration\nmode: ipvs\n", `unknown field "mode"`},
		{"kind: KubeProxyConfiguration\niptables: {syncPeriod: 30s, masqueradeAll: true}\n", `unknown field "iptables.masqueradeAll"`},
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
	if code := run([]string{"--config", writeConfig(t, "mode: ipvs\n")}, &bytes.Buffer{}, &stderr); code != exitUsage {
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
	if o, err := parseFlags([]string{"--manifests", "x"}, &bytes.Buffer{}); err != nil || o.parkIdleAfter != proxy.DefaultParkIdleAfter {
		t.Errorf("default --park-idle-after %v (%v), want %v", o.parkIdleAfter, err, proxy.DefaultParkIdleAfter)
	}
	if _, err := parseFlags([]string{"--manifests", "x", "--park-idle-after", "-1s"}, &bytes.Buffer{}); err == nil {
		t.Error("a negative --park-idle-after was accepted")
	}
}
