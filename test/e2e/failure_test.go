package e2e

// Failing endpoints in the lab, each a real misbehaving peer: a backend that
// accepts and never reads, one blackholed by a DROP rule in its own
// namespace, a dead UDP port (ICMP port unreachable); real clients (socat,
// curl, dig).

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

// splitSlices renders one EndpointSlice per (pod IP, port): endpoints of one
// Service on different target ports.
func splitSlices(name, portName, proto string, eps ...string) string {
	var b strings.Builder
	for i, ep := range eps {
		ip, port, _ := strings.Cut(ep, ":")
		fmt.Fprintf(&b, `---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-%[2]d, namespace: lab, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv4
ports: [{name: %[3]s, port: %[4]s, protocol: %[5]s}]
endpoints:
- {addresses: [%[6]s], nodeName: node}
`, name, i, portName, port, proto, ip)
	}
	return b.String()
}

// stuckService: lab/stuck on 10.96.0.20:80, its one endpoint pod1:9000, a
// server that accepts and never reads (backend --stall).
func stuckService(l *Lab) string {
	l.Start("pod1", filepath.Join(binDir, "backend"), "--tcp", "", "--udp", "", "--stall", ":9000")
	waitFor(l.t, "the stuck backend", func() bool {
		_, err := l.Exec("pod1", "socat", "-u", "/dev/null", "TCP:127.0.0.1:9000")
		return err == nil
	})
	return service("stuck", "ClusterIP", "10.96.0.20", "", `{name: t, port: 80, targetPort: 9000, protocol: TCP}`) +
		splitSlices("stuck", "t", "TCP", "10.251.19.12:9000")
}

// pushStuck starts a client that sends zeros through lab/stuck until every
// buffer is full, and waits until the daemon's connection stops moving.
func pushStuck(t *testing.T, l *Lab) {
	t.Helper()
	l.Start("client", "socat", "-u", "/dev/zero", "TCP:10.96.0.20:80")
	// Polled further apart than a second: the debug pages compute a new
	// answer at most once a second.
	testutil.WaitStalled(t, "the pushed connection to stall", 30*time.Second, 1200*time.Millisecond, func() int64 {
		_, body := l.get("node", "http://127.0.0.1:10249/debug/connections")
		var conns []struct {
			Service string `json:"service"`
			BytesUp int64  `json:"bytesUp"`
		}
		_ = json.Unmarshal([]byte(body), &conns)
		for _, c := range conns {
			if c.Service == "lab/stuck:t" {
				return c.BytesUp
			}
		}
		return -1
	})
}

// SIGTERM while a client pushes into a backend that stopped reading: the
// daemon exits within the grace period plus a little, and its rules go.
func TestSIGTERMWithStuckBackend(t *testing.T) {
	l := NewLab(t)
	const grace = 2 * time.Second
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, stuckService(l))
	d := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node", "--shutdown-grace", grace.String())
	waitFor(t, "the rules", func() bool { return countRules(t, l, `lab/stuck`) > 0 })
	pushStuck(t, l)
	start := time.Now()
	_ = d.Cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- d.Cmd.Wait() }()
	select {
	case err := <-done:
		took := time.Since(start)
		t.Logf("exited %v after SIGTERM (grace %v)", took.Round(time.Millisecond), grace)
		if err != nil {
			t.Fatalf("exit: %v\n%s", err, tail(d.Output(), 20))
		}
		// grace + 1 s is the bound; the extra second is for a loaded machine.
		if took > grace+2*time.Second {
			t.Errorf("exited %v after SIGTERM, want within grace (%v) + 1 s", took, grace)
		}
	case <-time.After(grace + 20*time.Second):
		t.Fatalf("still running %v after SIGTERM (grace %v)\n%s", grace+20*time.Second, grace, tail(d.Output(), 20))
	}
	if n := countRules(t, l, `lab/stuck`); n == 0 {
		t.Fatal("the rules went with the daemon: they stay until the next start or --cleanup")
	}
}

