package e2e

import (
	"encoding/json"
	"net/url"
	"path/filepath"
	"strings"
	"testing"
)

// explainJSON is the part of /debug/explain's answer the tests read.
type explainJSON struct {
	Origin string `json:"origin"`
	Rules  *struct {
		Hook string `json:"hook"`
		Nat  []struct {
			Chain   string `json:"chain"`
			Rule    string `json:"rule"`
			Counter *struct {
				Packets uint64 `json:"packets"`
			} `json:"counter"`
		} `json:"nat"`
		NAT struct {
			Target string `json:"target"`
			ToPort string `json:"toPort"`
		} `json:"natVerdict"`
		Filter struct {
			Target string `json:"target"`
		} `json:"filterVerdict"`
	} `json:"rules"`
	Delivery string `json:"delivery"`
	Service  *struct {
		Service string `json:"service"`
		As      string `json:"as"`
		Family  int    `json:"family"`
		Listen  string `json:"listen"`
		Next    struct {
			Endpoint *string `json:"endpoint"`
			Reason   string  `json:"reason"`
			Pin      *struct {
				Endpoint string `json:"endpoint"`
			} `json:"pin"`
		} `json:"next"`
	} `json:"service"`
}

func (l *Lab) explain(t *testing.T, from, to, protocol string) explainJSON {
	t.Helper()
	q := url.Values{"from": {from}, "to": {to}, "protocol": {protocol}}
	code, body := l.get("node", "http://127.0.0.1:10249/debug/explain?"+q.Encode())
	var x explainJSON
	if err := json.Unmarshal([]byte(body), &x); code != 200 || err != nil {
		t.Fatalf("explain %s → %s: %d %v\n%s", from, to, code, err, body)
	}
	return x
}

// podOf names the lab pod behind an endpoint address.
func podOf(ep string) string {
	switch {
	case strings.HasPrefix(ep, "10.251.19.12:"), strings.HasPrefix(ep, "[fd00:251::12]:"):
		return "pod1"
	case strings.HasPrefix(ep, "10.251.19.8:"), strings.HasPrefix(ep, "[fd00:251::8]:"):
		return "pod2"
	}
	return "?" + ep
}

const stickyManifest = `---
apiVersion: v1
kind: Service
metadata: {name: sticky, namespace: lab}
spec:
  clusterIP: 10.96.0.20
  clusterIPs: [10.96.0.20]
  sessionAffinity: ClientIP
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
`

