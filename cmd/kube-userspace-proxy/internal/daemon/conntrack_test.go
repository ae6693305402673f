package daemon

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/internal/options"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// A copy of the sysctls with the kernel's defaults; ro names files the
// "kernel" refuses (mode 0444, as nf_conntrack_max outside the host's
// network namespace).
func fakeSysctls(t *testing.T, ro ...string) string {
	t.Helper()
	sysctls := kernel.Sysctls{Root: t.TempDir()}
	dir := filepath.Dir(sysctls.Path("net.netfilter.nf_conntrack_max"))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, v := range map[string]string{
		"nf_conntrack_max": "65536", "nf_conntrack_tcp_timeout_established": "432000",
		"nf_conntrack_tcp_timeout_close_wait": "60", "nf_conntrack_tcp_be_liberal": "0",
		"nf_conntrack_udp_timeout": "30", "nf_conntrack_udp_timeout_stream": "120",
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(v+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range ro {
		if err := os.Chmod(filepath.Join(dir, name), 0o444); err != nil {
			t.Fatal(err)
		}
	}
	hs := filepath.Join(dir, "hashsize")
	if err := os.WriteFile(hs, []byte("16384\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	oldSysctls, oldHS := conntrackSysctls, conntrackHashsizePath
	conntrackSysctls, conntrackHashsizePath = sysctls, hs
	t.Cleanup(func() { conntrackSysctls, conntrackHashsizePath = oldSysctls, oldHS })
	return dir
}

func sysctlValue(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(data))
}

func testLogger() (*logrus.Logger, *bytes.Buffer) {
	var buf bytes.Buffer
	log := logrus.New()
	log.SetOutput(&buf)
	return log, &buf
}

// kube-proxy's defaults, as the flags give them, land in the sysctls; the
// table size is raised with its hash table; what is 0 stays the kernel's.
func TestConntrackDefaultsAsKubeProxy(t *testing.T) {
	dir := fakeSysctls(t)
	o, err := options.Parse([]string{"--manifests", "x.yaml"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	log, _ := testLogger()
	applyConntrack(o.Conntrack, log, nil)
	want := map[string]string{
		"nf_conntrack_tcp_timeout_established": "86400", "nf_conntrack_tcp_timeout_close_wait": "3600",
		"nf_conntrack_tcp_be_liberal": "0", "nf_conntrack_udp_timeout": "30", "nf_conntrack_udp_timeout_stream": "120",
		"nf_conntrack_max": "131072", // 32768 per CPU, at least 131072
	}
	for name, v := range want {
		if got := sysctlValue(t, filepath.Join(dir, name)); got != v {
			t.Errorf("%s = %s, want %s", name, got, v)
		}
	}
	if got := sysctlValue(t, conntrackHashsizePath); got != "32768" {
		t.Errorf("hashsize = %s, want 32768 (max/4)", got)
	}
}

// Flags and the config file's conntrack: fields set the same values; the
// command line wins.
func TestConntrackFromConfigFile(t *testing.T) {
	dir := fakeSysctls(t)
	cfg := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(cfg, []byte(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
conntrack:
  maxPerCore: 0
  min: null
  tcpEstablishedTimeout: 2h
  tcpCloseWaitTimeout: 30m
  tcpBeLiberal: true
  udpTimeout: 45s
  udpStreamTimeout: 3m
`), 0o644); err != nil {
		t.Fatal(err)
	}
	o, err := options.Parse([]string{"--manifests", "x.yaml", "--config", cfg, "--conntrack-tcp-timeout-close-wait", "2h"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	log, _ := testLogger()
	applyConntrack(o.Conntrack, log, nil)
	want := map[string]string{
		"nf_conntrack_tcp_timeout_established": "7200", "nf_conntrack_tcp_timeout_close_wait": "7200",
		"nf_conntrack_tcp_be_liberal": "1", "nf_conntrack_udp_timeout": "45", "nf_conntrack_udp_timeout_stream": "180",
		"nf_conntrack_max": "65536", // maxPerCore 0: left alone
	}
	for name, v := range want {
		if got := sysctlValue(t, filepath.Join(dir, name)); got != v {
			t.Errorf("%s = %s, want %s", name, got, v)
		}
	}
}

// Outside the host's network namespace the table size is read-only: it is
// left alone with one line saying so, the timeouts are still set, and a
// refused timeout is a warning naming the sysctl, not a failure.
func TestConntrackReadOnlyKernel(t *testing.T) {
	dir := fakeSysctls(t, "nf_conntrack_max")
	if err := os.Remove(filepath.Join(dir, "nf_conntrack_tcp_timeout_established")); err != nil {
		t.Fatal(err)
	}
	log, buf := testLogger()
	applyConntrack(options.Conntrack{MaxPerCore: 32768, Min: 131072, TCPEstablished: 24 * time.Hour, TCPCloseWait: time.Hour}, log, nil)
	if got := sysctlValue(t, filepath.Join(dir, "nf_conntrack_max")); got != "65536" {
		t.Errorf("nf_conntrack_max = %s, want it left at 65536", got)
	}
	if got := sysctlValue(t, conntrackHashsizePath); got != "16384" {
		t.Errorf("hashsize = %s, want it left at 16384", got)
	}
	if got := sysctlValue(t, filepath.Join(dir, "nf_conntrack_tcp_timeout_close_wait")); got != "3600" {
		t.Errorf("close_wait = %s, want 3600", got)
	}
	out := buf.String()
	for _, want := range []string{"host-wide and read-only in this network namespace",
		"sysctl=net.netfilter.nf_conntrack_tcp_timeout_established", "is nf_conntrack loaded?"} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %q:\n%s", want, out)
		}
	}

	// A daemon's start says it once, in the kernel report, not as a
	// warning of its own.
	log, buf = testLogger()
	report := &config.KernelReport{}
	applyConntrack(options.Conntrack{TCPEstablished: 24 * time.Hour}, log, report)
	if m, ok := report.Missing(config.PieceConntrackSysctl); !ok || !strings.Contains(m.Err.Error(), "nf_conntrack_tcp_timeout_established") {
		t.Errorf("the report lacks the refused sysctl: %+v %v", m, ok)
	}
	if strings.Contains(buf.String(), "level=warning") {
		t.Errorf("a refused sysctl warned beside the report:\n%s", buf.String())
	}
}