// The idle timeout closes a pair whose bytes stopped moving, although one
// side is blocked on a full buffer.
func TestIdleTimeoutWithStuckBackend(t *testing.T) {
	l := NewLab(t)
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, stuckService(l))
	d := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node", "--tcp-idle-timeout", "3s")
	waitFor(t, "the rules", func() bool { return countRules(t, l, `lab/stuck`) > 0 })
	pushStuck(t, l)
	stalled := time.Now()
	waitFor(t, "the idle pair to be closed", func() bool {
		return len(lines(d.Output(), "Connection closed", `cause="idle timeout"`, "lab/stuck:t")) == 1
	})
	if took := time.Since(stalled); took > 3*time.Second*5/4+3*time.Second {
		t.Errorf("closed %v after the stall was seen, want about the 3 s idle timeout", took)
	}
}

// One of two endpoints blackholed (a DROP rule in its namespace): at most two
// of 20 connections pay the first dial timeout, none fails.
func TestBlackholedEndpointEjected(t *testing.T) {
	l := NewLab(t)
	l.Backends()
	l.MustExec("pod2", "iptables", "-w", "-A", "INPUT", "-p", "tcp", "--dport", "9999", "-j", "DROP")
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, service("bh", "ClusterIP", "10.96.0.21", "", `{name: h, port: 80, protocol: TCP}`)+
		splitSlices("bh", "h", "TCP", "10.251.19.12:8080", "10.251.19.8:9999"))
	d := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node")
	waitFor(t, "the rules", func() bool { return countRules(t, l, `lab/bh`) > 0 })
	slow := 0
	for i := 0; i < 20; i++ {
		out, err := l.Exec("client", "curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{time_total}", "--max-time", "10", "http://10.96.0.21/")
		var code int
		var secs float64
		if _, serr := fmt.Sscanf(out, "%d %g", &code, &secs); err != nil || serr != nil || code != 200 {
			t.Fatalf("connection %d failed: %q %v\n%s", i, out, err, tail(d.Output(), 20))
		}
		if secs >= 0.25 {
			slow++
		}
	}
	// Which connections paid the timeout is the daemon's count of timed-out
	// dials (a loaded machine can make any curl slow).
	paid := metricSum(scrape(t, l), "kube_userspace_proxy_dial_failures_total", map[string]string{"endpoint": "10.251.19.8:9999", "reason": "timeout"})
	t.Logf("%v of 20 connections paid the 250 ms dial timeout (%d took 250 ms or more)", paid, slow)
	if paid < 1 || paid > 2 {
		t.Fatalf("%v of 20 connections paid the dial timeout, want 1 or 2", paid)
	}
	if !strings.Contains(d.Output(), "Endpoint ejected") {
		t.Fatal("no ejection logged")
	}
	// Seen on the debug page and in the metrics.
	if _, page := l.get(
		"node",
		"http://127.0.0.1:10249/debug/services?format=text",
	); !regexp.MustCompile(
		`10\.251\.19\.8:9999 .*EJECTED until`,
	).MatchString(
		page,
	) {
		t.Errorf("/debug/services does not show the ejection:\n%s", page)
	}
	if v := metricSum(scrape(t, l), "kube_userspace_proxy_endpoints_ejected", map[string]string{"endpoint": "10.251.19.8:9999"}); v != 1 {
		t.Errorf("kube_userspace_proxy_endpoints_ejected{endpoint=10.251.19.8:9999} = %v, want 1", v)
	}
}

// digAnswer runs one dig from the client namespace (a fresh source port) and
// returns whether it was answered, and in how many milliseconds.
func digAnswer(l *Lab, ns, server string, args ...string) (bool, int) {
	out, _ := l.Exec(ns, append([]string{"dig", "+tries=1", "+time=1", "@" + server, "q.test", "A"}, args...)...)
	if !strings.Contains(out, "192.0.2.1") {
		return false, 0
	}
	ms := 0
	if mm := regexp.MustCompile(`Query time: (\d+) msec`).FindStringSubmatch(out); mm != nil {
		ms, _ = strconv.Atoi(mm[1])
	}
	return true, ms
}

