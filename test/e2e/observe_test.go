package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

// httpIn is an HTTP client whose connections are made in a lab namespace.
func (l *Lab) httpIn(ns string) *http.Client {
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: cluster.DialContextIn(l.NS(ns))}}
}

func (l *Lab) get(ns, url string) (int, string) {
	resp, err := l.httpIn(ns).Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	var b strings.Builder
	_, _ = bufio.NewReader(resp.Body).WriteTo(&b)
	return resp.StatusCode, b.String()
}

func TestHealthTurnsUnhealthyWhenRulesFail(t *testing.T) {
	dir := t.TempDir()
	marker := filepath.Join(dir, "fail")
	script := filepath.Join(dir, "restore.sh")
	os.WriteFile(script, []byte(fmt.Sprintf("#!/bin/sh\nif [ -e %s ]; then echo injected failure >&2; exit 1; fi\nexec iptables-restore \"$@\"\n", marker)), 0o755)
	l, d, m := startWeb(t, webManifest(), "--iptables-restore-command", script, "--sync-period", "2s")
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	health := func() int { code, _ := l.get("node", "http://127.0.0.1:10256/healthz"); return code }
	waitFor(t, "healthy", func() bool { return health() == 200 })
	code, body := l.get("node", "http://127.0.0.1:10256/livez")
	var h map[string]any
	if err := json.Unmarshal([]byte(body), &h); err != nil || code != 200 || h["healthy"] != true || h["lastUpdated"] == nil || h["currentTime"] == nil {
		t.Fatalf("livez %d %q", code, body)
	}

	os.WriteFile(marker, nil, 0o644)
	writeManifest(t, m, webManifest()+"---\n"+service("extra", "ClusterIP", "10.96.0.50", "", `{name: http, port: 80, protocol: TCP}`))
	waitFor(t, "unhealthy after a failed sync", func() bool { return health() == 503 })
	// The health address is the network's: it says unhealthy, not why.
	if _, body := l.get("node", "http://127.0.0.1:10256/healthz"); strings.Contains(body, "injected failure") {
		t.Errorf("the health address gives internal errors to the network: %s", body)
	}
	if _, body := l.get("node", "http://127.0.0.1:10249/healthz"); !strings.Contains(body, "injected failure") {
		t.Errorf("the metrics address's /healthz does not say why: %s", body)
	}
	os.Remove(marker)
	waitFor(t, "healthy again", func() bool { return health() == 200 })
	if !strings.Contains(d.Output(), "injected failure") {
		t.Fatal("the failure was not logged")
	}
}

// An iptables-restore that hangs: /healthz turns unhealthy once the change
// it holds has waited 2 × --sync-period, and SIGTERM still ends the daemon
// within its bound (the grace), the hung commands killed.
func TestHungRuleWrite(t *testing.T) {
	dir := t.TempDir()
	hang, pids := filepath.Join(dir, "hang"), filepath.Join(dir, "pids")
	script := filepath.Join(dir, "restore.sh")
	os.WriteFile(script, []byte(fmt.Sprintf("#!/bin/sh\nif [ -e %s ]; then echo $$ >> %s; exec sleep 600; fi\nexec iptables-restore \"$@\"\n", hang, pids)), 0o755)
	const grace = time.Second
	l, d, m := startWeb(t, webManifest(), "--iptables-restore-command", script, "--sync-period", "1s", "--shutdown-grace", grace.String())
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	health := func() int { code, _ := l.get("node", "http://127.0.0.1:10256/healthz"); return code }
	waitFor(t, "healthy", func() bool { return health() == 200 })

	os.WriteFile(hang, nil, 0o644)
	changed := time.Now()
	writeManifest(t, m, webManifest()+"---\n"+service("extra", "ClusterIP", "10.96.0.50", "", `{name: http, port: 80, protocol: TCP}`))
	waitFor(t, "the write to hang", func() bool { _, err := os.Stat(pids); return err == nil })
	waitFor(t, "unhealthy while the write hangs", func() bool { return health() == 503 })
	// 2 × --sync-period after the change, with room for a loaded machine.
	if took := time.Since(changed); took > 2*time.Second+5*time.Second {
		t.Errorf("unhealthy %v after the change, want about 2 s", took)
	}
	if code, _ := l.get("node", "http://127.0.0.1:10256/livez"); code != 503 {
		t.Errorf("/livez %d while a change waits for its rules, want 503", code)
	}

	start := time.Now()
	_ = d.Cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- d.Cmd.Wait() }()
	// The grace, and 5 s for a loaded machine (the rules stay: nothing
	// is removed at exit).
	bound := grace + 5*time.Second
	select {
	case <-done:
		t.Logf("exited %v after SIGTERM", time.Since(start).Round(time.Millisecond))
	case <-time.After(bound):
		t.Fatalf("still running %v after SIGTERM with a hung iptables-restore\n%s", bound, tail(d.Output(), 20))
	}
	if !strings.Contains(d.Output(), "killed") {
		t.Errorf("the log does not say the hung command was killed:\n%s", tail(d.Output(), 20))
	}
	data, _ := os.ReadFile(pids)
	for _, f := range strings.Fields(string(data)) {
		var pid int
		fmt.Sscan(f, &pid)
		waitFor(t, fmt.Sprintf("hung iptables-restore %d to be gone", pid), func() bool { return syscall.Kill(pid, 0) != nil })
	}
}

