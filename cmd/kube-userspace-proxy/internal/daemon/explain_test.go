package daemon

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A dual-stack LoadBalancer Service with an externalIP, two endpoints per
// family, and a Local-policy NodePort Service.
const explainManifests = `apiVersion: v1
kind: Service
metadata: {name: web, namespace: lab}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, "fd00:96::10"]
  ipFamilies: [IPv4, IPv6]
  externalIPs: [203.0.113.10]
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 31341}]
status: {loadBalancer: {ingress: [{ip: 203.0.113.11}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-v4, namespace: lab, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [10.251.19.12], nodeName: node-a}
- {addresses: [10.251.19.8], nodeName: node-b}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-v6, namespace: lab, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["fd00:251::12"], nodeName: node-a}
---
apiVersion: v1
kind: Service
metadata: {name: local, namespace: lab}
spec:
  type: NodePort
  clusterIP: 10.96.0.30
  externalTrafficPolicy: Local
  ports: [{port: 53, targetPort: 5353, protocol: UDP, nodePort: 30053}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: local, namespace: lab, labels: {kubernetes.io/service-name: local}}
addressType: IPv4
ports: [{port: 5353, protocol: UDP}]
endpoints:
- {addresses: [10.251.19.12], nodeName: node-a}
- {addresses: [10.251.19.8], nodeName: node-b}
`

func runExplainJSON(t *testing.T, m string, args ...string) explainAnswer {
	t.Helper()
	var out, errb bytes.Buffer
	args = append([]string{"--manifests", m, "--hostname-override", "node-a", "--node-ip", "192.168.50.1,fd00:50::1", "--output", "json"}, args...)
	if code := RunExplain(args, &out, &errb); code != 0 {
		t.Fatalf("explain %v: exit %d: %s", args, code, errb.String())
	}
	var a explainAnswer
	if err := json.Unmarshal(out.Bytes(), &a); err != nil {
		t.Fatalf("%v: %s", err, out.String())
	}
	return a
}

