package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

// service renders a Service and its EndpointSlices for the lab's two pods.
// extra is spliced into the spec (indented two spaces).
func service(name, typ, clusterIPs, extra, ports string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: %[1]s, namespace: lab}
spec:
  type: %[2]s
  clusterIP: %[3]s
  clusterIPs: [%[3]s]
%[4]s  ports: [%[5]s]
`, name, typ, strings.Split(clusterIPs, ",")[0], extra, ports)
}

func slices(name, portSpec string, v6 bool) string {
	s := fmt.Sprintf(`---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-v4, namespace: lab, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv4
ports: [%[2]s]
endpoints:
- {addresses: [10.251.19.12], nodeName: node}
- {addresses: [10.251.19.8], nodeName: node}
`, name, portSpec)
	if v6 {
		s += fmt.Sprintf(`---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-v6, namespace: lab, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv6
ports: [%[2]s]
endpoints:
- {addresses: ["fd00:251::12"], nodeName: node}
- {addresses: ["fd00:251::8"], nodeName: node}
`, name, portSpec)
	}
	return s
}

const webPorts = `{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 31341}, {name: dns, port: 53, targetPort: 8080, protocol: UDP, nodePort: 31341}`
const webSlicePorts = `{name: http, port: 8080, protocol: TCP}, {name: dns, port: 8080, protocol: UDP}`

// webManifest: lab/web, NodePort, ClusterIP 10.96.0.10 (+ fd00:96::10),
// externalIP 203.0.113.10, LoadBalancer IP 203.0.113.11, TCP and UDP.
func webManifest() string {
	return service("web", "LoadBalancer", "10.96.0.10,fd00:96::10",
		"  clusterIPs: [10.96.0.10, \"fd00:96::10\"]\n  ipFamilies: [IPv4, IPv6]\n  externalIPs: [203.0.113.10]\n", webPorts) +
		"status: {loadBalancer: {ingress: [{ip: 203.0.113.11}]}}\n" + slices("web", webSlicePorts, true)
}

func writeManifest(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// startWeb brings up a lab with backends and the daemon serving content.
func startWeb(t *testing.T, content string, args ...string) (*Lab, *Proc, string) {
	l := NewLab(t)
	l.Backends()
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, strings.ReplaceAll(content, "clusterIPs: [10.96.0.10]\n  clusterIPs:", "clusterIPs:"))
	d := l.Daemon(append([]string{"--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node"}, args...)...)
	return l, d, m
}

// reachesBoth fetches url until both pods answered.
func reachesBoth(t *testing.T, l *Lab, ns, url string) {
	t.Helper()
	seen := map[string]bool{}
	waitFor(t, ns+" → "+url+" reaching both pods", func() bool {
		body := l.Curl(ns, url)
		if f := strings.Fields(body); len(f) > 0 {
			seen[f[0]] = true
		}
		return seen["pod1"] && seen["pod2"]
	})
}

func udpReaches(t *testing.T, l *Lab, ns, host, port string) {
	t.Helper()
	waitFor(t, fmt.Sprintf("UDP %s → %s:%s", ns, host, port), func() bool {
		r := l.UDP(ns, host, port, "ping")
		return r == "pod1:ping" || r == "pod2:ping"
	})
}

func TestAllServiceAddressesByTraffic(t *testing.T) {
	l, d, _ := startWeb(t, webManifest())
	defer func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", d.Output())
		}
	}()
	// ClusterIP from a pod and from the node itself.
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	reachesBoth(t, l, "node", "http://10.96.0.10:80/")
	udpReaches(t, l, "client", "10.96.0.10", "53")
	udpReaches(t, l, "node", "10.96.0.10", "53")
	// NodePort from the external client and from the node (its own address and loopback).
	reachesBoth(t, l, "ext", "http://192.168.50.1:31341/")
	reachesBoth(t, l, "node", "http://192.168.50.1:31341/")
	reachesBoth(t, l, "node", "http://127.0.0.1:31341/")
	reachesBoth(t, l, "client", "http://10.251.19.1:31341/")
	udpReaches(t, l, "ext", "192.168.50.1", "31341")
	udpReaches(t, l, "node", "127.0.0.1", "31341")
	// externalIP and LoadBalancer IP.
	reachesBoth(t, l, "ext", "http://203.0.113.10:80/")
	reachesBoth(t, l, "ext", "http://203.0.113.11:80/")
	reachesBoth(t, l, "node", "http://203.0.113.10:80/")
	udpReaches(t, l, "ext", "203.0.113.11", "53")
	// IPv6 ClusterIP and NodePort.
	reachesBoth(t, l, "client", "http://[fd00:96::10]:80/")
	reachesBoth(t, l, "node", "http://[fd00:96::10]:80/")
	udpReaches(t, l, "client", "fd00:96::10", "53")
	reachesBoth(t, l, "ext", "http://[fd00:50::1]:31341/")

	// Every rule carries its service port as a comment (none without the
	// comment match).
	save := l.MustExec("node", "iptables-save", "-t", "nat")
	want := `-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "lab/web:http" -m tcp --dport 80 -j REDIRECT`
	if basicKernel {
		want = `-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j REDIRECT`
	}
	if !strings.Contains(save, want) {
		t.Fatalf("ClusterIP rule not in the expected form %q:\n%s", want, save)
	}
}

// --nodeport-addresses limits NodePorts to the node addresses in its
// CIDRs; "primary" (kube-proxy's keyword) to the node's primary addresses,
// with --manifests those the default routes leave from (192.168.50.1 and
// fd00:50::1 here).
func TestNodePortAddressesLimit(t *testing.T) {
	t.Run("cidr", func(t *testing.T) { nodePortAddressesLimit(t, "192.168.50.0/24") })
	t.Run("primary", func(t *testing.T) { nodePortAddressesLimit(t, "primary") })
}

func nodePortAddressesLimit(t *testing.T, flag string) {
	l, d, _ := startWeb(t, webManifest(), "--nodeport-addresses", flag)
	defer func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", d.Output())
		}
	}()
	reachesBoth(t, l, "ext", "http://192.168.50.1:31341/")
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	if body := l.Curl("client", "http://10.251.19.1:31341/"); body != "" {
		t.Fatalf("NodePort answered on 10.251.19.1, outside --nodeport-addresses: %q", body)
	}
	if body := l.Curl("node", "http://127.0.0.1:31341/"); body != "" {
		t.Fatalf("NodePort answered on 127.0.0.1, outside --nodeport-addresses: %q", body)
	}
}

// countRules returns how many lines of iptables-save and ip6tables-save match re.
func countRules(t *testing.T, l *Lab, re string) int {
	t.Helper()
	n := 0
	if basicKernel {
		re = l.bareRulePattern(re)
	}
	rx := regexp.MustCompile(re)
	for _, bin := range []string{"iptables-save", "ip6tables-save"} {
		for _, line := range strings.Split(l.MustExec("node", bin), "\n") {
			if rx.MatchString(line) {
				n++
			}
		}
	}
	return n
}

func TestServiceRemovalRemovesRules(t *testing.T) {
	other := service("other", "ClusterIP", "10.96.0.20", "", `{name: http, port: 80, protocol: TCP}`) +
		slices("other", `{name: http, port: 8080, protocol: TCP}`, false)
	l, _, m := startWeb(t, webManifest()+"---\n"+other)
	reachesBoth(t, l, "client", "http://10.96.0.20:80/")
	if n := countRules(t, l, `lab/other:http`); n != 2 {
		t.Fatalf("%d rules for lab/other, want 2 (container + host)", n)
	}
	writeManifest(t, m, webManifest())
	waitFor(t, "lab/other's rules to go", func() bool { return countRules(t, l, `lab/other`) == 0 })
	if body := l.Curl("client", "http://10.96.0.20:80/"); body != "" {
		t.Fatalf("removed service still answers: %q", body)
	}
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
}

// jumpComment is the comment match of the daemon's jump rules: none on
// the basic kernel, whose rules carry no comments.
func jumpComment(text string) []string {
	if basicKernel {
		return nil
	}
	return []string{"-m", "comment", "--comment", text}
}

func TestRulesRepairedAfterFlush(t *testing.T) {
	l, d, _ := startWeb(t, webManifest(), "--sync-period", "2s")
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	before := countRules(t, l, `KUBE-`)
	rulesBefore := l.MustExec("node", "iptables-save") + l.MustExec("node", "ip6tables-save")
	l.MustExec("node", "iptables", "-w", "-t", "nat", "-F", "KUBE-PORTALS-CONTAINER")
	l.MustExec("node", append(append([]string{"iptables", "-w", "-t", "nat", "-D", "OUTPUT"},
		jumpComment("handle ClusterIPs; NOTE: this must be before the NodePort rules")...), "-j", "KUBE-PORTALS-HOST")...)
	l.MustExec("node", "ip6tables", "-w", "-t", "nat", "-F", "KUBE-NODEPORT-CONTAINER")
	if body := l.Curl("client", "http://10.96.0.10:80/"); body != "" {
		t.Fatalf("still served right after the flush: %q", body)
	}
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	reachesBoth(t, l, "node", "http://10.96.0.10:80/")
	// Waited for by hand, so that a timeout shows what is missing.
	deadline := time.Now().Add(20 * time.Second)
	for n := countRules(t, l, `KUBE-`); n != before; n = countRules(t, l, `KUBE-`) {
		if time.Now().After(deadline) {
			t.Fatalf("20 s after the flush %d of our rules stand, %d before it\nbefore:\n%s\nnow:\n%s%s\nthe daemon's log:\n%s", n, before,
				rulesBefore, l.MustExec("node", "iptables-save"), l.MustExec("node", "ip6tables-save"), tail(d.Output(), 8000))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(d.Output(), "Rules changed behind our back") {
		t.Fatal("the repair was not logged")
	}
}

// A second copy of a jump (another tool, a hand edit) is found by the
// periodic check and removed, once: the check then finds nothing to repair.
func TestDuplicateJumpRemoved(t *testing.T) {
	l, d, _ := startWeb(t, webManifest(), "--sync-period", "1s")
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	l.MustExec("node", append(append([]string{"iptables", "-w", "-t", "nat", "-A", "OUTPUT"},
		jumpComment("handle ClusterIPs; NOTE: this must be before the NodePort rules")...), "-j", "KUBE-PORTALS-HOST")...)
	waitFor(t, "one jump into KUBE-PORTALS-HOST again", func() bool {
		return strings.Count(l.MustExec("node", "iptables-save", "-t", "nat"), "-j KUBE-PORTALS-HOST\n") == 1
	})
	repairs := strings.Count(d.Output(), "Rules changed behind our back")
	time.Sleep(2500 * time.Millisecond) // two more periodic checks; nothing to wait for
	if n := strings.Count(d.Output(), "Rules changed behind our back"); n != repairs {
		t.Fatalf("the check kept finding drift after the repair (%d repairs, then %d)", repairs, n)
	}
	reachesBoth(t, l, "node", "http://10.96.0.10:80/")
}

// TestNoDriftWithoutChanges proves the periodic check finds the rules it
// wrote equal to the live ones (else it would rewrite them every period).
func TestNoDriftWithoutChanges(t *testing.T) {
	l, d, _ := startWeb(t, webManifest(), "--sync-period", "1s")
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	time.Sleep(3500 * time.Millisecond) // three periodic checks; nothing to wait for
	if strings.Contains(d.Output(), "Rules changed behind our back") {
		t.Fatalf("periodic check saw drift on untouched rules:\n%s", d.Output())
	}
}

func TestKill9RestartLeavesOneCopy(t *testing.T) {
	l, d, m := startWeb(t, webManifest())
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	before := l.MustExec("node", "iptables-save")
	// The portal rule's packet counter: a chain the restarted daemon finds
	// as it wants it is not written again, and keeps its counters.
	portalPackets := func() int {
		m := regexp.MustCompile(
			`(?m)^\[(\d+):\d+\] -A KUBE-PORTALS-CONTAINER -d 10\.96\.0\.10/32 `,
		).FindStringSubmatch(
			l.MustExec("node", "iptables-save", "-c", "-t", "nat"),
		)
		if m == nil {
			t.Fatalf("no portal rule for 10.96.0.10:\n%s", l.MustExec("node", "iptables-save", "-t", "nat"))
		}
		n, _ := strconv.Atoi(m[1])
		return n
	}
	counted := portalPackets()
	if counted == 0 {
		t.Fatal("no packet counted by the portal rule; the test proves nothing")
	}
	_ = d.Cmd.Process.Signal(syscall.SIGKILL)
	_ = d.Cmd.Wait()
	d2 := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node")
	waitFor(t, "restarted daemon serving", func() bool { return strings.Contains(d2.Output(), "Listening") })
	if n := portalPackets(); n < counted {
		t.Errorf("the portal rule counts %d packets after the restart, %d before: its chain was written again", n, counted)
	}
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	after := l.MustExec("node", "iptables-save")
	norm := func(s string) []string {
		var out []string
		for _, line := range strings.Split(s, "\n") {
			if strings.HasPrefix(line, "-A ") {
				out = append(out, regexp.MustCompile(`--to-ports \d+|--dport \d{5} -m conntrack`).ReplaceAllString(line, "PORT"))
			}
		}
		return out
	}
	if b, a := norm(before), norm(after); len(a) != len(b) {
		t.Fatalf("%d rules before kill -9, %d after restart:\n%s", len(b), len(a), after)
	}
	for _, jump := range []string{"-j KUBE-PORTALS-CONTAINER", "-j KUBE-PORTALS-HOST", "-j KUBE-NODEPORT-CONTAINER", "-j KUBE-NODEPORT-HOST",
		"-j KUBE-PORTALS-GUARD"} {
		want := 1
		if basicKernel && jump == "-j KUBE-PORTALS-GUARD" {
			want = 0 // no conntrack match: the daemon guards the ports
		}
		if n := strings.Count(after, jump+"\n"); n != want {
			t.Errorf("%q appears %d times, want %d", jump, n, want)
		}
	}
}

func TestCleanupLeavesNoTrace(t *testing.T) {
	l, d, _ := startWeb(t, webManifest())
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	_ = d.Cmd.Process.Signal(syscall.SIGKILL) // as after a crash: everything still installed
	_ = d.Cmd.Wait()
	if countRules(t, l, `KUBE-`) == 0 {
		t.Fatal("no rules to clean up; the test proves nothing")
	}
	for i := 0; i < 2; i++ { // twice: the second run must be a harmless no-op
		l.MustExec("node", filepath.Join(binDir, "kube-userspace-proxy"), "--cleanup")
	}
	if n := countRules(t, l, `KUBE-`); n != 0 {
		t.Fatalf("%d lines mention KUBE- after --cleanup:\n%s", n, l.MustExec("node", "iptables-save"))
	}
}

// A chain of someone else's that jumps to one of ours makes that one chain
// undeletable, and the one-transaction cleanup fails as a whole: --cleanup
// then removes everything else, and names what it could not.
func TestCleanupRemovesWhatItCan(t *testing.T) {
	l, d, _ := startWeb(t, webManifest())
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	_ = d.Cmd.Process.Signal(syscall.SIGKILL)
	_ = d.Cmd.Wait()
	l.MustExec("node", "iptables", "-w", "-t", "nat", "-N", "SOMEONE-ELSE")
	l.MustExec("node", "iptables", "-w", "-t", "nat", "-A", "SOMEONE-ELSE", "-j", "KUBE-PORTALS-HOST")
	out, err := l.Exec("node", filepath.Join(binDir, "kube-userspace-proxy"), "--cleanup")
	if err == nil || !strings.Contains(out, "KUBE-PORTALS-HOST") {
		t.Fatalf("--cleanup: %v, want an error naming the chain it could not delete:\n%s", err, out)
	}
	var left []string
	for _, line := range strings.Split(l.MustExec("node", "iptables-save")+l.MustExec("node", "ip6tables-save"), "\n") {
		if strings.Contains(line, "KUBE-") {
			left = append(left, line)
		}
	}
	// What remains: the referenced chain (declared, now empty) and the
	// other program's jump to it.
	if len(left) != 2 {
		t.Fatalf("after --cleanup, want only KUBE-PORTALS-HOST and the jump to it:\n%s", strings.Join(left, "\n"))
	}
	l.MustExec("node", "iptables", "-w", "-t", "nat", "-F", "SOMEONE-ELSE")
	l.MustExec("node", filepath.Join(binDir, "kube-userspace-proxy"), "--cleanup")
	if n := countRules(t, l, `KUBE-`); n != 0 {
		t.Fatalf("%d lines mention KUBE- after the second --cleanup", n)
	}
}

func TestClusterIPOnlyNotReachableViaProxyPort(t *testing.T) {
	internal := service("internal", "ClusterIP", "10.96.0.30", "", `{name: http, port: 80, protocol: TCP}`) +
		slices("internal", `{name: http, port: 8080, protocol: TCP}`, false)
	l, d, _ := startWeb(t, internal)
	reachesBoth(t, l, "client", "http://10.96.0.30:80/")
	m := regexp.MustCompile(`msg=Listening .*listen=(\d+).*service="?lab/internal`).FindStringSubmatch(d.Output())
	if m == nil {
		t.Fatalf("no listener port in the log:\n%s", d.Output())
	}
	if body := l.Curl("ext", "http://192.168.50.1:"+m[1]+"/"); body != "" {
		t.Fatalf("ClusterIP-only service reached from outside via proxy port %s: %q", m[1], body)
	}
	// The node itself may still use it directly (loopback is not guarded).
	if body := l.Curl("node", "http://127.0.0.1:"+m[1]+"/"); body == "" {
		t.Fatal("the proxy port is not reachable from the node itself")
	}
}