// One of two DNS endpoints dead (ICMP port unreachable): queries that went
// to it fail over with their datagram re-sent, so at least 19 of 20 fresh
// queries are answered within 1 s. Then 1000 answered queries to a healthy
// Service write no log line under the default --connection-log.
func TestDeadUDPEndpointAndQuietLog(t *testing.T) {
	l := NewLab(t)
	l.Start("pod1", filepath.Join(binDir, "backend"), "--name", "pod1", "--tcp", "", "--udp", "", "--dns", ":5353")
	waitFor(t, "the DNS backend", func() bool { ok, _ := digAnswer(l, "node", "10.251.19.12", "-p", "5353"); return ok })
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, service("dns", "ClusterIP", "10.96.0.22", "", `{name: d, port: 53, protocol: UDP}`)+
		splitSlices("dns", "d", "UDP", "10.251.19.12:5353", "10.251.19.8:5354")+"---\n"+
		service("dns2", "ClusterIP", "10.96.0.23", "", `{name: d, port: 53, protocol: UDP}`)+
		splitSlices("dns2", "d", "UDP", "10.251.19.12:5353"))
	d := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node", "--udp-timeout", "1s",
		"--log-level", "info")
	waitFor(t, "the rules", func() bool { return countRules(t, l, `lab/dns2`) > 0 })
	answered := 0
	for i := 0; i < 20; i++ {
		if ok, ms := digAnswer(l, "client", "10.96.0.22"); ok && ms < 1000 {
			answered++
		}
	}
	t.Logf("%d of 20 fresh queries answered within 1 s", answered)
	if answered < 19 {
		t.Fatalf("%d of 20 fresh queries answered within 1 s, want at least 19\n%s", answered, tail(d.Output(), 20))
	}
	if !strings.Contains(d.Output(), "Endpoint ejected") {
		t.Fatal("the dead UDP endpoint was not ejected")
	}

	batch := filepath.Join(t.TempDir(), "queries")
	if err := os.WriteFile(batch, []byte(strings.Repeat("@10.96.0.23 q.test A\n", 1000)), 0o644); err != nil {
		t.Fatal(err)
	}
	out := l.MustExec("client", "dig", "+tries=1", "+time=2", "+short", "-f", batch)
	if n := strings.Count(out, "192.0.2.1"); n != 1000 {
		t.Fatalf("%d of 1000 batch queries answered", n)
	}
	waitFor(t, "the flows to expire", func() bool {
		v := debugService(l, "lab/dns2:d")
		return v != nil && v.UDPFlows != nil && *v.UDPFlows == 0
	})
	if n := len(lines(d.Output(), "UDP flow closed", "lab/dns2:d")); n != 0 {
		t.Fatalf("%d log lines for 1000 answered queries, want none:\n%s", n, tail(d.Output(), 10))
	}
}

// lines returns the lines of out that contain every one of subs.
func lines(out string, subs ...string) []string {
	var found []string
	for _, line := range strings.Split(out, "\n") {
		all := true
		for _, s := range subs {
			all = all && strings.Contains(line, s)
		}
		if all {
			found = append(found, line)
		}
	}
	return found
}

