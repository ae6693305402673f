package e2e

import (
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

// sourceManifest is lab/web (ClusterIP, NodePort 31341) with pod1 on this
// node and pod2 on another, lab/local the same with externalTrafficPolicy
// Local and an externalIP, and lab/opaque the same as web with the
// annotation that keeps the node's address.
func sourceManifest() string {
	other := func(s string) string {
		s = strings.ReplaceAll(s, "- {addresses: [10.251.19.8], nodeName: node}", "- {addresses: [10.251.19.8], nodeName: other}")
		return strings.ReplaceAll(s, `- {addresses: ["fd00:251::8"], nodeName: node}`, `- {addresses: ["fd00:251::8"], nodeName: other}`)
	}
	dual := "  clusterIPs: [%s]\n  ipFamilies: [IPv4, IPv6]\n"
	web := service("web", "NodePort", "10.96.0.10,fd00:96::10", fmt.Sprintf(dual, `10.96.0.10, "fd00:96::10"`), webPorts) + other(slices("web", webSlicePorts, true))
	local := "---\n" + service("local", "NodePort", "10.96.0.11", "  externalIPs: [203.0.113.10]\n  externalTrafficPolicy: Local\n",
		strings.ReplaceAll(webPorts, "31341", "31342")) + other(slices("local", webSlicePorts, false))
	opaque := "---\n" + strings.Replace(service("opaque", "ClusterIP", "10.96.0.12", "", `{name: http, port: 80, targetPort: 8080, protocol: TCP}`),
		"metadata: {name: opaque, namespace: lab}", "metadata: {name: opaque, namespace: lab, annotations: {kube-userspace-proxy.io/backend-source-address: node}}", 1) +
		other(slices("opaque", `{name: http, port: 8080, protocol: TCP}`, false))
	return web + local + opaque
}

// peerOf is the client address a backend reports ("pod1 (client A:P)"
// → "A").
func peerOf(body string) string {
	_, rest, ok := strings.Cut(body, "(client ")
	if !ok {
		return ""
	}
	addr := strings.TrimSuffix(strings.TrimSpace(rest), ")")
	if i := strings.LastIndex(addr, ":"); i > 0 {
		addr = addr[:i]
	}
	return strings.Trim(addr, "[]")
}

// seesOnly fetches url n times from ns and fails unless every backend saw
// want.
func seesOnly(t *testing.T, l *Lab, ns, url, want string, n int) {
	t.Helper()
	for i := 0; i < n; i++ {
		body := l.Curl(ns, url)
		if got := peerOf(body); got != want {
			t.Fatalf("%s → %s: the backend saw %q (%q), want %s", ns, url, got, body, want)
		}
	}
}

// The backend sees who called, wherever kube-proxy would not masquerade: a
// pod of this node through a ClusterIP (IPv4 and IPv6, the endpoint on
// this node's bridge or on another node), the node itself, and an
// external client of an externalTrafficPolicy: Local Service. An external
// client of an externalTrafficPolicy: Cluster Service, a Service with the
// annotation, and the flag set to node show the node's address.
func TestBackendSeesTheClient(t *testing.T) {
	l := NewLab(t)
	l.Backends()
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, sourceManifest())
	d := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node",
		"--cluster-cidr", "10.251.19.0/24,fd00:251::/64", "--connection-log", "all")
	defer func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", tail(d.Output(), 4000))
		}
	}()
	waitFor(t, "web served", func() bool { return l.Curl("client", "http://10.96.0.10/") != "" })

	// Both endpoints (pod1 "on this node", pod2 "on another"), by round robin.
	seesOnly(t, l, "client", "http://10.96.0.10/", "10.251.19.20", 8)
	seesOnly(t, l, "client", "http://[fd00:96::10]/", "fd00:251::1", 8) // IPv6: the node's, for now (source.go)
	seesOnly(t, l, "node", "http://10.96.0.10/", "192.168.50.1", 4)
	seesOnly(t, l, "ext", "http://192.168.50.1:31341/", "10.251.19.1", 4) // eTP Cluster: masqueraded
	seesOnly(t, l, "ext", "http://203.0.113.10/", "192.168.50.2", 4)      // eTP Local: the client
	seesOnly(t, l, "ext", "http://192.168.50.1:31342/", "192.168.50.2", 4)
	seesOnly(t, l, "client", "http://10.96.0.12/", "10.251.19.1", 4) // the annotation

	// Hairpin: pod1 through its own Service reaches itself from the
	// node's address (as kube-proxy masquerades it), pod2 from its own.
	for range 8 {
		body := l.Curl("pod1", "http://10.96.0.10/")
		name, _, _ := strings.Cut(body, " ")
		want := map[string]string{"pod1": "10.251.19.1", "pod2": "10.251.19.12"}[name]
		if want == "" || peerOf(body) != want {
			t.Fatalf("pod1 → its own Service: %q, want pod1 seeing 10.251.19.1 or pod2 seeing 10.251.19.12", body)
		}
	}

	// What the operator reads: the connection log and the metric.
	waitFor(t, "the connection log names the address the backend saw", func() bool {
		return strings.Contains(d.Output(), "backendSees=10.251.19.20")
	})
	metrics := l.MustExec("node", "curl", "-s", "http://127.0.0.1:10249/metrics")
	for _, want := range []string{`kube_userspace_proxy_client_address_available{ip_family="IPv4"} 1`, `kube_userspace_proxy_backend_source_total{source="client"}`} {
		if !strings.Contains(metrics, want) {
			t.Fatalf("/metrics lacks %s", want)
		}
	}

	// 1 000 connections in a row and 200 at once, each through a new
	// conntrack entry: every one answered, from the client's address.
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true, DialContext: cluster.DialContextIn(l.NS("client"))}}
	get := func() error {
		resp, err := c.Get("http://10.96.0.10/")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			return err
		}
		if got := peerOf(string(body)); got != "10.251.19.20" {
			return fmt.Errorf("the backend saw %q (%q)", got, body)
		}
		return nil
	}
	for i := range 1000 {
		if err := get(); err != nil {
			t.Fatalf("connection %d in a row: %v", i, err)
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, 200)
	for range 200 {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- get() }()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("one of 200 at once: %v", err)
		}
	}
}