func TestClusterIPOnlyUDPNotReachableViaProxyPort(t *testing.T) {
	internal := service("internal", "ClusterIP", "10.96.0.30", "", `{name: dns, port: 53, protocol: UDP}`) +
		slices("internal", `{name: dns, port: 8080, protocol: UDP}`, false)
	l, d, _ := startWeb(t, internal)
	udpReaches(t, l, "client", "10.96.0.30", "53")
	m := regexp.MustCompile(`msg=Listening .*listen=(\d+).*service="?lab/internal`).FindStringSubmatch(d.Output())
	if m == nil {
		t.Fatalf("no listener port in the log:\n%s", d.Output())
	}
	for i := 0; i < 3; i++ {
		r := l.UDP("ext", "192.168.50.1", m[1], "ping")
		switch {
		case basicKernel && r == "":
			// Without conntrack netlink nothing tells a direct flow from a
			// redirected one: the documented hole, which the start line names.
			t.Fatalf("on the basic kernel the UDP proxy port %s should answer other hosts, as docs/iptables.md says; it did not", m[1])
		case !basicKernel && r != "":
			t.Fatalf("ClusterIP-only UDP service reached from outside via proxy port %s: %q", m[1], r)
		}
	}
	if basicKernel && !strings.Contains(grepLines(d.Output(), "level=warning msg=Started "), "UDP proxy ports of ClusterIP-only Services answer other hosts") {
		t.Error("the start line does not say that the UDP proxy ports are open")
	}
	if r := l.UDP("node", "127.0.0.1", m[1], "ping"); r == "" {
		t.Fatal("the UDP proxy port is not reachable from the node itself")
	}
}