// A UDP client on one fixed source port keeps getting answers across a
// Service's re-creation, an externalIP added and a daemon restart, and never
// reaches another Service that took the old listener port (a one-port
// --proxy-port-range forces the reuse).
func TestUDPConntrackFollowsListeners(t *testing.T) {
	l := NewLab(t)
	l.Backends()
	const src = 40053
	svcA := func(extra string) string {
		return service("a", "ClusterIP", "10.96.0.40", extra, `{name: d, port: 53, targetPort: 8080, protocol: UDP}`) +
			splitSlices("a", "d", "UDP", "10.251.19.12:8080")
	}
	svcC := service("c", "ClusterIP", "10.96.0.42", "", `{name: d, port: 53, targetPort: 8080, protocol: UDP}`) +
		splitSlices("c", "d", "UDP", "10.251.19.8:8080")
	m := filepath.Join(t.TempDir(), "m.yaml")
	args := []string{"--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node", "--proxy-port-range", "46000-46000"}
	writeManifest(t, m, svcA(""))
	d := l.Daemon(args...)
	defer func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", tail(d.Output(), 4000))
		}
	}()
	// answers: once the rules of a change are in place, the client on its
	// fixed port is answered again within about a second (a query may land
	// between the rule sync and the conntrack cleanup right after it).
	answers := func(step, want string) {
		t.Helper()
		start := time.Now()
		var got string
		for tries := 0; tries < 3; tries++ {
			if got = l.UDPFrom(src, "10.96.0.40", "53", step); got == want+":"+step {
				break
			}
		}
		took := time.Since(start)
		if got != want+":"+step || took > 2500*time.Millisecond {
			t.Fatalf("%s: got %q after %v, want %q within about 1 s\n%s", step, got, took, want+":"+step, tail(d.Output(), 15))
		}
	}
	if basicKernel {
		// No conntrack netlink: a datagram sent before the rule is in
		// keeps its entry (no NAT) as long as the client keeps sending from
		// its port, and nothing deletes it (docs/iptables.md). Seen on a
		// real kernel without the module, where the first write came late.
		waitFor(t, "A's rule", func() bool { return countRules(t, l, `-d 10\.96\.0\.40/32`) > 0 })
	}
	waitFor(t, "A served", func() bool { return l.UDPFrom(src, "10.96.0.40", "53", "hello") == "pod1:hello" })
	answers("steady", "pod1")

	// Re-created: gone (its rules with it), then back.
	writeManifest(t, m, svcC)
	if basicKernel {
		// No conntrack netlink: the client's entry is not deleted, and
		// keeps its REDIRECT to A's old port, now C's, while it keeps
		// sending — the hole docs/iptables.md states.
		waitFor(t, "A's rules gone", func() bool {
			return countRules(t, l, `-d 10\.96\.0\.40/32`) == 0 && countRules(t, l, `-d 10\.96\.0\.42/32`) > 0
		})
		waitFor(t, "the stale entry reaching C", func() bool { return strings.HasPrefix(l.UDPFrom(src, "10.96.0.40", "53", "stale"), "pod2") })
		return
	}
	waitFor(t, "A's rules gone", func() bool { return countRules(t, l, `lab/a:d`) == 0 && countRules(t, l, `lab/c:d`) > 0 })
	// C holds the only port now, A's old one: the client's old entry
	// would take it there.
	for i := 0; i < 3; i++ {
		if got := l.UDPFrom(src, "10.96.0.40", "53", "stale"); strings.HasPrefix(got, "pod2") {
			t.Fatalf("a datagram to the removed Service A reached Service C's backend: %q", got)
		}
	}
	writeManifest(t, m, svcA(""))
	waitFor(t, "A back", func() bool { return countRules(t, l, `lab/a:d`) > 0 })
	answers("recreated", "pod1")

	writeManifest(t, m, svcA("  externalIPs: [203.0.113.40]\n"))
	waitFor(t, "the externalIP's rule", func() bool { return countRules(t, l, `203\.0\.113\.40`) > 0 })
	answers("external-ip-added", "pod1")

	_ = d.Cmd.Process.Signal(syscall.SIGTERM)
	_ = d.Cmd.Wait()
	d = l.Daemon(args...)
	// The old daemon's rules stay (they refuse meanwhile): wait for the
	// new one's first write.
	waitFor(t, "A served again", func() bool { return strings.Contains(d.Output(), `msg="Rules written"`) })
	answers("restarted", "pod1")
}

