package e2e

import (
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// localManifest is lab/web with externalTrafficPolicy Local (and
// internalTrafficPolicy Local when itp), pod1 on this node when withLocal
// and pod2 on another, and this node's Node with its pod CIDRs.
func localManifest(withLocal, itp bool) string {
	extra := "  clusterIPs: [10.96.0.10, \"fd00:96::10\"]\n  ipFamilies: [IPv4, IPv6]\n  externalIPs: [203.0.113.10]\n  externalTrafficPolicy: Local\n"
	if itp {
		extra += "  internalTrafficPolicy: Local\n"
	}
	s := service("web", "LoadBalancer", "10.96.0.10,fd00:96::10", extra, webPorts) +
		"status: {loadBalancer: {ingress: [{ip: 203.0.113.11}]}}\n" + slices("web", webSlicePorts, true)
	s = strings.ReplaceAll(s, "- {addresses: [10.251.19.8], nodeName: node}", "- {addresses: [10.251.19.8], nodeName: other}")
	s = strings.ReplaceAll(s, `- {addresses: ["fd00:251::8"], nodeName: node}`, `- {addresses: ["fd00:251::8"], nodeName: other}`)
	if !withLocal {
		s = strings.ReplaceAll(s, "- {addresses: [10.251.19.12], nodeName: node}\n", "")
		s = strings.ReplaceAll(s, "- {addresses: [\"fd00:251::12\"], nodeName: node}\n", "")
	}
	return s + "---\napiVersion: v1\nkind: Node\nmetadata: {name: node}\nspec: {podCIDRs: [10.251.19.0/24, \"fd00:251::/64\"]}\n"
}

// onlyPod1 fetches url n times and fails on any answer but pod1's.
func onlyPod1(t *testing.T, l *Lab, ns, url string, n int) {
	t.Helper()
	for i := 0; i < n; i++ {
		if body := l.Curl(ns, url); !strings.HasPrefix(body, "pod1") {
			t.Fatalf("%s → %s answered %q: only this node's endpoint (pod1) may answer", ns, url, body)
		}
	}
}

// kube-proxy's short-circuit: the node itself and its pods reach the
// external addresses (externalIP, LoadBalancer IP, NodePort; IPv4 and IPv6;
// TCP and UDP) of an externalTrafficPolicy: Local Service with every
// endpoint of the cluster, while a client from outside gets this node's
// endpoints only — and is refused when there is none here. With
// internalTrafficPolicy Local too, the ClusterIP stays local while the
// external addresses short-circuit. Then each other detection mode
// (NodeCIDR from the manifests' Node, BridgeInterface) finds the pod.
func TestLocalClientsOfLocalServices(t *testing.T) {
	l := NewLab(t)
	l.Backends()
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, localManifest(true, false))
	d := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node",
		"--cluster-cidr", "10.251.19.0/24,fd00:251::/64")
	defer func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", tail(d.Output(), 4000))
		}
	}()
	local := []struct{ ns, url string }{
		{"node", "http://203.0.113.10/"}, {"node", "http://203.0.113.11/"},
		{"node", "http://127.0.0.1:31341/"}, {"node", "http://192.168.50.1:31341/"},
		{"client", "http://203.0.113.10/"}, {"client", "http://203.0.113.11/"},
		{"client", "http://10.251.19.1:31341/"}, {"client", "http://[fd00:251::1]:31341/"},
	}
	for _, c := range local {
		reachesBoth(t, l, c.ns, c.url)
	}
	for _, url := range []string{"http://203.0.113.10/", "http://203.0.113.11/", "http://192.168.50.1:31341/", "http://[fd00:50::1]:31341/"} {
		onlyPod1(t, l, "ext", url, 8)
	}
	out := l.MustExec("node", "curl", "-s", "http://127.0.0.1:10249/debug/rules")
	if !strings.Contains(out, "KUBE-PORTALS-LOCAL") || !strings.Contains(out, "-s 10.251.19.0/24 -j KUBE-PORTALS-LOCAL") {
		t.Fatalf("/debug/rules shows no short-circuit:\n%s", tail(out, 3000))
	}

	// The one endpoint is on another node: outside clients are refused,
	// the node's own are served by it, over TCP and UDP.
	writeManifest(t, m, localManifest(false, false))
	waitFor(t, "outside clients refused", func() bool { ok, _ := l.tcpRefused("ext", "203.0.113.11", "80"); return ok })
	for _, c := range local {
		waitFor(t, c.ns+" → "+c.url+" served by pod2", func() bool { return strings.HasPrefix(l.Curl(c.ns, c.url), "pod2") })
	}
	for _, ns := range []string{"node", "client"} {
		for _, host := range []string{"203.0.113.10", "203.0.113.11"} {
			waitFor(t, "UDP "+ns+" → "+host, func() bool { return l.UDP(ns, host, "53", "ping") == "pod2:ping" })
		}
	}
	if ok, out := l.udpRefused("ext", "203.0.113.11", "53"); !ok {
		t.Fatalf("UDP from outside to a Local Service without a local endpoint: %s", out)
	}
	noLocal := func(policy, family string) float64 {
		return metricSum(scrape(t, l), "kubeproxy_sync_proxy_rules_no_local_endpoints_total", map[string]string{"traffic_policy": policy, "ip_family": family})
	}
	// kube-proxy's count: both ports (http, dns) of each family.
	if e4, e6, i4 := noLocal("external", "IPv4"), noLocal("external", "IPv6"), noLocal("internal", "IPv4"); e4 != 2 || e6 != 2 || i4 != 0 {
		t.Fatalf("no_local_endpoints external IPv4 %v, IPv6 %v, internal %v; want 2, 2, 0", e4, e6, i4)
	}

	// internalTrafficPolicy Local too: the ClusterIP has no endpoint for
	// the node, the external addresses still short-circuit to pod2.
	writeManifest(t, m, localManifest(false, true))
	waitFor(t, "the ClusterIP refused from the node", func() bool { ok, _ := l.tcpRefused("node", "10.96.0.10", "80"); return ok })
	for _, c := range local {
		waitFor(t, c.ns+" → "+c.url+" served by pod2 (iTP Local)", func() bool { return strings.HasPrefix(l.Curl(c.ns, c.url), "pod2") })
	}
	if ok, out := l.tcpRefused("ext", "203.0.113.10", "80"); !ok {
		t.Fatalf("outside client, iTP and eTP Local, no local endpoint: %s", out)
	}
	if e4, i4 := noLocal("external", "IPv4"), noLocal("internal", "IPv4"); e4 != 2 || i4 != 2 {
		t.Fatalf("no_local_endpoints with both policies Local: external %v, internal %v; want 2, 2", e4, i4)
	}
	if out := l.MustExec("node", "curl", "-s", "http://127.0.0.1:10249/debug/services"); !strings.Contains(out, `"kind": "local-clients"`) {
		t.Fatalf("/debug/services shows no local-clients listener:\n%s", tail(out, 3000))
	}

	// The other modes, each a daemon of its own taking over the rules.
	writeManifest(t, m, localManifest(false, false))
	for _, args := range [][]string{
		{"--detect-local-mode", "NodeCIDR"},
		{"--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "br0"},
		// Routed packets of bridged pods come in on the bridge (veth
		// prefixes are for CNIs that route each pod's interface).
		{"--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "br"},
	} {
		_ = d.Cmd.Process.Signal(syscall.SIGTERM)
		_ = d.Cmd.Wait()
		d = l.Daemon(append([]string{"--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node"}, args...)...)
		waitFor(
			t,
			args[1]+": the pod → LoadBalancer IP served by pod2",
			func() bool { return strings.HasPrefix(l.Curl("client", "http://203.0.113.11/"), "pod2") },
		)
		waitFor(t, args[1]+": the pod → NodePort (IPv6) served by pod2", func() bool {
			return strings.HasPrefix(l.Curl("client", "http://[fd00:251::1]:31341/"), "pod2")
		})
		if ok, out := l.tcpRefused("ext", "203.0.113.11", "80"); !ok {
			t.Fatalf("%v: outside client: %s", args, out)
		}
	}
}