func TestNodePortConflictIsReported(t *testing.T) {
	taken := service("taken", "NodePort", "10.96.0.40", "", `{name: http, port: 80, protocol: TCP, nodePort: 31999}`) +
		slices("taken", `{name: http, port: 8080, protocol: TCP}`, false)
	l := NewLab(t)
	l.Backends()
	holder := l.Start("node", "nc", "-l", "-k", "31999") // another process holds the NodePort
	waitFor(t, "nc listening", func() bool {
		out, _ := l.Exec("node", "ss", "-ltn", "sport = :31999")
		return strings.Contains(out, "LISTEN")
	})
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, webManifest()+"---\n"+taken)
	d := l.Daemon("--manifests", m, "--min-sync-period", "100ms")
	waitFor(t, "the conflict reported", func() bool {
		return strings.Contains(d.Output(), "NodePort 31999/TCP is already in use by another process")
	})
	reachesBoth(t, l, "ext", "http://192.168.50.1:31341/") // other services unaffected
	reachesBoth(t, l, "client", "http://10.96.0.40:80/")   // the conflicting service's ClusterIP still works
	if n := countRules(t, l, `--dport 31999`); n != 0 {
		t.Fatalf("%d rules redirect the NodePort another process owns", n)
	}
	if code, body := l.get("node", "http://127.0.0.1:10256/healthz"); code != 200 {
		t.Errorf("/healthz %d %s: one Service's NodePort conflict is not the daemon's ill health", code, body)
	}
	if v := metricSum(scrape(t, l), "kube_userspace_proxy_nodeport_conflicts", nil); v != 1 {
		t.Errorf("kube_userspace_proxy_nodeport_conflicts = %v, want 1", v)
	}
	// The other process exits: the NodePort is taken back within one sync
	// period (the retries back off from 1 s up to --sync-period, 30 s).
	_ = holder.Cmd.Process.Kill()
	_ = holder.Cmd.Wait()
	freed := time.Now()
	testutil.WaitFor(t, "the NodePort served", 40*time.Second, 100*time.Millisecond, func() bool {
		return strings.HasPrefix(l.Curl("ext", "http://192.168.50.1:31999/"), "pod")
	})
	t.Logf("NodePort served %v after its holder exited", time.Since(freed).Round(time.Millisecond))
	if !strings.Contains(d.Output(), "NodePort taken back") {
		t.Error("no log line says the NodePort was taken back")
	}
}