// A flood of UDP source ports over 6 Services, on a daemon limited to 2048
// descriptors: the flows stay within their share of the budget, so TCP
// connections are still served quickly, rule syncs still work and /healthz
// stays 200.
func TestUDPFloodLeavesDescriptorsForTCP(t *testing.T) {
	l := NewLab(t)
	l.Backends()
	var content strings.Builder
	for i := 1; i <= 6; i++ {
		name := fmt.Sprintf("u%d", i)
		content.WriteString(service(name, "ClusterIP", fmt.Sprintf("10.96.1.%d", i), "", `{name: d, port: 53, targetPort: 8080, protocol: UDP}`))
		content.WriteString(splitSlices(name, "d", "UDP", "10.251.19.12:8080", "10.251.19.8:8080"))
		content.WriteString("---\n")
	}
	content.WriteString(service("web", "ClusterIP", "10.96.0.50", "", `{name: h, port: 80, targetPort: 8080, protocol: TCP}`))
	content.WriteString(splitSlices("web", "h", "TCP", "10.251.19.12:8080"))
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, content.String())
	d := l.Start("node", "prlimit", "--nofile=2048:2048", filepath.Join(binDir, "kube-userspace-proxy"),
		"--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node",
		"--admin-socket", filepath.Join(t.TempDir(), "admin.sock"), "--handover-socket", filepath.Join(t.TempDir(), "handover.sock"))
	waitFor(t, "the rules", func() bool { return countRules(t, l, `lab/web`) > 0 && countRules(t, l, `lab/u6`) > 0 })

	// 3000 client ports, 500 per Service: more flows than the UDP share
	// (960 of 2048) and than the descriptors left after it.
	err := cluster.InNetns(l.NS("client"), func() error {
		for i := 0; i < 3000; i++ {
			c, err := net.Dial("udp4", fmt.Sprintf("10.96.1.%d:53", i%6+1))
			if err != nil {
				return err
			}
			_, _ = c.Write([]byte("flood"))
			c.Close()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// While datagrams are still being read, each of the 6 read loops may
	// hold one flow over the share until its eviction; then it is kept.
	var open, share float64
	waitFor(t, "the flood's flows, within their share", func() bool {
		fams := scrape(t, l)
		open = metricSum(fams, "kube_userspace_proxy_udp_flows_open", nil)
		share = metricSum(fams, "kube_userspace_proxy_descriptor_budget", map[string]string{"use": "udp_flows"})
		if open > share+6 {
			t.Fatalf("%v UDP flows open, over their share of %v", open, share)
		}
		return open >= 900 && open <= share
	})
	t.Logf("%v UDP flows open, share %v", open, share)
	fast := 0
	for i := 0; i < 20; i++ {
		out, err := l.Exec("client", "curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{time_total}", "--max-time", "5", "http://10.96.0.50/")
		var code int
		var secs float64
		if _, serr := fmt.Sscanf(out, "%d %g", &code, &secs); err != nil || serr != nil || code != 200 {
			t.Fatalf("TCP connection %d during the flood: %q %v, want 200\n%s", i, out, err, tail(d.Output(), 10))
		}
		if secs < 0.1 {
			fast++
		}
	}
	// Under 100 ms each; a loaded machine may delay a curl or two by itself.
	t.Logf("%d of 20 TCP connections served in under 100 ms", fast)
	if fast < 18 {
		t.Fatalf("%d of 20 TCP connections served in under 100 ms, want (nearly) all", fast)
	}
	// Rule syncs still work: a Service added is served.
	content.WriteString("---\n" + service("late", "ClusterIP", "10.96.0.51", "", `{name: h, port: 80, targetPort: 8080, protocol: TCP}`) +
		splitSlices("late", "h", "TCP", "10.251.19.8:8080"))
	writeManifest(t, m, content.String())
	waitFor(t, "the added Service served", func() bool { return strings.HasPrefix(l.Curl("client", "http://10.96.0.51/"), "pod2") })
	if code, body := l.get("node", "http://127.0.0.1:10256/healthz"); code != 200 {
		t.Fatalf("/healthz %d during the flood: %s", code, body)
	}
	if strings.Contains(d.Output(), "too many open files") {
		t.Fatalf("the daemon ran out of descriptors:\n%s", tail(d.Output(), 10))
	}
}

// /healthz tells the truth: 503 while listeners cannot be opened (here a
// one-port --proxy-port-range for two Services), 200 once they can.
func TestHealthWhenListenersFail(t *testing.T) {
	l := NewLab(t)
	l.Backends()
	two := service("h1", "ClusterIP", "10.96.0.60", "", `{name: h, port: 80, targetPort: 8080, protocol: TCP}`) +
		splitSlices("h1", "h", "TCP", "10.251.19.12:8080") + "---\n" +
		service("h2", "ClusterIP", "10.96.0.61", "", `{name: h, port: 80, targetPort: 8080, protocol: TCP}`) +
		splitSlices("h2", "h", "TCP", "10.251.19.8:8080")
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, two)
	l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node", "--proxy-port-range", "46100-46100")
	waitFor(t, "/healthz 503 with a listener failing", func() bool {
		code, body := l.get("node", "http://127.0.0.1:10256/healthz")
		return code == 503 && strings.Contains(body, `"listenFailures":1`)
	})
	if v := metricSum(scrape(t, l), "kube_userspace_proxy_listener_failures", nil); v != 1 {
		t.Errorf("kube_userspace_proxy_listener_failures = %v, want 1", v)
	}
	// One Service goes: the other gets the port at a retry, and health is back.
	served := "h1"
	if countRules(t, l, `lab/h1`) == 0 {
		served = "h2"
	}
	keep := map[string]string{"h1": "h2", "h2": "h1"}[served]
	ip := map[string]string{"h1": "10.96.0.60", "h2": "10.96.0.61"}[keep]
	var rest strings.Builder
	for _, doc := range strings.Split(two, "---\n") {
		if strings.Contains(doc, "name: "+keep) || strings.Contains(doc, "service-name: "+keep) {
			rest.WriteString("---\n" + doc)
		}
	}
	writeManifest(t, m, rest.String())
	waitFor(t, "the other Service served", func() bool { return strings.HasPrefix(l.Curl("client", "http://"+ip+"/"), "pod") })
	waitFor(t, "/healthz 200", func() bool { code, _ := l.get("node", "http://127.0.0.1:10256/healthz"); return code == 200 })
}

// serviceJSON is what a test reads of one listener in /debug/services.
type serviceJSON struct {
	Service   string `json:"service"`
	Listen    string `json:"listen"`
	UDPFlows  *int   `json:"udpFlows"`
	Endpoints []struct {
		Address string `json:"address"`
		Ready   bool   `json:"ready"`
		Serving bool   `json:"serving"`
		Node    string `json:"node"`
	} `json:"endpoints"`
}

// debugServices reads the daemon's /debug/services (nil when it cannot).
func debugServices(l *Lab) []serviceJSON {
	_, body := l.get("node", "http://127.0.0.1:10249/debug/services")
	var views []serviceJSON
	if json.Unmarshal([]byte(body), &views) != nil {
		return nil
	}
	return views
}

// debugService is the first listener of a service port in /debug/services, or nil.
func debugService(l *Lab, service string) *serviceJSON {
	for _, v := range debugServices(l) {
		if v.Service == service {
			return &v
		}
	}
	return nil
}

// listenPort returns the listener address /debug/services shows for a
// service port, or "".
func listenPort(l *Lab, service string) string {
	if v := debugService(l, service); v != nil {
		return v.Listen
	}
	return ""
}

// The manifests file rewritten in place, in chunks with pauses, the way a
// slow `kubectl get -o yaml > f.yaml` writes it: no connection fails and the
// listener keeps its port.
func TestManifestRewrittenInPlaceInTheLab(t *testing.T) {
	l, _, m := startWeb(t, webManifest())
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	before := listenPort(l, "lab/web:http")
	content, err := os.ReadFile(m)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	failures := make(chan string, 1000)
	done := make(chan int)
	go func() {
		n := 0
		for {
			select {
			case <-stop:
				done <- n
				return
			default:
			}
			if body := l.Curl("client", "http://10.96.0.10:80/"); !strings.HasPrefix(body, "pod") {
				failures <- body
			}
			n++
		}
	}()
	for round := 0; round < 3; round++ {
		f, err := os.OpenFile(m, os.O_WRONLY|os.O_TRUNC, 0)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 4; i++ {
			time.Sleep(150 * time.Millisecond)
			if _, err := f.Write(content[len(content)*i/4 : len(content)*(i+1)/4]); err != nil {
				t.Fatal(err)
			}
		}
		f.Close()
		time.Sleep(300 * time.Millisecond)
	}
	time.Sleep(1500 * time.Millisecond) // past the settle time
	close(stop)
	n := <-done
	close(failures)
	var failed []string
	for f := range failures {
		failed = append(failed, f)
	}
	t.Logf("%d connections during 3 rewrites in place, %d failed", n, len(failed))
	if len(failed) > 0 {
		t.Fatalf("%d of %d connections failed during the rewrites (e.g. %q)", len(failed), n, failed[0])
	}
	if after := listenPort(l, "lab/web:http"); after != before {
		t.Fatalf("listener moved from %s to %s", before, after)
	}
}

// A UDP flood over one Service — 20 000 source ports, each a new flow,
// the daemon's UDP share of descriptors small — evicts that Service's own
// flows, not another's: a client of the other Service on one fixed port
// keeps its flow and its answers. The connection log stays bounded: the
// lines over its rate are counted, not written.
func TestUDPFloodStaysWithItsService(t *testing.T) {
	l := NewLab(t)
	l.Backends()
	other := service("other", "ClusterIP", "10.96.0.30", "", `{name: dns, port: 53, targetPort: 8080, protocol: UDP}`) +
		slices("other", `{name: dns, port: 8080, protocol: UDP}`, false)
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, webManifest()+"---\n"+other)
	// 2 000 descriptors: a UDP share of about 930 flows for all Services.
	d := l.Start("node", "prlimit", "--nofile=2000:2000", filepath.Join(binDir, "kube-userspace-proxy"),
		"--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node",
		"--admin-socket", filepath.Join(t.TempDir(), "admin.sock"), "--handover-socket", filepath.Join(t.TempDir(), "handover.sock"))
	udpReaches(t, l, "client", "10.96.0.30", "53")
	steady := func() string { return l.UDPFrom(12345, "10.96.0.30", "53", "steady") }
	var first string
	waitFor(t, "the steady client answered", func() bool { first = steady(); return strings.HasSuffix(first, ":steady") })
	flood := `import socket
for i in range(20000):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("10.251.19.20", 20000 + i))
    s.sendto(b"x", ("10.96.0.10", 53))
    s.close()
`
	if out, err := l.Exec("client", "python3", "-c", flood); err != nil {
		t.Fatalf("flood: %v\n%s", err, out)
	}
	waitFor(t, "the flood's evictions", func() bool { return strings.Contains(d.Output(), "cause=evicted") })
	for i := 0; i < 5; i++ {
		if got := steady(); got != first {
			t.Fatalf("the other Service's steady client after the flood: %q, want %q from its flow's endpoint", got, first)
		}
	}
	out := d.Output()
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, "cause=evicted") && strings.Contains(line, `service="lab/other:dns"`) {
			t.Errorf("the flood evicted the other Service's flow: %s", line)
		}
	}
	lines := strings.Count(out, "UDP flow closed")
	if lines > 2000 {
		t.Errorf("%d connection log lines for a flood of 20 000 flows: the log is not bounded", lines)
	}
	if !strings.Contains(out, "Connection log lines dropped") {
		t.Errorf("no line counts the dropped connection log lines (%d written)", lines)
	}
	t.Logf("%d connection log lines written for 20 000 flows", lines)
}