// Every way into a Service, explained live: the rule that catches the first
// packet (as installed, with its counter), the listener, and a prediction
// that the next real connection then proves, round-robin and affinity.
func TestExplainPredictsTheNextConnection(t *testing.T) {
	l, d, _ := startWeb(t, webManifest()+stickyManifest+slices("sticky", `{name: http, port: 8080, protocol: TCP}`, false))
	defer func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", d.Output())
		}
	}()
	// Affinity pins the client to one pod: one answer is all it gets.
	waitFor(t, "client → sticky", func() bool { return strings.HasPrefix(l.Curl("client", "http://10.96.0.20:80/"), "pod") })
	for _, tc := range []struct {
		name, ns, from, to, url string
		hook, chain, as         string
		family                  int
	}{
		{"ClusterIP from a pod", "client", "10.251.19.20", "10.96.0.10:80", "http://10.96.0.10:80/", "PREROUTING", "KUBE-PORTALS-CONTAINER", "clusterIP", 4},
		{"ClusterIP from the node", "node", "192.168.50.1", "10.96.0.10:80", "http://10.96.0.10:80/", "OUTPUT", "KUBE-PORTALS-HOST", "clusterIP", 4},
		{"NodePort from outside", "ext", "192.168.50.2", "192.168.50.1:31341", "http://192.168.50.1:31341/", "PREROUTING", "", "nodePort", 4},
		{"externalIP", "ext", "192.168.50.2", "203.0.113.10:80", "http://203.0.113.10:80/", "PREROUTING", "KUBE-PORTALS-CONTAINER", "externalIP", 4},
		{"LoadBalancer IP", "ext", "192.168.50.2", "203.0.113.11:80", "http://203.0.113.11:80/", "PREROUTING", "KUBE-PORTALS-CONTAINER", "loadBalancerIP", 4},
		{"IPv6 ClusterIP from a pod", "client", "fd00:251::20", "[fd00:96::10]:80", "http://[fd00:96::10]:80/",
			"PREROUTING", "KUBE-PORTALS-CONTAINER", "clusterIP", 6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reachesBoth(t, l, tc.ns, tc.url)
			// Three times: round-robin moves on after each connection,
			// and the prediction must follow it.
			for i := 0; i < 3; i++ {
				x := l.explain(t, tc.from, tc.to, "tcp")
				if x.Rules == nil || x.Rules.Hook != tc.hook || x.Service == nil || x.Service.As != tc.as || x.Service.Family != tc.family ||
					x.Service.Service != "lab/web:http" || x.Rules.Filter.Target == "DROP" {
					t.Fatalf("explain: %+v", x)
				}
				if tc.chain != "" {
					last := x.Rules.Nat[len(x.Rules.Nat)-1]
					if x.Rules.NAT.Target != "REDIRECT" || last.Chain != tc.chain || !strings.HasSuffix(x.Service.Listen, ":"+x.Rules.NAT.ToPort) {
						t.Fatalf("caught by %s %q → %s %s; listener %s", last.Chain, last.Rule, x.Rules.NAT.Target, x.Rules.NAT.ToPort, x.Service.Listen)
					}
					if i > 0 && (last.Counter == nil || last.Counter.Packets == 0) {
						t.Fatalf("the rule's packet counter after traffic through it: %+v", last.Counter)
					}
				} else if x.Rules.NAT.Target != "" || !strings.Contains(x.Delivery, "sits on NodePort 31341") {
					t.Fatalf("NodePort: nat %+v, delivery %q", x.Rules.NAT, x.Delivery)
				}
				if x.Service.Next.Endpoint == nil || x.Service.Next.Reason != "round-robin" {
					t.Fatalf("prediction %+v", x.Service.Next)
				}
				want := podOf(*x.Service.Next.Endpoint)
				if got := strings.Fields(l.Curl(tc.ns, tc.url) + " -"); got[0] != want {
					t.Fatalf("connection %d: explain predicted %s (%s), the connection reached %s", i, *x.Service.Next.Endpoint, want, got[0])
				}
			}
		})
	}

	t.Run("UDP", func(t *testing.T) {
		for i := 0; i < 2; i++ {
			x := l.explain(t, "10.251.19.20", "10.96.0.10:53", "udp")
			if x.Service == nil || x.Service.Service != "lab/web:dns" || x.Service.Next.Endpoint == nil {
				t.Fatalf("explain: %+v", x)
			}
			want := podOf(*x.Service.Next.Endpoint) + ":ping"
			if got := l.UDP("client", "10.96.0.10", "53", "ping"); got != want {
				t.Fatalf("flow %d: explain predicted %s, the datagram reached %q", i, want, got)
			}
		}
	})

	t.Run("affinity", func(t *testing.T) {
		x := l.explain(t, "10.251.19.20", "10.96.0.20:80", "tcp")
		if x.Service == nil || x.Service.Next.Pin == nil || x.Service.Next.Reason != "affinity" {
			t.Fatalf("the client has connected before: want its pin followed, got %+v", x.Service)
		}
		pinned := x.Service.Next.Pin.Endpoint
		for i := 0; i < 3; i++ {
			if got := strings.Fields(l.Curl("client", "http://10.96.0.20:80/") + " -")[0]; got != podOf(pinned) {
				t.Fatalf("pinned to %s, the connection reached %s", pinned, got)
			}
		}
		// Another client has no pin: round-robin decides, and it is
		// pinned to what it gets.
		x = l.explain(t, "192.168.50.1", "10.96.0.20:80", "tcp")
		if x.Service.Next.Pin != nil || x.Service.Next.Reason != "round-robin" || x.Service.Next.Endpoint == nil {
			t.Fatalf("the node, never connected: %+v", x.Service.Next)
		}
		want := podOf(*x.Service.Next.Endpoint)
		if got := strings.Fields(l.Curl("node", "http://10.96.0.20:80/") + " -")[0]; got != want {
			t.Fatalf("predicted %s, reached %s", want, got)
		}
		if x = l.explain(t, "192.168.50.1", "10.96.0.20:80", "tcp"); x.Service.Next.Pin == nil || podOf(x.Service.Next.Pin.Endpoint) != want {
			t.Fatalf("after the connection, the node's pin: %+v", x.Service.Next)
		}
	})

	t.Run("not a Service and a proxy port", func(t *testing.T) {
		x := l.explain(t, "10.251.19.20", "10.251.19.12:8080", "tcp")
		if x.Service != nil || x.Rules.NAT.Target != "" || !strings.Contains(x.Delivery, "unchanged") {
			t.Fatalf("pod to pod: %+v", x)
		}
		svc := l.explain(t, "10.251.19.20", "10.96.0.20:80", "tcp")
		port := svc.Rules.NAT.ToPort
		x = l.explain(t, "192.168.50.2", "192.168.50.1:"+port, "tcp")
		switch {
		case basicKernel && (!strings.Contains(x.Delivery, "RESETS it at accept") || x.Service != nil):
			t.Fatalf("a proxy port from outside, no conntrack match: %+v", x)
		case !basicKernel && (x.Rules.Filter.Target != "DROP" || x.Service != nil):
			t.Fatalf("a proxy port from outside: %+v", x)
		}
		if out, err := l.Exec("ext", "curl", "-s", "--max-time", "2", "http://192.168.50.1:"+port+"/"); err == nil {
			t.Fatalf("explain said %q, yet the proxy port answered from outside: %q", x.Delivery, out)
		}
	})

	t.Run("text and the CLI", func(t *testing.T) {
		out := l.MustExec("node", filepath.Join(binDir, "kube-userspace-proxy"), "explain", "--server", "http://127.0.0.1:10249",
			"--from", "10.251.19.20", "--to", "10.96.0.10:80")
		for _, want := range []string{"enters nat PREROUTING", "KUBE-PORTALS-CONTAINER, rule", "packets,", "is its clusterIP", "SELECTED",
			"The next connection from 10.251.19.20 goes to"} {
			if !strings.Contains(out, want) {
				t.Fatalf("explain text lacks %q:\n%s", want, out)
			}
		}
	})
}