// On basic netfilter (no comment, addrtype or conntrack match) every
// address of a Service is served, and the proxy ports are guarded by the
// daemon instead of the filter table: another host that connects to a
// ClusterIP-only Service's TCP listener port at the node's address is
// reset before any byte reaches a backend, and its datagrams to the UDP
// listener port are dropped (asked of conntrack netlink once per flow),
// each counted and logged with its address; the node itself reaches both,
// and a NodePort's listener, which sits on the NodePort, serves other
// hosts as it should. The start line names every missing piece.
func TestBasicNetfilterOnly(t *testing.T) {
	plain := "---\n" + service("plain", "ClusterIP", "10.96.0.30", "", `{name: http, port: 80, targetPort: 8080, protocol: TCP}, {name: dns, port: 53, targetPort: 8080, protocol: UDP}`) +
		slices("plain", `{name: http, port: 8080, protocol: TCP}, {name: dns, port: 8080, protocol: UDP}`, false)
	l, d, _ := startWeb(t, webManifest()+plain, "--iptables-basic-only", "--connection-log", "all")
	reachesBoth(t, l, "client", "http://10.96.0.30:80/")
	udpReaches(t, l, "client", "10.96.0.30", "53")
	listenPort := func(portName string) string {
		for _, line := range strings.Split(grepLines(d.Output(), `service="lab/plain:`+portName+`"`), "\n") {
			if _, v, ok := strings.Cut(line, " listen="); ok && strings.Contains(line, "msg=Listening") {
				return strings.Fields(v)[0]
			}
		}
		t.Fatalf("no listener port for lab/plain:%s in the log:\n%s", portName, tail(d.Output(), 3000))
		return ""
	}
	port, udpPort := listenPort("http"), listenPort("dns")
	direct := "http://192.168.50.1:" + port + "/"
	// Reset at once after the handshake: curl reports it as a failed
	// connect (7) or a reset (56); either way nothing is served.
	if out, err := l.Exec("ext", "curl", "-s", "-S", "--max-time", "3", direct); err == nil || strings.Contains(out, "pod") ||
		!strings.Contains(out, "Couldn't connect") && !strings.Contains(out, "reset") {
		t.Errorf("another host at the node's address and the listener port %s: %q %v, want a reset", port, out, err)
	}
	if got := l.Curl("node", direct); !strings.HasPrefix(got, "pod") {
		t.Errorf("the node itself at its address and the listener port: %q", got)
	}
	waitFor(t, "the reset logged with the peer", func() bool {
		return strings.Contains(grepLines(d.Output(), "Reset a connection from another host"), "peer=\"192.168.50.2:")
	})
	// No backend saw it: its record ends without an endpoint or a dial.
	for _, line := range strings.Split(grepLines(d.Output(), `client="192.168.50.2:`), "\n") {
		if strings.Contains(line, "msg=\"Connection closed\"") && (!strings.Contains(line, `cause="not redirected"`) || strings.Contains(line, "endpoint=")) {
			t.Errorf("the direct connection reached further than the accept:\n%s", line)
		}
	}
	// UDP: no answer to another host, from one port or many; the node
	// itself is answered at the same address and port. Without conntrack
	// netlink (the basic kernel) nothing tells the flows apart: another
	// host is answered, as the start line says.
	answered := func(got string) bool { return got == "pod1:direct" || got == "pod2:direct" }
	for i := range 3 {
		if got := l.UDPFrom(40000+i, "192.168.50.1", udpPort, "direct"); answered(got) != basicKernel {
			t.Errorf("another host at the node's address and the UDP listener port %s: answered %q (conntrack netlink: %v)", udpPort, got, !basicKernel)
		}
	}
	if got := l.UDP("ext", "192.168.50.1", udpPort, "direct"); answered(got) != basicKernel {
		t.Errorf("another host (ext) at the UDP listener port %s: answered %q (conntrack netlink: %v)", udpPort, got, !basicKernel)
	}
	if got := l.UDP("node", "192.168.50.1", udpPort, "ping"); got != "pod1:ping" && got != "pod2:ping" {
		t.Errorf("the node itself at its address and the UDP listener port: %q", got)
	}
	udpReaches(t, l, "client", "10.96.0.30", "53")
	metrics := l.MustExec("node", "curl", "-s", "http://127.0.0.1:10249/metrics")
	if !strings.Contains(metrics, "kube_userspace_proxy_unredirected_connections_reset_total 1") {
		t.Errorf("/metrics does not count the reset:\n%s", grepLines(metrics, "unredirected"))
	}
	fams := scrape(t, l)
	dropped := metricSum(fams, "kube_userspace_proxy_unredirected_datagrams_dropped_total", nil)
	switch {
	case basicKernel && dropped != 0:
		t.Errorf("kube_userspace_proxy_unredirected_datagrams_dropped_total = %v without conntrack netlink", dropped)
	case !basicKernel && dropped < 4:
		t.Errorf("kube_userspace_proxy_unredirected_datagrams_dropped_total = %v, want the 4 datagrams (or more: nc's retries)", dropped)
	case !basicKernel && !strings.Contains(grepLines(d.Output(), "Dropped a UDP flow from another host"), "peer=\""):
		t.Error("no line says a direct UDP flow was dropped")
	}
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	reachesBoth(t, l, "node", "http://10.96.0.10:80/")
	udpReaches(t, l, "client", "10.96.0.10", "53")
	reachesBoth(t, l, "ext", "http://192.168.50.1:31341/")
	reachesBoth(t, l, "node", "http://127.0.0.1:31341/")
	for _, bin := range []string{"iptables-save", "ip6tables-save"} {
		save := l.MustExec("node", bin)
		for _, extra := range []string{"comment", "addrtype", "conntrack", "KUBE-PORTALS-GUARD"} {
			if strings.Contains(save, extra) {
				t.Errorf("%s uses %s in basic mode:\n%s", bin, extra, save)
			}
		}
	}
	// One start line names each missing piece with its cost; no piece
	// that is there is named.
	started := grepLines(d.Output(), "level=warning msg=Started ")
	t.Logf("the start line: %s", started)
	for _, want := range []string{"no comment-match: ", "no addrtype-match: ", "no conntrack-match: the proxy ports are guarded by the daemon"} {
		if !strings.Contains(started, want) {
			t.Errorf("the start line lacks %q:\n%s", want, started)
		}
	}
	if nl := strings.Contains(started, "no conntrack-netlink: "); nl != basicKernel {
		t.Errorf("the start line names conntrack netlink missing: %v, want %v:\n%s", nl, basicKernel, started)
	}
	if basicKernel && !strings.Contains(started, "UDP proxy ports of ClusterIP-only Services answer other hosts") {
		t.Errorf("the start line does not say that the UDP proxy ports are open:\n%s", started)
	}
	for _, piece := range []string{"comment-match", "addrtype-match", "conntrack-match"} {
		if v := metricSum(fams, "kube_userspace_proxy_kernel_piece_available", map[string]string{"piece": piece}); v != 0 {
			t.Errorf("kube_userspace_proxy_kernel_piece_available{piece=%q} = %v, want 0", piece, v)
		}
	}
}