// getClosingFirst makes one HTTP/1.1 request to addr from ns and closes the
// connection itself once the answer is in, as a client with keep-alive does
// when it is done: the daemon then closes its backend connection first, and
// that side waits out TIME_WAIT in the node's namespace.
func getClosingFirst(ns, addr string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := cluster.DialContextIn(ns)(ctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(conn, "GET / HTTP/1.1\r\nHost: lab\r\n\r\n"); err != nil {
		return "", err
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return string(body), err
}

// The node runs out of local ports towards the endpoints — clients that
// close first leave the daemon's side of each backend connection in
// TIME_WAIT, 60 s — and the dials that fail say "no local port": the
// healthy endpoints are not ejected, one warning names the remedy, and once
// it is applied (tcp_tw_reuse) connections get through again, to both.
func TestNoLocalPortIsNotTheEndpoints(t *testing.T) {
	// 200 ports per endpoint instead of 28 232: a few seconds of load use
	// them up.
	l, d := fewPortsLab(t, "--proxy-port-range", "20000-20099")

	ok, failed := 0, 0
	for i := 0; i < 1000 && failed < 20; i++ {
		if _, err := getClosingFirst(l.NS("client"), "10.96.0.22:80"); err != nil {
			failed++
		} else {
			ok++
		}
	}
	t.Logf("%d connections answered before 20 failed", ok)
	if failed < 20 {
		t.Fatalf("1000 connections, %d failed: the node's 200 local ports per endpoint never ran out", failed)
	}
	fams := scrape(t, l)
	if v := metricSum(fams, "kube_userspace_proxy_dial_failures_total", map[string]string{"reason": "no local port"}); v < 20 {
		t.Errorf("dial failures for want of a local port: %v, want at least 20", v)
	}
	if v := metricSum(fams, "kube_userspace_proxy_dial_failures_total", map[string]string{"reason": "unreachable"}); v != 0 {
		t.Errorf("%v dials counted as unreachable endpoints", v)
	}
	if strings.Contains(d.Output(), "Endpoint ejected") {
		t.Errorf("a healthy endpoint was ejected for the node's own want of ports")
	}
	if n := strings.Count(d.Output(), "No local port left"); n != 1 {
		t.Errorf("%d warnings about local ports, want 1 (one a minute)", n)
	}

	// The remedy: reuse of ports in TIME_WAIT for new connections. Both
	// endpoints answer again as soon as the kernel allows it: it reuses a
	// port whose TIME_WAIT began two clock seconds ago or more (its
	// timestamp has a second's grain), so the ports the last second used
	// come back only as it passes, and a run of 40 may have to wait for it.
	l.MustExec("node", "sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1")
	var seen map[string]int
	waitFor(t, "40 connections in a row through lab/ports, to both endpoints", func() bool {
		seen = map[string]int{}
		for range 40 {
			body, err := getClosingFirst(l.NS("client"), "10.96.0.22:80")
			if err != nil {
				return false
			}
			name, _, _ := strings.Cut(body, " ")
			seen[name]++
		}
		return seen["pod1"] > 0 && seen["pod2"] > 0
	})
	if strings.Contains(d.Output(), "Endpoint ejected") {
		t.Errorf("a healthy endpoint was ejected for the node's own want of ports")
	}
}

// fewPortsLab is a lab whose node has 200 local ports of its own and no
// reuse of TIME_WAIT, serving lab/ports (10.96.0.22:80, two endpoints) with
// a daemon started with flags; it returns once a connection that closes
// first got through. The daemon's log is shown if the test fails.
func fewPortsLab(t *testing.T, flags ...string) (*Lab, *Proc) {
	t.Helper()
	l := NewLab(t)
	l.Backends()
	l.MustExec("node", "sysctl", "-qw", "net.ipv4.ip_local_port_range=61000 61199", "net.ipv4.tcp_tw_reuse=0")
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, service("ports", "ClusterIP", "10.96.0.22", "", `{name: h, port: 80, targetPort: 8080, protocol: TCP}`)+
		splitSlices("ports", "h", "TCP", "10.251.19.12:8080", "10.251.19.8:8080"))
	d := l.Daemon(append([]string{"--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node"}, flags...)...)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", tail(d.Output(), 4000))
		}
	})
	waitFor(t, "lab/ports served", func() bool { _, err := getClosingFirst(l.NS("client"), "10.96.0.22:80"); return err == nil })
	return l, d
}