func TestExplainOffline(t *testing.T) {
	m := filepath.Join(t.TempDir(), "m.yaml")
	if err := os.WriteFile(m, []byte(explainManifests), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, from, to, protocol string
		hook, chain, as, service string
		local                    bool // traffic policy Local
	}{
		{"ClusterIP from a pod", "10.251.19.20", "10.96.0.10:80", "tcp", "PREROUTING", "KUBE-PORTALS-CONTAINER", "clusterIP", "lab/web:http", false},
		{"ClusterIP from the node", "192.168.50.1", "10.96.0.10:80", "tcp", "OUTPUT", "KUBE-PORTALS-HOST", "clusterIP", "lab/web:http", false},
		{"NodePort from outside", "192.168.50.2", "192.168.50.1:31341", "tcp", "PREROUTING", "", "nodePort", "lab/web:http", false},
		{"externalIP", "192.168.50.2", "203.0.113.10:80", "tcp", "PREROUTING", "KUBE-PORTALS-CONTAINER", "externalIP", "lab/web:http", false},
		{"LoadBalancer IP", "192.168.50.2", "203.0.113.11:80", "tcp", "PREROUTING", "KUBE-PORTALS-CONTAINER", "loadBalancerIP", "lab/web:http", false},
		{"IPv6 ClusterIP", "fd00:251::20", "[fd00:96::10]:80", "tcp", "PREROUTING", "KUBE-PORTALS-CONTAINER", "clusterIP", "lab/web:http", false},
		{"IPv6 NodePort", "fd00:50::2", "[fd00:50::1]:31341", "tcp", "PREROUTING", "", "nodePort", "lab/web:http", false},
		{"UDP NodePort, policy Local", "192.168.50.2", "192.168.50.1:30053", "udp", "PREROUTING", "", "nodePort", "lab/local", true},
		{"UDP ClusterIP of a Local NodePort Service", "10.251.19.20", "10.96.0.30:53", "udp",
			"PREROUTING", "KUBE-PORTALS-CONTAINER", "clusterIP", "lab/local", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := runExplainJSON(t, m, "--from", tc.from, "--to", tc.to, "--protocol", tc.protocol)
			if a.Rules == nil || a.Rules.Hook != tc.hook || a.Service == nil || a.Service.Service != tc.service || a.Service.As != tc.as {
				t.Fatalf("%+v", a)
			}
			if tc.chain != "" {
				last := a.Rules.Nat[len(a.Rules.Nat)-1]
				// The listeners sit on their NodePorts, but for the
				// internal side of a Service whose policies differ.
				want := fmt.Sprint(a.Service.NodePort)
				if a.Service.Kind == "internal" {
					want = "PROXY_PORT(lab/local/internal/IPv4)"
				}
				if a.Rules.NAT.Target != "REDIRECT" || last.Chain != tc.chain || a.Rules.NAT.ToPort != want {
					t.Fatalf("caught by %s %q → %+v", last.Chain, last.Rule, a.Rules.NAT)
				}
			} else if a.Rules.NAT.Target != "" || !strings.Contains(a.Delivery, "sits on NodePort") {
				t.Fatalf("NodePort: %+v, %q", a.Rules.NAT, a.Delivery)
			}
			selected := 0
			for _, e := range a.Service.Endpoints {
				if e.Selected {
					selected++
				}
			}
			switch {
			case tc.local && (a.Service.TrafficPolicy != "Local" || selected != 1 || a.Service.Next.Endpoint == nil || a.Service.Next.Endpoint.String() != "10.251.19.12:5353"):
				t.Fatalf("Local: %+v, next %+v", a.Service.Endpoints, a.Service.Next)
			case !tc.local && a.Service.TrafficPolicy != "Cluster":
				t.Fatalf("policy %s", a.Service.TrafficPolicy)
			case a.Service.Family == 6 && (selected != 1 || len(a.Service.Endpoints) != 1):
				t.Fatalf("IPv6 endpoints: %+v", a.Service.Endpoints)
			}
		})
	}

	t.Run("a listener off its NodePort", func(t *testing.T) {
		// With --nodeport-addresses the listener takes a proxy port and
		// the NodePort is a rule, on the listed addresses only.
		a := runExplainJSON(t, m, "--from", "192.168.50.2", "--to", "192.168.50.1:31341", "--nodeport-addresses", "192.168.50.0/24")
		last := a.Rules.Nat[len(a.Rules.Nat)-1]
		if a.Service == nil || a.Service.As != "nodePort" || last.Chain != "KUBE-NODEPORT-CONTAINER" ||
			a.Rules.NAT.ToPort != "PROXY_PORT(lab/web:http/all/IPv4)" {
			t.Fatalf("%+v; caught by %s %q", a.Rules.NAT, last.Chain, last.Rule)
		}
	})

	t.Run("local clients of a Local Service", func(t *testing.T) {
		// lab/local's NodePort from this node, and from a pod of
		// --cluster-cidr: the short-circuit to every endpoint; from
		// outside, the local endpoint only.
		for _, c := range []struct {
			from, chain string
			localClient bool
		}{
			{"192.168.50.1", "KUBE-NODEPORT-LOCAL", true},
			{"10.251.19.20", "KUBE-NODEPORT-LOCAL", true},
			{"192.168.50.2", "", false},
		} {
			a := runExplainJSON(t, m, "--from", c.from, "--to", "192.168.50.1:30053", "--protocol", "udp", "--cluster-cidr", "10.251.19.0/24")
			x := a.Service
			if x == nil || x.As != "nodePort" || x.LocalClient != c.localClient || (x.TrafficPolicy == "Local") == c.localClient {
				t.Fatalf("from %s: %+v", c.from, x)
			}
			if c.chain != "" && a.Rules.Nat[len(a.Rules.Nat)-1].Chain != c.chain {
				t.Fatalf("from %s: caught in %+v", c.from, a.Rules.Nat)
			}
			selected := 0
			for _, e := range x.Endpoints {
				if e.Selected {
					selected++
				}
			}
			if want := map[bool]int{true: 2, false: 1}[c.localClient]; selected != want {
				t.Fatalf("from %s: %d endpoints selected, want %d: %+v", c.from, selected, want, x.Endpoints)
			}
		}
		var out bytes.Buffer
		if code := RunExplain([]string{
			"--manifests",
			m,
			"--hostname-override",
			"node-a",
			"--from",
			"192.168.50.1",
			"--to",
			"192.168.50.1:30053",
			"--protocol",
			"udp",
			"--node-ip",
			"192.168.50.1",
		}, &out, &bytes.Buffer{}); code != 0 || !strings.Contains(out.String(), "the client is on this node: every endpoint") {
			t.Fatalf("exit %d:\n%s", code, out.String())
		}
	})

	t.Run("nothing there", func(t *testing.T) {
		a := runExplainJSON(t, m, "--from", "10.251.19.20", "--to", "10.96.0.99:80")
		if a.Service != nil || a.Rules.NAT.Target != "" || !strings.Contains(a.Delivery, "unchanged") {
			t.Fatalf("%+v", a)
		}
	})

	t.Run("text", func(t *testing.T) {
		var out bytes.Buffer
		if code := RunExplain(
			[]string{"--manifests", m, "--from", "10.251.19.20", "--to", "10.96.0.10:80", "--node-ip", "192.168.50.1"},
			&out,
			&bytes.Buffer{},
		); code != 0 {
			t.Fatal(code)
		}
		for _, want := range []string{"enters nat PREROUTING", "-j REDIRECT --to-ports 31341", "is its clusterIP",
			"The first connection goes to one of 10.251.19.8:8080 10.251.19.12:8080 (round-robin)"} {
			if !strings.Contains(out.String(), want) {
				t.Fatalf("text lacks %q:\n%s", want, out.String())
			}
		}
	})

	t.Run("bad input", func(t *testing.T) {
		for _, args := range [][]string{
			{"explain", "--manifests", m, "--from", "nope", "--to", "10.96.0.10:80"},
			{"explain", "--manifests", m, "--from", "10.0.0.1", "--to", "10.96.0.10"},
			{"explain", "--manifests", m, "--from", "10.0.0.1", "--to", "[fd00::1]:80"},
			{"explain", "--manifests", m, "--from", "10.0.0.1", "--to", "10.96.0.10:80", "--protocol", "sctp"},
			{"explain", "--from", "10.0.0.1", "--to", "10.96.0.10:80"},
		} {
			var errb bytes.Buffer
			if code := RunExplain(args[1:], &bytes.Buffer{}, &errb); code != ExitUsage || !strings.Contains(errb.String(), "explain:") {
				t.Fatalf("%v: exit %d, %q", args, code, errb.String())
			}
		}
	})
}