func TestMissingIptablesIsReported(t *testing.T) {
	l := NewLab(t)
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, webManifest())
	out, err := l.Exec("node", "env", "PATH=/nonexistent", filepath.Join(binDir, "kube-userspace-proxy"), "--manifests", m)
	if err == nil {
		t.Fatalf("started without iptables:\n%s", out)
	}
	if !strings.Contains(out, "iptables not found in PATH (install the iptables package)") {
		t.Fatalf("message does not say what is missing:\n%s", out)
	}
}

// Without CAP_NET_ADMIN (root without the capability, as a container without
// it runs) the daemon says what it lacks, not that a kernel module is
// missing, and leaves the node as it was: no reserved ports, no chains.
func TestWithoutNetAdminSaysSo(t *testing.T) {
	l := NewLab(t)
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, webManifest())
	reserved := func() string {
		return strings.TrimSpace(l.MustExec("node", "cat", "/proc/sys/net/ipv4/ip_local_reserved_ports"))
	}
	before := reserved()
	out, err := l.Exec("node", "setpriv", "--bounding-set=-net_admin", "--inh-caps=-net_admin",
		filepath.Join(binDir, "kube-userspace-proxy"), "--manifests", m, "--healthz-bind-address", "", "--metrics-bind-address", "")
	if err == nil {
		t.Fatalf("started without CAP_NET_ADMIN:\n%s", out)
	}
	if !strings.Contains(out, "needs CAP_NET_ADMIN") || strings.Contains(out, "kernel needs") {
		t.Fatalf("message does not say that the capability is missing:\n%s", out)
	}
	if after := reserved(); after != before {
		t.Fatalf("ip_local_reserved_ports changed from %q to %q by a daemon that could not start", before, after)
	}
	if n := countRules(t, l, `KUBE-`); n != 0 {
		t.Fatalf("%d rules of ours left by a daemon that could not start", n)
	}
}