// Where the replies could not come back through conntrack (a pod calling
// a pod on this node's bridge without br_netfilter), the backend sees the
// node's address and the connection works; --backend-source-address node
// turns it off everywhere.
func TestBackendSourceFallsBack(t *testing.T) {
	l := NewLab(t)
	l.Backends()
	m := filepath.Join(t.TempDir(), "m.yaml")
	onlyPod1 := func(s string) string {
		s = strings.ReplaceAll(s, "- {addresses: [10.251.19.8], nodeName: node}\n", "")
		return strings.ReplaceAll(s, "- {addresses: [\"fd00:251::8\"], nodeName: node}\n", "")
	}
	writeManifest(t, m, service("web", "NodePort", "10.96.0.10", "  externalIPs: [203.0.113.10]\n  externalTrafficPolicy: Local\n", webPorts)+
		onlyPod1(slices("web", webSlicePorts, false)))
	if _, err := l.Exec("node", "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0"); err != nil {
		t.Fatalf("net.bridge.bridge-nf-call-iptables is not a sysctl of this namespace (br_netfilter not loaded?): %v", err)
	}
	d := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node",
		"--cluster-cidr", "10.251.19.0/24,fd00:251::/64")
	defer func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", tail(d.Output(), 4000))
		}
	}()
	waitFor(t, "web served", func() bool { return l.Curl("client", "http://10.96.0.10/") != "" })
	if !strings.Contains(d.Output(), "bridge-nf-call-iptables is not 1") {
		t.Fatalf("no warning about bridged replies")
	}
	seesOnly(t, l, "client", "http://10.96.0.10/", "10.251.19.1", 20)
	// An external client's reply is routed, not bridged: its own address.
	seesOnly(t, l, "ext", "http://203.0.113.10/", "192.168.50.2", 4)
	metrics := l.MustExec("node", "curl", "-s", "http://127.0.0.1:10249/metrics")
	var fallbacks int
	for _, line := range strings.Split(metrics, "\n") {
		if v, ok := strings.CutPrefix(line, `kube_userspace_proxy_backend_source_total{source="fallback"} `); ok {
			fallbacks, _ = strconv.Atoi(v)
		}
	}
	if fallbacks < 20 {
		t.Fatalf("/metrics counts %d fallbacks, want at least the 20 made:\n%s", fallbacks, grepLines(metrics, "backend_source"))
	}
	_ = d.Cmd.Process.Signal(syscall.SIGTERM)
	_ = d.Cmd.Wait()

	d = l.Daemon("--manifests", m, "--hostname-override", "node", "--cluster-cidr", "10.251.19.0/24", "--backend-source-address", "node")
	waitFor(t, "web served again", func() bool { return l.Curl("ext", "http://203.0.113.10/") != "" })
	seesOnly(t, l, "ext", "http://203.0.113.10/", "10.251.19.1", 4)
}

// grepLines is the lines of s that contain sub.
func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
