package e2e

import (
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// tcpRefused reports whether a TCP connect from ns to host:port is refused
// at connect (nc -z says "Connection refused"), not accepted (a port that
// looks open to nc -z, a readiness check or a pool) or left to time out.
func (l *Lab) tcpRefused(ns, host, port string) (bool, string) {
	out, _ := l.Exec(ns, "nc", "-vz", "-w", "3", host, port)
	return strings.Contains(out, "Connection refused"), out
}

// udpRefused reports whether a DNS query from ns to host:port is answered
// by an ICMP port unreachable: dig says "connection refused" at once instead
// of timing out.
func (l *Lab) udpRefused(ns, host, port string) (bool, string) {
	out, _ := l.Exec(ns, "dig", "+tries=1", "+time=2", "-p", port, "@"+host, "example.com")
	return strings.Contains(out, "connection refused"), out
}

// A Service without endpoints refuses at connect on every address it has —
// ClusterIP (IPv4 and IPv6), NodePort, externalIP and LoadBalancer IP, from a
// pod, the node and an external client — as kube-proxy's REJECT does: TCP
// gets a reset to its SYN, UDP an ICMP port unreachable. Once an endpoint
// appears it serves, without a restart; without endpoints again, it refuses
// again.
func TestNoEndpointsRefusedOnEveryAddress(t *testing.T) {
	l := NewLab(t)
	l.Backends()
	m := filepath.Join(t.TempDir(), "m.yaml")
	web := webManifest()
	empty := web[:strings.Index(web, "---")] // the Service without its slices
	writeManifest(t, m, empty)
	d := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node")
	defer func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", tail(d.Output(), 4000))
		}
	}()
	tcp := []struct{ ns, host, port string }{
		{"client", "10.96.0.10", "80"},
		{"node", "10.96.0.10", "80"},
		{"client", "fd00:96::10", "80"},
		{"ext", "192.168.50.1", "31341"},
		{"node", "127.0.0.1", "31341"},
		{"ext", "fd00:50::1", "31341"},
		{"ext", "203.0.113.10", "80"},
		{"ext", "203.0.113.11", "80"},
	}
	udp := []struct{ ns, host, port string }{
		{"client", "10.96.0.10", "53"},
		{"node", "10.96.0.10", "53"},
		{"client", "fd00:96::10", "53"},
		{"ext", "192.168.50.1", "31341"},
		{"ext", "203.0.113.11", "53"},
	}
	refusedEverywhere := func(when string) {
		t.Helper()
		for _, c := range tcp {
			waitFor(t, when+": TCP "+c.ns+" → "+c.host+":"+c.port+" refused", func() bool { ok, _ := l.tcpRefused(c.ns, c.host, c.port); return ok })
		}
		for _, c := range udp {
			waitFor(t, when+": UDP "+c.ns+" → "+c.host+":"+c.port+" refused", func() bool { ok, _ := l.udpRefused(c.ns, c.host, c.port); return ok })
		}
	}
	waitFor(t, "the rules", func() bool { return countRules(t, l, `lab/web:http`) > 0 })
	refusedEverywhere("without endpoints")
	if out := l.MustExec("node", "curl", "-s", "http://127.0.0.1:10249/debug/services"); strings.Count(out, `"refusing": true`) != 4 {
		t.Fatalf("/debug/services does not say all four listeners refuse:\n%s", out)
	}
	// Refused at once: the connect fails in far less than a timeout.
	start := time.Now()
	if ok, out := l.tcpRefused("client", "10.96.0.10", "80"); !ok || time.Since(start) > time.Second {
		t.Fatalf("a connect took %v: %s", time.Since(start), out)
	}

	writeManifest(t, m, web)
	for _, c := range tcp {
		host := c.host
		if strings.Contains(host, ":") {
			host = "[" + host + "]"
		}
		reachesBoth(t, l, c.ns, "http://"+host+":"+c.port+"/")
	}
	for _, c := range udp {
		udpReaches(t, l, c.ns, c.host, c.port)
	}

	writeManifest(t, m, empty)
	refusedEverywhere("endpoints gone")
}