// bulkManifest: lab/web plus n ClusterIP Services bulk-0 … bulk-(n-1) on
// 10.97.x.y, except those in skip.
func bulkManifest(n int, skip ...int) string {
	var b strings.Builder
	b.WriteString(webManifest())
	left := map[int]bool{}
	for _, s := range skip {
		left[s] = true
	}
	for i := 0; i < n; i++ {
		if left[i] {
			continue
		}
		name := fmt.Sprintf("bulk-%d", i)
		b.WriteString("---\n" + service(name, "ClusterIP", bulkIP(i), "", `{name: http, port: 80, protocol: TCP}`) +
			slices(name, `{name: http, port: 8080, protocol: TCP}`, false))
	}
	return b.String()
}

func bulkIP(i int) string { return fmt.Sprintf("10.97.%d.%d", i/250, i%250+1) }

// From leafMax (16) service addresses on, the portal chains are trees of
// destination-prefix chains: traffic, removal, the way back to flat chains
// and --cleanup all work with them, and the guard stays two rules.
func TestRuleTreesAtScale(t *testing.T) {
	l, d, m := startWeb(t, bulkManifest(1000))
	defer func() {
		if t.Failed() {
			t.Logf("daemon log (tail):\n%s", tail(d.Output(), 4000))
		}
	}()
	waitFor(t, "the last bulk Service answering", func() bool { return l.Curl("client", "http://"+bulkIP(999)+":80/") != "" })
	reachesBoth(t, l, "client", "http://"+bulkIP(500)+":80/")
	reachesBoth(t, l, "node", "http://"+bulkIP(3)+":80/")
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	if n := countRules(t, l, `^-A KUBE-PORTALS-CONTAINER `); n > 4 {
		t.Fatalf("%d rules in KUBE-PORTALS-CONTAINER at 1000 services, want a few jumps into the tree", n)
	}
	if n := countRules(t, l, `^-A KUBE-PT-[0-9A-F]+ -d 10\.97\.0\.8/32 .*"lab/bulk-7:http"`); n != 1 {
		t.Fatalf("%d rules for lab/bulk-7 in a tree chain, want 1", n)
	}
	wantGuard := 4 // tcp and udp, IPv4 and IPv6
	if basicKernel {
		wantGuard = 0 // the daemon guards the ports (docs/iptables.md)
	}
	if n := countRules(t, l, `^-A KUBE-PORTALS-GUARD `); n != wantGuard {
		t.Fatalf("%d guard rules at 1000 services, want %d", n, wantGuard)
	}

	writeManifest(t, m, bulkManifest(1000, 7))
	waitFor(t, "lab/bulk-7's rules to go", func() bool { return countRules(t, l, `"lab/bulk-7:http"`) == 0 })
	if body := l.Curl("client", "http://"+bulkIP(7)+":80/"); body != "" {
		t.Fatalf("removed service still answers: %q", body)
	}
	reachesBoth(t, l, "client", "http://"+bulkIP(8)+":80/")

	// Few services: flat chains again, and no tree chain is left.
	writeManifest(t, m, webManifest())
	waitFor(t, "the tree chains to go", func() bool { return countRules(t, l, `^:KUBE-PT-`) == 0 })
	if n := countRules(t, l, `^-A KUBE-PORTALS-CONTAINER -d 10\.96\.0\.10/32 .*"lab/web:http"`); n != 1 {
		t.Fatalf("%d rules for lab/web in the flat KUBE-PORTALS-CONTAINER, want 1", n)
	}
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	if strings.Contains(d.Output(), "Rules changed behind our back") || strings.Contains(d.Output(), "rewriting all rules") {
		t.Fatalf("the partial updates did not apply cleanly:\n%s", tail(d.Output(), 4000))
	}

	// And --cleanup finds tree chains after a crash.
	writeManifest(t, m, bulkManifest(1000))
	waitFor(t, "the tree back", func() bool { return countRules(t, l, `^:KUBE-PT-`) > 10 })
	_ = d.Cmd.Process.Signal(syscall.SIGKILL)
	_ = d.Cmd.Wait()
	l.MustExec("node", filepath.Join(binDir, "kube-userspace-proxy"), "--cleanup")
	if n := countRules(t, l, `KUBE-`); n != 0 {
		t.Fatalf("%d lines mention KUBE- after --cleanup", n)
	}
}

// serviceInPattern is a Service's name in a countRules pattern, the way
// its rules' comments carry it: "lab/web:http", lab/stuck.
var serviceInPattern = regexp.MustCompile(`"?lab/[a-z0-9-]+(:[a-z0-9-]+)?"?`)