func scrape(t *testing.T, l *Lab) map[string]*dto.MetricFamily {
	t.Helper()
	code, body := l.get("node", "http://127.0.0.1:10249/metrics")
	if code != 200 {
		t.Fatalf("/metrics: %d %s", code, body)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return fams
}

// metricSum adds the values of a family's series whose labels include match.
func metricSum(fams map[string]*dto.MetricFamily, name string, match map[string]string) float64 {
	f := fams[name]
	if f == nil {
		return -1
	}
	var sum float64
	for _, m := range f.Metric {
		ok := true
		for k, v := range match {
			found := false
			for _, lp := range m.Label {
				found = found || (lp.GetName() == k && lp.GetValue() == v)
			}
			ok = ok && found
		}
		if !ok {
			continue
		}
		switch {
		case m.Counter != nil:
			sum += m.Counter.GetValue()
		case m.Gauge != nil:
			sum += m.Gauge.GetValue()
		case m.Histogram != nil:
			sum += float64(m.Histogram.GetSampleCount())
		}
	}
	return sum
}

func TestMetricsLogsAndDebugPages(t *testing.T) {
	dead := service("dead", "ClusterIP", "10.96.0.60", "", `{name: http, port: 80, protocol: TCP}`) + `---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dead, namespace: lab, labels: {kubernetes.io/service-name: dead}}
addressType: IPv4
ports: [{name: http, port: 9999}]
endpoints: [{addresses: [10.251.19.12]}, {addresses: [10.251.19.8]}]
`
	empty := service("empty", "ClusterIP", "10.96.0.61", "", `{name: http, port: 80, protocol: TCP}`)
	l, d, _ := startWeb(t, webManifest()+"---\n"+dead+"---\n"+empty, "--connection-log", "all", "--log-format", "json", "--udp-max-flows", "1")
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	before := scrape(t, l)

	// One request whose bytes we know, as curl counts them.
	out := l.MustExec("client", "curl", "-s", "-o", "/dev/null", "-w", "%{size_request} %{size_header} %{size_download} %{local_port}", "http://10.96.0.10:80/")
	var up, hdr, body, port int
	fmt.Sscan(out, &up, &hdr, &body, &port)
	udpReaches(t, l, "client", "10.96.0.10", "53")
	udpReaches(t, l, "ext", "192.168.50.1", "31341") // a second UDP client: evicts the first flow
	l.Exec("client", "curl", "-s", "--max-time", "3", "http://10.96.0.60/")
	// Without endpoints: refused at connect, never accepted (so no
	// no-endpoints reset is counted for it).
	if ok, out := l.tcpRefused("client", "10.96.0.61", "80"); !ok {
		t.Errorf("a Service without endpoints: %s, want connection refused", out)
	}

	var line map[string]any
	waitFor(t, "the connection's log line", func() bool {
		for _, raw := range strings.Split(d.Output(), "\n") {
			var e map[string]any
			if json.Unmarshal([]byte(raw), &e) == nil && e["msg"] == "Connection closed" && e["client"] == fmt.Sprintf("10.251.19.20:%d", port) {
				line = e
				return true
			}
		}
		return false
	})
	for k, want := range map[string]any{"service": "lab/web:http", "origDst": "10.96.0.10:80", "protocol": "TCP",
		"bytesUp": float64(up), "bytesDown": float64(hdr + body), "cause": "client closed", "reason": "round-robin", "attempts": float64(1)} {
		if line[k] != want {
			t.Errorf("log field %s = %v, want %v (line %v)", k, line[k], want, line)
		}
	}
	for _, k := range []string{"endpoint", "dialLatency", "duration"} {
		if line[k] == nil || line[k] == "" {
			t.Errorf("log field %s missing: %v", k, line)
		}
	}

	after := scrape(t, l)
	web := map[string]string{"service": "lab/web:http"}
	for _, m := range []struct {
		name  string
		match map[string]string
	}{
		{"kube_userspace_proxy_connections_accepted_total", web},
		{"kube_userspace_proxy_bytes_total", map[string]string{"service": "lab/web:http", "direction": "in"}},
		{"kube_userspace_proxy_bytes_total", map[string]string{"service": "lab/web:http", "direction": "out"}},
		{"kube_userspace_proxy_bytes_total", map[string]string{"service": "lab/web:dns", "protocol": "UDP"}},
		{"kube_userspace_proxy_dial_attempts_total", web},
		{"kube_userspace_proxy_dial_failures_total", map[string]string{"service": "lab/dead:http"}},
		{"kube_userspace_proxy_retries_total", map[string]string{"service": "lab/dead:http"}},
		{"kube_userspace_proxy_udp_flows_evicted_total", map[string]string{"service": "lab/web:dns"}},
		{"kube_userspace_proxy_connection_duration_seconds", web},
	} {
		if a, b := metricSum(after, m.name, m.match), metricSum(before, m.name, m.match); a <= b || a <= 0 {
			t.Errorf("%s%v did not move: %v -> %v", m.name, m.match, b, a)
		}
	}
	// Per-protocol series only: no TCP connection counts for a UDP port,
	// no UDP flow counts for a TCP one.
	for _, c := range []struct{ name, service string }{
		{"kube_userspace_proxy_connections_accepted_total", "lab/web:dns"},
		{"kube_userspace_proxy_connections_active", "lab/web:dns"},
		{"kube_userspace_proxy_connection_duration_seconds", "lab/web:dns"},
		{"kube_userspace_proxy_udp_flows_active", "lab/web:http"},
		{"kube_userspace_proxy_udp_flows_evicted_total", "lab/web:http"},
	} {
		if f := after[c.name]; f != nil {
			for _, m := range f.Metric {
				for _, lp := range m.Label {
					if lp.GetName() == "service" && lp.GetValue() == c.service {
						t.Errorf("%s has a series for %s, a port of the other protocol", c.name, c.service)
					}
				}
			}
		}
	}
	for _, name := range []string{"kubeproxy_sync_proxy_rules_duration_seconds", "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
		"kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", "kubeproxy_network_programming_duration_seconds",
		"kubeproxy_sync_proxy_rules_service_changes_total", "kubeproxy_sync_proxy_rules_iptables_total",
		"kube_userspace_proxy_udp_flows_active"} {
		if metricSum(after, name, nil) <= 0 {
			t.Errorf("%s is missing or zero", name)
		}
	}
	for _, name := range []string{"kubeproxy_sync_proxy_rules_endpoint_changes_total", "kubeproxy_sync_proxy_rules_service_changes_pending",
		"kubeproxy_sync_proxy_rules_endpoint_changes_pending", "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
		"kube_userspace_proxy_connections_active"} {
		if after[name] == nil {
			t.Errorf("%s is not exported", name)
		}
	}

	// A live connection shows in the table, and leaves it when closed.
	conn, err := cluster.DialContextIn(l.NS("client"))(context.Background(), "tcp", "10.96.0.10:80")
	if err != nil {
		t.Fatal(err)
	}
	live := func() bool {
		_, body := l.get("node", "http://127.0.0.1:10249/debug/connections")
		return strings.Contains(body, conn.LocalAddr().String())
	}
	waitFor(t, "the connection in /debug/connections", live)
	if _, text := l.get(
		"node",
		"http://127.0.0.1:10249/debug/connections?format=text",
	); !strings.Contains(text, "SENT TO") ||
		!strings.Contains(text, "10.96.0.10:80") {
		t.Errorf("text table:\n%s", text)
	}
	conn.Close()
	waitFor(t, "the connection to leave the table", func() bool { return !live() })

	if _, svcs := l.get(
		"node",
		"http://127.0.0.1:10249/debug/services?format=text",
	); !strings.Contains(svcs, "lab/web:http") ||
		!strings.Contains(svcs, "10.251.19.12:8080(ready,serving)") {
		t.Errorf("/debug/services:\n%s", svcs)
	}
	// The JSON has structured fields, not packed strings.
	views := debugServices(l)
	found := false
	for _, v := range views {
		for _, e := range v.Endpoints {
			found = found || (v.Service == "lab/web:http" && e.Address == "10.251.19.12:8080" && e.Ready && e.Serving && e.Node == "node")
		}
	}
	if !found {
		t.Errorf("/debug/services JSON lacks lab/web:http's endpoint 10.251.19.12:8080 as a structured object: %+v", views)
	}
	portal := `-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "lab/web:http"`
	if basicKernel {
		portal = `-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j REDIRECT` // no comment match
	}
	if _, rules := l.get("node", "http://127.0.0.1:10249/debug/rules"); !strings.Contains(rules, portal) {
		t.Errorf("/debug/rules:\n%s", rules)
	}
	if code, _ := l.get("node", "http://127.0.0.1:10249/debug/pprof/"); code == 200 {
		t.Error("pprof served without --profiling")
	}
	// Metrics and debug pages stay on the node; health is for everyone.
	if code, _ := l.get("ext", "http://192.168.50.1:10249/metrics"); code != 0 {
		t.Errorf("/metrics reachable from another namespace: %d", code)
	}
	if code, _ := l.get("ext", "http://192.168.50.1:10256/healthz"); code != 200 {
		t.Errorf("/healthz not reachable from another namespace: %d", code)
	}
}

// SIGTERM: listeners close, open connections drain, and the rules stay (as
// kube-proxy's): ClusterIP traffic is refused on this node, never sent out
// by the default route, until the next start serves again within 3 s;
// --cleanup removes them.
func TestSIGTERMDrainsAndKeepsRules(t *testing.T) {
	l, d, m := startWeb(t, webManifest(), "--shutdown-grace", "20s")
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	// A keep-alive connection open through the ClusterIP: one transport
	// connection, reused because every body is read to the end.
	client := l.httpIn("client")
	client.Transport.(*http.Transport).MaxConnsPerHost = 1
	get := func() error {
		resp, err := client.Get("http://10.96.0.10:80/")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		_, err = io.Copy(io.Discard, resp.Body)
		return err
	}
	if err := get(); err != nil {
		t.Fatal(err)
	}
	if err := get(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_ = d.Cmd.Process.Signal(syscall.SIGTERM)
	waitFor(t, "listeners closed", func() bool { return strings.Count(d.Output(), "Listener closed") == 4 })
	// New connections are refused at once (the rules point at closed ports)...
	out, err := l.Exec("ext", "curl", "-s", "--max-time", "10", "http://192.168.50.1:31341/")
	if err == nil || !strings.Contains(fmt.Sprint(err), "exit status 7") {
		t.Errorf("a new connection during the drain: %v %q, want curl's 'connection refused' (exit 7)", err, out)
	}
	// ...while the open one still works.
	if err := get(); err != nil {
		t.Fatalf("the open connection broke during the drain: %v\n%s", err, d.Output())
	}
	if countRules(t, l, `lab/web`) == 0 {
		t.Fatal("rules removed while a connection drains")
	}
	client.CloseIdleConnections()
	done := make(chan error, 1)
	go func() { done <- d.Cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("exit: %v\n%s", err, d.Output())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the daemon did not exit after its last connection closed")
	}
	if time.Since(start) > 19*time.Second {
		t.Error("the daemon waited the whole grace period although its connection closed")
	}
	if countRules(t, l, `lab/web`) == 0 {
		t.Fatal("the rules went with the daemon")
	}
	if ok, out := l.tcpRefused("client", "10.96.0.10", "80"); !ok {
		t.Errorf("the ClusterIP with no daemon: %s, want connection refused", out)
	}
	// The next start serves within 3 s with the rules already in place.
	restart := time.Now()
	d2 := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node")
	testutil.WaitFor(t, "the next start serving", 3*time.Second, 20*time.Millisecond, func() bool {
		return strings.HasPrefix(l.Curl("client", "http://10.96.0.10:80/"), "pod")
	})
	t.Logf("served again %v after the start", time.Since(restart).Round(time.Millisecond))
	_ = d2.Cmd.Process.Signal(syscall.SIGTERM)
	_ = d2.Cmd.Wait()
	if out, err := l.Exec("node", filepath.Join(binDir, "kube-userspace-proxy"), "--cleanup"); err != nil {
		t.Fatalf("--cleanup: %v\n%s", err, out)
	}
	if n := countRules(t, l, `KUBE-`); n != 0 {
		t.Fatalf("%d rules of ours left after --cleanup", n)
	}
}

// As kube-proxy: the conntrack timeouts are set in the node's own network
// namespace (a CLOSE_WAIT entry lives an hour, not the kernel's minute),
// the host-wide table size is left to the host, and /proxyMode names the
// mode on the metrics address.
func TestConntrackSysctlsAndProxyMode(t *testing.T) {
	hostCloseWait, err := os.ReadFile("/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait")
	if err != nil {
		t.Fatalf("nf_conntrack is not loaded on this machine: %v", err)
	}
	l, d, _ := startWeb(t, webManifest())
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	sysctl := func(name string) string {
		return strings.TrimSpace(l.MustExec("node", "cat", "/proc/sys/net/netfilter/"+name))
	}
	if got := sysctl("nf_conntrack_tcp_timeout_close_wait"); got != "3600" {
		t.Errorf("node's nf_conntrack_tcp_timeout_close_wait = %s, want 3600", got)
	}
	if got := sysctl("nf_conntrack_tcp_timeout_established"); got != "86400" {
		t.Errorf("node's nf_conntrack_tcp_timeout_established = %s, want 86400", got)
	}
	if after, _ := os.ReadFile("/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait"); string(after) != string(hostCloseWait) {
		t.Errorf("the host's close_wait timeout changed from %q to %q", hostCloseWait, after)
	}
	if !strings.Contains(d.Output(), "host-wide and read-only in this network namespace") {
		t.Errorf("no line says the table size was left to the host:\n%s", d.Output())
	}
	if code, body := l.get("node", "http://127.0.0.1:10249/proxyMode"); code != 200 || body != "userspace" {
		t.Errorf("/proxyMode: %d %q, want 200 \"userspace\"", code, body)
	}
}

// A drain is made on the root-only admin socket, and logged with the
// peer's credentials. On the metrics address it is refused (any local
// process reaches that), as is a rebinding-shaped request there, and a
// process that is not root cannot use the socket.
func TestDrainOnTheAdminSocket(t *testing.T) {
	l, d, _ := startWeb(t, webManifest())
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	const path = "/debug/drain?service=lab/web:http&endpoint=10.251.19.12:8080"
	tcp := func(headers ...string) string {
		args := []string{"-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST", "-H", "X-Kube-Userspace-Proxy: drain"}
		for _, h := range headers {
			args = append(args, "-H", h)
		}
		out, _ := l.Exec("node", append(append([]string{"curl"}, args...), "http://127.0.0.1:10249"+path)...)
		return out
	}
	if got := tcp(); got != "403" {
		t.Errorf("a drain on the metrics address: %q, want 403", got)
	}
	if got := tcp("Host: evil.example:10249", "Origin: http://evil.example:10249"); got != "421" {
		t.Errorf("a rebinding-shaped drain: %q, want 421", got)
	}
	socket := []string{"curl", "-s", "-w", " %{http_code}", "--unix-socket", l.AdminSocket, "-X", "POST",
		"-H", "X-Kube-Userspace-Proxy: drain", "http://localhost" + path}
	out, _ := l.Exec("node", append([]string{"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"}, socket...)...)
	if strings.Contains(out, `"drained"`) {
		t.Fatalf("a user other than root drained: %q", out)
	}
	if strings.Contains(d.Output(), "Drain changed") {
		t.Fatalf("a refused drain was applied:\n%s", d.Output())
	}
	out, _ = l.Exec("node", socket...)
	if !strings.HasSuffix(out, " 200") || !strings.Contains(out, `"drained": true`) {
		t.Fatalf("root's drain on the admin socket: %q", out)
	}
	waitFor(t, "the drain logged with its peer", func() bool {
		for _, line := range strings.Split(d.Output(), "\n") {
			if strings.Contains(line, "Drain changed") && strings.Contains(line, `peer="uid 0 pid `) && strings.Contains(line, `endpoint="10.251.19.12:8080"`) {
				return true
			}
		}
		return false
	})
	// Drained: new connections go to the other pod only.
	for i := 0; i < 4; i++ {
		if got := l.Curl("client", "http://10.96.0.10:80/"); !strings.HasPrefix(got, "pod2") {
			t.Fatalf("connection %d after the drain reached %q, want pod2", i, got)
		}
	}
}

// kubeProxyMetrics are the metrics kube-proxy v1.37.2 exports
// (pkg/proxy/metrics, component-base's build info) that this proxy
// measures too, with kube-proxy's label names: dashboards and alerts
// written for kube-proxy read them unchanged.
var kubeProxyMetrics = map[string][]string{
	"kubeproxy_sync_proxy_rules_duration_seconds":                        {"ip_family"},
	"kubeproxy_sync_full_proxy_rules_duration_seconds":                   {"ip_family"},
	"kubeproxy_sync_partial_proxy_rules_duration_seconds":                {"ip_family"},
	"kubeproxy_sync_proxy_rules_last_timestamp_seconds":                  {"ip_family"},
	"kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds":           {"ip_family"},
	"kubeproxy_network_programming_duration_seconds":                     {"ip_family"},
	"kubeproxy_sync_proxy_rules_endpoint_changes_pending":                {},
	"kubeproxy_sync_proxy_rules_endpoint_changes_total":                  {},
	"kubeproxy_sync_proxy_rules_service_changes_pending":                 {},
	"kubeproxy_sync_proxy_rules_service_changes_total":                   {},
	"kubeproxy_sync_proxy_rules_iptables_restore_failures_total":         {"ip_family"},
	"kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total": {"ip_family"},
	"kubeproxy_sync_proxy_rules_iptables_total":                          {"table", "ip_family"},
	"kubeproxy_sync_proxy_rules_iptables_last":                           {"table", "ip_family"},
	"kubeproxy_sync_proxy_rules_no_local_endpoints_total":                {"traffic_policy", "ip_family"},
	"kubeproxy_proxy_healthz_total":                                      {"code"},
	"kubeproxy_proxy_livez_total":                                        {"code"},
	"kubeproxy_conntrack_reconciler_deleted_entries_total":               {"ip_family"},
	"kubernetes_build_info": {"build_date", "compiler", "git_commit", "git_tree_state", "git_version", "go_version",
		"major", "minor", "platform"},
}

// Every kube-proxy metric we measure is exported under kube-proxy's name
// with exactly kube-proxy's label names, ip_family saying IPv4 or IPv6.
func TestKubeProxyMetricNamesAndLabels(t *testing.T) {
	l, d, m := startWeb(t, webManifest())
	defer func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", tail(d.Output(), 3000))
		}
	}()
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	// A partial sync (one port changed), and the health server's answers.
	writeManifest(t, m, strings.Replace(webManifest(), "- {addresses: [10.251.19.8], nodeName: node}\n", "", 1))
	waitFor(t, "pod2 gone from the ClusterIP", func() bool {
		for i := 0; i < 4; i++ {
			if strings.HasPrefix(l.Curl("client", "http://10.96.0.10:80/"), "pod2") {
				return false
			}
		}
		return true
	})
	for _, path := range []string{"/healthz", "/livez"} {
		if code, body := l.get("node", "http://127.0.0.1:10256"+path); code != 200 {
			t.Fatalf("%s: %d %s", path, code, body)
		}
	}
	var fams map[string]*dto.MetricFamily
	waitFor(t, "a partial sync in the metrics", func() bool {
		fams = scrape(t, l)
		return metricSum(fams, "kubeproxy_sync_partial_proxy_rules_duration_seconds", map[string]string{"ip_family": "IPv4"}) > 0
	})
	for name, want := range kubeProxyMetrics {
		f := fams[name]
		if f == nil || len(f.Metric) == 0 {
			t.Errorf("%s: not exported", name)
			continue
		}
		for _, s := range f.Metric {
			var got []string
			for _, lp := range s.Label {
				got = append(got, lp.GetName())
				if lp.GetName() == "ip_family" && lp.GetValue() != "IPv4" && lp.GetValue() != "IPv6" {
					t.Errorf("%s: ip_family %q", name, lp.GetValue())
				}
			}
			sort.Strings(got)
			w := append([]string(nil), want...)
			sort.Strings(w)
			if strings.Join(got, ",") != strings.Join(w, ",") {
				t.Errorf("%s: labels %v, kube-proxy's are %v", name, got, w)
			}
		}
	}
	for _, c := range []struct {
		name  string
		match map[string]string
	}{
		{"kubeproxy_proxy_healthz_total", map[string]string{"code": "200"}},
		{"kubeproxy_proxy_livez_total", map[string]string{"code": "200"}},
		{"kubeproxy_sync_full_proxy_rules_duration_seconds", map[string]string{"ip_family": "IPv6"}},
		{"kubeproxy_sync_proxy_rules_iptables_total", map[string]string{"table": "nat", "ip_family": "IPv6"}},
		{"kubernetes_build_info", nil},
	} {
		if v := metricSum(fams, c.name, c.match); v <= 0 {
			t.Errorf("%s%v = %v, want > 0", c.name, c.match, v)
		}
	}
}