// bareRulePattern rewrites re for the rules of a kernel without the comment
// match, which carry no Service names: a Service's rules are the ones that
// redirect to its listener ports, which the daemons of the lab logged
// ("Listening … listen=PORT … service=…"). The name must end the pattern's
// part that follows the rule's other matches, as every caller's does.
func (l *Lab) bareRulePattern(re string) string {
	loc := serviceInPattern.FindStringIndex(re)
	if loc == nil {
		return re
	}
	name := strings.Trim(re[loc[0]:loc[1]], `"`)
	matches := func(service string) bool { return service == name }
	if !strings.Contains(name, ":") {
		matches = func(service string) bool { return strings.HasPrefix(service, name+":") } // every port
	}
	l.mu.Lock()
	outs := append([]*testutil.Buffer(nil), l.nodeOut...)
	l.mu.Unlock()
	listening := regexp.MustCompile(`msg=Listening .*listen=(\d+) protocol=(\w+) .*service="?([^" ]+)`)
	ports := map[string]map[string]bool{} // by protocol, as the rules write it
	for _, out := range outs {
		for _, m := range listening.FindAllStringSubmatch(out.String(), -1) {
			if matches(m[3]) {
				proto := strings.ToLower(m[2])
				if ports[proto] == nil {
					ports[proto] = map[string]bool{}
				}
				ports[proto][m[1]] = true
			}
		}
	}
	if len(ports) == 0 {
		return `^\b$` // no listener: no rule
	}
	var alts []string
	for proto, set := range ports {
		var ps []string
		for p := range set {
			ps = append(ps, p)
		}
		alts = append(alts, `-p `+proto+` .*(--to-ports |--to-destination \S+:)(`+strings.Join(ps, "|")+`)`)
	}
	return re[:loc[0]] + `.*(` + strings.Join(alts, "|") + `)( |$)` + re[loc[1]:]
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// Rules an earlier version left behind (32 shard chains, a guard jump for
// every packet) are replaced at start, not kept beside the new ones.
func TestEarlierLayoutReplaced(t *testing.T) {
	l := NewLab(t)
	l.Backends()
	l.MustExec("node", "iptables", "-w", "-N", "KUBE-PORTALS-GUARD")
	l.MustExec("node", "iptables", "-w", "-N", "KUBE-PORTALS-GUARD-1F")
	l.MustExec("node", "iptables", "-w", "-A", "KUBE-PORTALS-GUARD", "-j", "KUBE-PORTALS-GUARD-1F")
	l.MustExec("node", "iptables", "-w", "-A", "KUBE-PORTALS-GUARD-1F", "!", "-i", "lo", "-p", "tcp", "--dport", "8080", "-j", "DROP")
	l.MustExec(
		"node",
		append(
			append([]string{"iptables", "-w", "-I", "INPUT"}, jumpComment("keep proxy ports reachable only through service addresses")...),
			"-j",
			"KUBE-PORTALS-GUARD",
		)...)
	l.MustExec("node", "iptables", "-w", "-t", "nat", "-N", "KUBE-PORTALS-CONTAINER")
	l.MustExec("node", "iptables", "-w", "-t", "nat", "-N", "KUBE-PORTALS-CONTAINER-00")
	l.MustExec("node", "iptables", "-w", "-t", "nat", "-A", "KUBE-PORTALS-CONTAINER", "-j", "KUBE-PORTALS-CONTAINER-00")
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, webManifest())
	d := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node")
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	waitFor(t, "the earlier chains gone", func() bool {
		return countRules(t, l, `KUBE-PORTALS-GUARD-1F|KUBE-PORTALS-CONTAINER-00`) == 0
	})
	save := l.MustExec("node", "iptables-save", "-t", "filter")
	if basicKernel {
		// No conntrack match: the earlier guard goes, and none comes.
		waitFor(t, "the earlier guard gone", func() bool {
			return !strings.Contains(l.MustExec("node", "iptables-save", "-t", "filter"), "KUBE-PORTALS-GUARD")
		})
		return
	}
	if n := strings.Count(save, "-j KUBE-PORTALS-GUARD"); n != 1 || !strings.Contains(save, "-A INPUT -m conntrack --ctstate NEW ") {
		t.Fatalf("guard jumps after the upgrade:\n%s\ndaemon log:\n%s", save, d.Output())
	}
}

// The proxy port range is taken out of the node's ephemeral ports while the
// daemon runs, and given back by --cleanup.
func TestProxyPortRangeReserved(t *testing.T) {
	l, d, _ := startWeb(t, webManifest(), "--proxy-port-range", "41000-41999")
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	if got := strings.TrimSpace(l.MustExec("node", "cat", "/proc/sys/net/ipv4/ip_local_reserved_ports")); got != "41000-41999" {
		t.Fatalf("reserved ports %q, want 41000-41999", got)
	}
	if m := regexp.MustCompile(`msg=Listening .*listen=(\d+)`).FindAllStringSubmatch(d.Output(), -1); len(m) == 0 {
		t.Fatal("no listener in the log")
	} else {
		for _, x := range m {
			if p, _ := strconv.Atoi(x[1]); p != 31341 && (p < 41000 || p > 41999) {
				t.Fatalf("listener on port %d, outside --proxy-port-range", p)
			}
		}
	}
	// An outgoing connection of the node does not take a reserved port.
	out := l.MustExec("node", "bash", "-c", "for i in $(seq 1 50); do curl -s -o /dev/null -w '%{local_port}\n' http://10.251.19.12:8080/; done")
	for _, f := range strings.Fields(out) {
		if p, _ := strconv.Atoi(f); p >= 41000 && p <= 41999 {
			t.Fatalf("an outgoing connection used reserved port %d", p)
		}
	}
	_ = d.Cmd.Process.Signal(syscall.SIGTERM)
	_ = d.Cmd.Wait()
	l.MustExec("node", filepath.Join(binDir, "kube-userspace-proxy"), "--cleanup", "--proxy-port-range", "41000-41999")
	if got := strings.TrimSpace(l.MustExec("node", "cat", "/proc/sys/net/ipv4/ip_local_reserved_ports")); got != "" {
		t.Fatalf("reserved ports after --cleanup: %q", got)
	}
}

// loadBalancerSourceRanges over IPv6 (and IPv4 beside it), from manifests:
// the pods' network is let in, the external client is not; its NodePort is
// not limited.
func TestSourceRangesIPv6(t *testing.T) {
	m := service("ranged", "LoadBalancer", "10.96.0.30,fd00:96::30",
		"  clusterIPs: [10.96.0.30, \"fd00:96::30\"]\n  ipFamilies: [IPv4, IPv6]\n  loadBalancerSourceRanges: [10.251.19.0/24, \"fd00:251::/64\"]\n",
		`{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 31350}`) +
		"status: {loadBalancer: {ingress: [{ip: 203.0.113.30}, {ip: \"fd00:96::31\"}]}}\n" + slices("ranged", `{name: http, port: 8080, protocol: TCP}`, true)
	l, d, _ := startWeb(t, m)
	defer func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", d.Output())
		}
	}()
	reachesBoth(t, l, "client", "http://[fd00:96::31]:80/")
	reachesBoth(t, l, "client", "http://203.0.113.30:80/")
	reachesBoth(t, l, "ext", "http://[fd00:50::1]:31350/")
	for _, url := range []string{"http://[fd00:96::31]:80/", "http://203.0.113.30:80/"} {
		if out, err := l.Exec("ext", "curl", "-s", "-g", "--max-time", "2", url); err == nil {
			t.Fatalf("a client outside the ranges reached %s: %q", url, out)
		}
	}
	save := l.MustExec("node", "ip6tables-save", "-t", "filter")
	drop := `-A KUBE-SOURCE-RANGES -d fd00:96::31/128 -p tcp -m comment --comment "lab/ranged:http" -m tcp --dport 80 -j DROP`
	if basicKernel {
		drop = `-A KUBE-SOURCE-RANGES -d fd00:96::31/128 -p tcp -m tcp --dport 80 -j DROP`
	}
	if !strings.Contains(save, drop) {
		t.Fatalf("no IPv6 drop %q:\n%s", drop, save)
	}
}

// The guard of the proxy port range is in place before the first listener
// opens: while its write is held (here an iptables-restore that waits, as
// one would behind a held xtables lock), nothing listens in the range and
// no rule of a Service is written; once it is in, the Services serve.
func TestGuardBeforeFirstListener(t *testing.T) {
	dir := t.TempDir()
	gate, held := filepath.Join(dir, "gate"), filepath.Join(dir, "held")
	script := filepath.Join(dir, "restore.sh")
	// The guard's write (the only one naming the guard chain without a
	// Service's rules) waits for the gate.
	os.WriteFile(script, []byte(fmt.Sprintf(`#!/bin/sh
in=$(mktemp); cat > "$in"
if grep -q '^:KUBE-PORTALS-GUARD' "$in" && ! grep -q 'lab/' "$in" && [ ! -e %[1]s ]; then
  touch %[2]s
  while [ ! -e %[1]s ]; do sleep 0.05; done
fi
iptables-restore "$@" < "$in"; rc=$?; rm -f "$in"; exit $rc
`, gate, held)), 0o755)
	l, d, _ := startWeb(t, webManifest(), "--iptables-restore-command", script)
	if basicKernel {
		// No conntrack match, no guard chain: the daemon guards the
		// ports from its first accept (TestBasicNetfilterOnly).
		reachesBoth(t, l, "client", "http://10.96.0.10:80/")
		if _, err := os.Stat(held); err == nil {
			t.Fatal("a guard chain was written without the conntrack match")
		}
		return
	}
	waitFor(t, "the guard's write held", func() bool { _, err := os.Stat(held); return err == nil })
	// Held for a while: still nothing listens in the proxy range.
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		out := l.MustExec("node", "ss", "-Htlnu", "sport >= :45000 and sport <= :59999")
		if strings.TrimSpace(out) != "" {
			t.Fatalf("listening in the proxy range before the guard is in:\n%s", out)
		}
		if strings.Contains(d.Output(), "msg=Listening") {
			t.Fatalf("a listener opened before the guard:\n%s", d.Output())
		}
		time.Sleep(100 * time.Millisecond)
	}
	if n := countRules(t, l, `lab/web`); n != 0 {
		t.Fatalf("%d Service rules written before the guard", n)
	}
	os.WriteFile(gate, nil, 0o644)
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	if !strings.Contains(l.MustExec("node", "iptables-save", "-t", "filter"), "-j KUBE-PORTALS-GUARD") {
		t.Fatal("no jump to the guard")
	}
}

// --sysctls-only (the DaemonSet's privileged init container) makes the
// node settings and exits, touching no rule: the unprivileged daemon then
// finds them made.
func TestSysctlsOnly(t *testing.T) {
	l := NewLab(t)
	out, err := l.Exec("node", filepath.Join(binDir, "kube-userspace-proxy"), "--sysctls-only", "--proxy-port-range", "47000-47999")
	if err != nil {
		t.Fatalf("--sysctls-only: %v\n%s", err, out)
	}
	if r := l.MustExec("node", "cat", "/proc/sys/net/ipv4/ip_local_reserved_ports"); !strings.Contains(r, "47000-47999") {
		t.Errorf("ip_local_reserved_ports %q lacks 47000-47999", r)
	}
	if cw := strings.TrimSpace(l.MustExec("node", "cat", "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait")); cw != "3600" {
		t.Errorf("close_wait timeout %s, want 3600", cw)
	}
	if n := countRules(t, l, `KUBE-`); n != 0 {
		t.Errorf("--sysctls-only wrote %d rules", n)
	}
}

// Upstream's "should support named targetPorts that resolve to different
// ports on different endpoints", in the lab: one service port (its name 18
// characters, as a DNS label may be) whose endpoints sit on different port
// numbers in two slices, then all moved to the new number; each step
// reaches every endpoint on its own port.
func TestNamedPortOnDifferentNumbers(t *testing.T) {
	l := NewLab(t)
	l.Backends()
	l.Start("pod1", filepath.Join(binDir, "backend"), "--name", "pod1b", "--tcp", ":8000", "--udp", "")
	l.Start("pod2", filepath.Join(binDir, "backend"), "--name", "pod2b", "--tcp", ":8000", "--udp", "")
	svc := service("mp", "ClusterIP", "10.96.0.40", "", `{name: mutable-named-port, port: 8001, protocol: TCP}`)
	slice := func(name, port, eps string) string {
		return "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: " + name + ", namespace: lab, labels: {kubernetes.io/service-name: mp}}\naddressType: IPv4\nports: [{name: mutable-named-port, port: " + port + ", protocol: TCP}]\nendpoints: [" + eps + "]\n"
	}
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, svc+slice("a", "8080", "{addresses: [10.251.19.12]}, {addresses: [10.251.19.8]}"))
	d := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node")
	defer func() {
		if t.Failed() {
			t.Logf("%s", d.Output())
		}
	}()
	both := func(want ...string) {
		seen := map[string]bool{}
		waitFor(t, "both of "+strings.Join(want, ","), func() bool {
			seen[strings.Fields(l.Curl("client", "http://10.96.0.40:8001/") + " -")[0]] = true
			for _, w := range want {
				if !seen[w] {
					return false
				}
			}
			return true
		})
	}
	both("pod1", "pod2")
	writeManifest(t, m, svc+slice("a", "8080", "{addresses: [10.251.19.8]}")+slice("b", "8000", "{addresses: [10.251.19.12]}"))
	both("pod1b", "pod2")
	writeManifest(t, m, svc+slice("b", "8000", "{addresses: [10.251.19.12]}, {addresses: [10.251.19.8]}"))
	both("pod1b", "pod2b")
}
