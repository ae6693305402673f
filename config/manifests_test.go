package config

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"go.uber.org/goleak"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func mustState(t *testing.T, yaml string) *State {
	t.Helper()
	st, err := ParseManifests("test.yaml", []byte(yaml), "node-a")
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func port(t *testing.T, st *State, name string) *ServicePort {
	t.Helper()
	ns, rest, _ := strings.Cut(name, "/")
	svc, p, _ := strings.Cut(rest, ":")
	sp := st.Ports[ServicePortName{Namespace: ns, Name: svc, Port: p}]
	if sp == nil {
		t.Fatalf("no service port %s in %v", name, st.Ports)
	}
	return sp
}

func TestDevpaasyExample(t *testing.T) {
	st, skipped, err := LoadManifests("../docs/examples/devpaasy.yaml", "node-1")
	if err != nil {
		t.Fatal(err)
	}
	if len(skipped) != 0 || len(st.Ports) != 1 {
		t.Fatalf("ports %v skipped %v", st.Ports, skipped)
	}
	sp := port(t, st, "dev/devpaasy:http")
	if sp.Port != 8080 || sp.NodePort != 31341 || sp.Protocol != TCP || sp.ClusterIPs[0] != netip.MustParseAddr("10.0.0.41") {
		t.Fatalf("service port %+v", sp)
	}
	got := UsableEndpoints(sp.Endpoints, 4, false, "", "")
	want := []netip.AddrPort{netip.MustParseAddrPort("10.251.19.8:8080"), netip.MustParseAddrPort("10.251.19.12:8080")}
	if len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("endpoints %v, want %v", got, want)
	}
}

const kubectlList = `
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: web, namespace: prod, resourceVersion: "12", uid: 1b4c, creationTimestamp: "2026-01-01T00:00:00Z"}
  spec:
    type: LoadBalancer
    clusterIP: 10.96.0.5
    clusterIPs: [10.96.0.5, "fd00::5"]
    ipFamilies: [IPv4, IPv6]
    ipFamilyPolicy: PreferDualStack
    externalIPs: [192.0.2.10]
    externalTrafficPolicy: Local
    internalTrafficPolicy: Cluster
    sessionAffinity: ClientIP
    sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}
    ports:
    - {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}
    - {name: dns, port: 53, protocol: UDP, targetPort: 5353, nodePort: 30053}
  status:
    loadBalancer:
      ingress:
      - ip: 198.51.100.1
      - ip: 198.51.100.2
        ipMode: Proxy
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: web-abc, namespace: prod, labels: {kubernetes.io/service-name: web}}
  addressType: IPv4
  ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP}]
  endpoints:
  - addresses: [10.1.0.1]
    conditions: {ready: true}
    nodeName: node-a
  - addresses: [10.1.0.2]
    conditions: {ready: false, serving: true, terminating: true}
    nodeName: node-b
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: web-def, namespace: prod, labels: {kubernetes.io/service-name: web}}
  addressType: IPv6
  ports: [{name: http, port: 8080, protocol: TCP}]
  endpoints:
  - addresses: ["fd00:1::1"]
    nodeName: node-b
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: unrelated, namespace: prod}
`

func TestKubectlListOutput(t *testing.T) {
	st := mustState(t, kubectlList)
	http := port(t, st, "prod/web:http")
	if http.NodePort != 30080 || len(http.ClusterIPs) != 2 || http.ExternalIPs[0] != netip.MustParseAddr("192.0.2.10") {
		t.Fatalf("http %+v", http)
	}
	if len(http.LoadBalancerIPs) != 1 || http.LoadBalancerIPs[0] != netip.MustParseAddr("198.51.100.1") {
		t.Fatalf("LB IPs %v: ipMode Proxy must be skipped", http.LoadBalancerIPs)
	}
	if http.AffinityTimeout != 600*time.Second || !http.ExternalLocal || http.InternalLocal {
		t.Fatalf("affinity/policy %+v", http)
	}
	if fams := http.Families(); len(fams) != 2 || fams[0] != 4 || fams[1] != 6 {
		t.Fatalf("families %v", fams)
	}
	if len(http.Endpoints) != 3 {
		t.Fatalf("http endpoints %v, want 3 merged from two slices", http.Endpoints)
	}
	if v6 := UsableEndpoints(http.Endpoints, 6, false, "", ""); len(v6) != 1 || v6[0].String() != "[fd00:1::1]:8080" {
		t.Fatalf("IPv6 endpoints %v", v6)
	}
	dns := port(t, st, "prod/web:dns")
	if dns.Protocol != UDP || len(dns.Endpoints) != 2 || dns.Endpoints[0].Addr.Port() != 5353 {
		t.Fatalf("dns %+v", dns)
	}
}

func TestUsableEndpointsFallbackAndLocal(t *testing.T) {
	st := mustState(t, kubectlList)
	eps := port(t, st, "prod/web:http").Endpoints
	if got := UsableEndpoints(eps, 4, false, "", ""); len(got) != 1 || got[0].String() != "10.1.0.1:8080" {
		t.Fatalf("ready only: %v", got)
	}
	// Local to node-b: no ready endpoint there, so the serving+terminating one.
	if got := UsableEndpoints(eps, 4, true, "node-b", ""); len(got) != 1 || got[0].String() != "10.1.0.2:8080" {
		t.Fatalf("node-b local: %v", got)
	}
	if got := UsableEndpoints(eps, 4, true, "node-c", ""); len(got) != 0 {
		t.Fatalf("node-c has no endpoint, got %v", got)
	}
}

func TestEndpointsConverted(t *testing.T) {
	st := mustState(t, `
apiVersion: v1
kind: Service
metadata: {name: legacy}
spec:
  clusterIP: 10.96.0.7
  ports: [{port: 80}]
---
apiVersion: v1
kind: Endpoints
metadata: {name: legacy}
subsets:
- addresses: [{ip: 10.1.0.1, nodeName: n1}, {ip: 10.1.0.2}]
  notReadyAddresses: [{ip: 10.1.0.3}]
  ports: [{port: 8080}]
`)
	sp := port(t, st, "default/legacy")
	if sp.Protocol != TCP || len(sp.Endpoints) != 3 {
		t.Fatalf("%+v", sp)
	}
	if got := UsableEndpoints(sp.Endpoints, 4, false, "", ""); len(got) != 2 {
		t.Fatalf("usable %v, want the 2 ready addresses", got)
	}
	if sp.Endpoints[0].NodeName != "n1" {
		t.Fatalf("nodeName lost: %+v", sp.Endpoints[0])
	}
}

func TestEndpointSlicesWinOverEndpoints(t *testing.T) {
	st := mustState(t, `
apiVersion: v1
kind: Endpoints
metadata: {name: s}
subsets: [{addresses: [{ip: 10.1.0.1}], ports: [{port: 80}]}]
---
apiVersion: v1
kind: Service
metadata: {name: s}
spec: {clusterIP: 10.96.0.8, ports: [{port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: s-1, labels: {kubernetes.io/service-name: s}}
addressType: IPv4
ports: [{port: 80}]
endpoints: [{addresses: [10.1.0.9]}]
`)
	if eps := port(t, st, "default/s").Endpoints; len(eps) != 1 || eps[0].Addr.String() != "10.1.0.9:80" {
		t.Fatalf("endpoints %v: the slice should win, and not be doubled", eps)
	}
}

func TestSkipRules(t *testing.T) {
	st, skipped, err := loadString(t, `
apiVersion: v1
kind: Service
metadata: {name: headless}
spec: {clusterIP: None, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: ext}
spec: {type: ExternalName, externalName: example.com}
---
apiVersion: v1
kind: Service
metadata: {name: other, labels: {service.kubernetes.io/service-proxy-name: someone-else}}
spec: {clusterIP: 10.96.0.9, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: labelled-headless, labels: {service.kubernetes.io/headless: ""}}
spec: {clusterIP: 10.96.0.11, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: kept}
spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: kept-h, labels: {kubernetes.io/service-name: kept, service.kubernetes.io/headless: ""}}
addressType: IPv4
endpoints: [{addresses: [10.1.0.1]}]
ports: [{port: 80}]
`)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Ports) != 1 || len(port(t, st, "default/kept").Endpoints) != 0 {
		t.Fatalf("ports %v", st.Ports)
	}
	if len(skipped) != 5 {
		t.Fatalf("skipped %v, want headless, ExternalName, proxy-name, the Service labelled headless and the headless slice", skipped)
	}
}

func loadString(t *testing.T, content string) (*State, []Skipped, error) {
	t.Helper()
	f := filepath.Join(t.TempDir(), "m.yaml")
	if err := os.WriteFile(f, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return LoadManifests(f, "node-a")
}

func TestInvalidManifestsNameFileDocumentAndReason(t *testing.T) {
	valid := "apiVersion: v1\nkind: Service\nmetadata: {name: ok}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n"
	for _, tc := range []struct {
		name, doc, want string
	}{
		{"yaml syntax", "apiVersion: v1\nkind: Service\nmetadata: [", "document 2"},
		{"bad clusterIP", "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {clusterIP: 10.96.0.300, ports: [{port: 80}]}", `spec.clusterIP: "10.96.0.300" is not an IP address`},
		{"bad port", "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {clusterIP: 10.96.0.3, ports: [{port: 70000}]}", "spec.ports[0].port: 70000"},
		{"unknown field", "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {clusterIP: 10.96.0.3, prots: []}", `unknown field "spec.prots"`},
		{"missing kind", "apiVersion: v1\nmetadata: {name: x}", "apiVersion and kind are required"},
		{"unnamed multi-port", "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {clusterIP: 10.96.0.3, ports: [{port: 80}, {port: 81}]}", "spec.ports[0].name: required"},
		{"slice address family", "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: e, labels: {kubernetes.io/service-name: ok}}\naddressType: IPv4\nports: [{port: 80}]\nendpoints: [{addresses: ['fd00::1']}]", "does not match addressType IPv4"},
		{"list item", "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Service, metadata: {name: yy}, spec: {clusterIP: bad, ports: [{port: 1}]}}", "document 2 items[0] (Service default/yy)"},
		{"duplicate", valid, "defined twice"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := loadString(t, valid+"---\n"+tc.doc)
			var me *ManifestError
			if !errors.As(err, &me) {
				t.Fatalf("got %v, want a *ManifestError", err)
			}
			if !strings.Contains(err.Error(), "m.yaml: document 2") || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not name the file, document 2 and %q", err, tc.want)
			}
		})
	}
}

func TestDirectoryOfManifests(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("a-svc.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n")
	write("b-eps.json", `{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{"name":"s1","labels":{"kubernetes.io/service-name":"s"}},"addressType":"IPv4","ports":[{"port":8080}],"endpoints":[{"addresses":["10.1.0.1"]}]}`)
	write("notes.txt", "not a manifest")
	st, _, err := LoadManifests(dir, "n")
	if err != nil {
		t.Fatal(err)
	}
	if eps := port(t, st, "default/s").Endpoints; len(eps) != 1 || eps[0].Addr.String() != "10.1.0.1:8080" {
		t.Fatalf("endpoints %v", eps)
	}
}

// recordingSink keeps every State it is given.
type recordingSink struct {
	mu     sync.Mutex
	states []*State
}

func (s *recordingSink) Update(st *State) {
	s.mu.Lock()
	s.states = append(s.states, st)
	s.mu.Unlock()
}

func (s *recordingSink) last() (*State, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.states[len(s.states)-1], len(s.states)
}

func TestManifestSourceReloads(t *testing.T) {
	f := filepath.Join(t.TempDir(), "m.yaml")
	write := func(content string) {
		// Write a temporary file and rename it over the old one, as editors do.
		tmp := f + ".tmp"
		if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, f); err != nil {
			t.Fatal(err)
		}
	}
	svc := func(port string) string {
		return "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {clusterIP: 10.96.0.1, ports: [{port: " + port + "}]}\n"
	}
	write(svc("80"))
	log := logrus.New()
	log.SetOutput(io.Discard)
	sink := &recordingSink{}
	ctx, cancel := context.WithCancel(context.Background())
	src := &ManifestSource{Path: f, Node: "n", Sink: sink, Log: log}
	done, err := src.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { cancel(); <-done }()

	waitPort := func(want int) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for {
			st, _ := sink.last()
			if sp := st.Ports[ServicePortName{Namespace: "default", Name: "s"}]; sp != nil && sp.Port == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("port %d never applied", want)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	waitPort(80)
	write(svc("81"))
	waitPort(81)

	// A broken file keeps the last good state: no new State is sent.
	_, before := sink.last()
	write(svc("not-a-number"))
	time.Sleep(500 * time.Millisecond) // nothing to wait for: proving an absence
	if st, n := sink.last(); n != before || st.Ports[ServicePortName{Namespace: "default", Name: "s"}].Port != 81 {
		t.Fatalf("an invalid file replaced the state (%d -> %d updates)", before, n)
	}
	write(svc("82"))
	waitPort(82)
}

func FuzzParseManifests(f *testing.F) {
	for _, seed := range []string{kubectlList, "", "---\n---", "apiVersion: v1\nkind: List\nitems: [null]",
		"apiVersion: v1\nkind: Endpoints\nmetadata: {name: a}\nsubsets: [{addresses: [{ip: '::1'}], ports: [{port: 1}]}]"} {
		f.Add([]byte(seed))
	}
	data, _ := os.ReadFile("../docs/examples/devpaasy.yaml")
	f.Add(data)
	f.Fuzz(func(t *testing.T, data []byte) {
		st, err := ParseManifests("fuzz.yaml", data, "n")
		if err != nil {
			var me *ManifestError
			if !errors.As(err, &me) {
				t.Fatalf("error %v is not a *ManifestError", err)
			}
			return
		}
		for name, sp := range st.Ports {
			if sp.Name != name || sp.Port < 1 || sp.Port > 65535 || len(sp.ClusterIPs) == 0 {
				t.Fatalf("invalid service port accepted: %+v", sp)
			}
			for _, ep := range sp.Endpoints {
				if !ep.Addr.IsValid() {
					t.Fatalf("invalid endpoint accepted: %+v", ep)
				}
			}
		}
	})
}

// A file rewritten in place, in chunks with pauses (a slow `kubectl get -o
// yaml > f.yaml`), is read half-written at times: no State handed on may
// lack a Service or an endpoint that is in both the old and the new content.
// A removal that is meant applies once the file is stable.
func TestManifestRewrittenInPlaceDropsNothing(t *testing.T) {
	f := filepath.Join(t.TempDir(), "m.yaml")
	doc := func(names ...string) string {
		var b strings.Builder
		for i, n := range names {
			fmt.Fprintf(&b, "---\napiVersion: v1\nkind: Service\nmetadata: {name: %[1]s}\nspec: {clusterIP: 10.96.0.%[2]d, ports: [{port: 80}]}\n"+
				"---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: %[1]s-1, labels: {kubernetes.io/service-name: %[1]s}}\n"+
				"addressType: IPv4\nports: [{port: 8080}]\nendpoints: [{addresses: [10.1.0.%[2]d]}]\n", n, i+1)
		}
		return b.String()
	}
	all := []string{"a", "b", "c", "d"}
	if err := os.WriteFile(f, []byte(doc(all...)), 0o644); err != nil {
		t.Fatal(err)
	}
	log := logrus.New()
	log.SetOutput(io.Discard)
	sink := &recordingSink{}
	ctx, cancel := context.WithCancel(context.Background())
	src := &ManifestSource{Path: f, Node: "n", Sink: sink, Log: log, Settle: 500 * time.Millisecond}
	done, err := src.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { cancel(); <-done }()

	// Rewritten in place: truncated, then written in three chunks with
	// pauses long enough for the watcher to read each state in between.
	content := []byte(doc(all...))
	w, err := os.OpenFile(f, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		time.Sleep(100 * time.Millisecond)
		part := content[len(content)*i/3 : len(content)*(i+1)/3]
		if _, err := w.Write(part); err != nil {
			t.Fatal(err)
		}
	}
	w.Close()
	time.Sleep(800 * time.Millisecond) // past the settle time: proving an absence of drops
	sink.mu.Lock()
	states := append([]*State(nil), sink.states...)
	sink.mu.Unlock()
	if len(states) < 2 {
		t.Logf("only %d states handed on: the watcher read no half-written file this time", len(states))
	}
	for i, st := range states {
		for _, n := range all {
			sp := st.Ports[ServicePortName{Namespace: "default", Name: n}]
			if sp == nil || len(sp.Endpoints) != 1 {
				t.Fatalf("state %d of %d lacks Service %s or its endpoint: %+v", i+1, len(states), n, sp)
			}
		}
	}
	// A real removal, written atomically, applies once the file is stable.
	tmp := f + ".tmp"
	if err := os.WriteFile(tmp, []byte(doc("a", "b")), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, f); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, "the removal applied", 5*time.Second, 10*time.Millisecond, func() bool {
		st, _ := sink.last()
		return len(st.Ports) == 2
	})
	// Every State after the first says what changed since the one before
	// it, held removals included, so that the proxier visits those ports
	// alone (a State without Since costs a visit of every port: 60 ms at
	// 10k). The held one names the ports it holds, the one that lets them
	// go names them again.
	sink.mu.Lock()
	states = append([]*State(nil), sink.states...)
	sink.mu.Unlock()
	for i := 1; i < len(states); i++ {
		prev, cur := states[i-1], states[i]
		if cur.Since == 0 || cur.Since != prev.Seq {
			t.Fatalf("state %d of %d: seq %d since %d, want since %d (the state before)", i+1, len(states), cur.Seq, cur.Since, prev.Seq)
		}
		for _, n := range []string{"a", "b", "c", "d"} {
			name := ServicePortName{Namespace: "default", Name: n}
			if prev.Ports[name] != cur.Ports[name] && !slices.Contains(cur.Changed, name) {
				t.Fatalf("state %d of %d: %s differs from the state before but is not named in %v", i+1, len(states), n, cur.Changed)
			}
		}
	}
}

// A file replaced by a rename (a new inode) was written whole: what it
// removes applies at once, well before the settle time. A removal written
// in place still waits for the file to be stable, while what the same write
// adds applies at once.
func TestRenamedFileRemovesAtOnce(t *testing.T) {
	f := filepath.Join(t.TempDir(), "m.yaml")
	doc := func(names ...string) string {
		var b strings.Builder
		for _, n := range names {
			fmt.Fprintf(&b, "---\napiVersion: v1\nkind: Service\nmetadata: {name: %s}\nspec: {clusterIP: 10.96.1.%d, ports: [{port: 80}]}\n", n, n[0]-'a'+1)
		}
		return b.String()
	}
	if err := os.WriteFile(f, []byte(doc("a", "b", "c")), 0o644); err != nil {
		t.Fatal(err)
	}
	log := logrus.New()
	log.SetOutput(io.Discard)
	sink := &recordingSink{}
	ctx, cancel := context.WithCancel(context.Background())
	src := &ManifestSource{Path: f, Node: "n", Sink: sink, Log: log, Settle: time.Hour}
	done, err := src.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { cancel(); <-done }()
	has := func(st *State, n string) bool {
		return st != nil && st.Ports[ServicePortName{Namespace: "default", Name: n}] != nil
	}

	tmp := f + ".tmp"
	if err := os.WriteFile(tmp, []byte(doc("a", "b")), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, f); err != nil {
		t.Fatal(err)
	}
	// Settle is an hour: only a removal that does not wait passes.
	testutil.WaitFor(t, "the renamed file's removal", 10*time.Second, 10*time.Millisecond, func() bool {
		st, _ := sink.last()
		return has(st, "a") && !has(st, "c")
	})

	if err := os.WriteFile(f, []byte(doc("a", "e")), 0o644); err != nil { // in place: same inode
		t.Fatal(err)
	}
	testutil.WaitFor(t, "the in-place write's addition", 10*time.Second, 10*time.Millisecond, func() bool {
		st, _ := sink.last()
		return has(st, "e")
	})
	if st, _ := sink.last(); !has(st, "b") {
		t.Fatal("a removal written in place applied before the file was stable")
	}
}

// An SCTP port is not proxied, and the loader says so as a warning naming
// the Service and the port; the Service's TCP port is served.
func TestSCTPPortWarned(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "m.yaml")
	if err := os.WriteFile(f, []byte(`apiVersion: v1
kind: Service
metadata: {name: mixed, namespace: lab}
spec:
  clusterIP: 10.96.0.70
  ports:
  - {name: http, port: 80, protocol: TCP}
  - {name: assoc, port: 9999, protocol: SCTP}
`), 0o644); err != nil {
		t.Fatal(err)
	}
	st, skipped, err := LoadManifests(f, "node")
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Ports) != 1 || st.Ports[ServicePortName{"lab", "mixed", "http"}] == nil {
		t.Fatalf("ports %v, want lab/mixed:http only", st.Ports)
	}
	if len(skipped) != 1 || !skipped[0].Warning || skipped[0].Object != "Service lab/mixed" || !strings.Contains(skipped[0].Reason, "assoc 9999/SCTP") {
		t.Fatalf("skipped %+v, want one warning for Service lab/mixed naming assoc 9999/SCTP", skipped)
	}
}

// Names, addresses and ports the API server would refuse are refused here
// too, naming the field: such a name made iptables-nft rewrite the rule
// comment, so the installed rules never matched ours.
func TestManifestsValidatedAsTheAPIServer(t *testing.T) {
	svc := func(meta, spec string) string {
		return "apiVersion: v1\nkind: Service\nmetadata: {" + meta + "}\nspec: {clusterIP: 10.96.0.70, " + spec + "}\n"
	}
	ports := "ports: [{name: http, port: 80}]"
	for _, tc := range []struct{ doc, want string }{
		{svc("name: "+strings.Repeat("a", 250)+", namespace: lab", ports), "metadata.name"},
		{svc(`name: web, namespace: "la\"b\u0007"`, ports), "metadata.namespace"},
		{svc("name: Web, namespace: lab", ports), "metadata.name"},
		{svc("name: web, namespace: lab", `externalIPs: ["fe80::1%eth0"], `+ports), "spec.externalIPs[0]"},
		{svc("name: web, namespace: lab", "healthCheckNodePort: 70000, "+ports), "spec.healthCheckNodePort"},
		{svc("name: web, namespace: lab", "ports: [{name: \"http port\", port: 80}]"), "spec.ports[0].name"},
		{"apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: s, namespace: lab, labels: {kubernetes.io/service-name: \"we b\"}}\naddressType: IPv4\nendpoints: []\n", "kubernetes.io/service-name"},
		{svc(`name: web, namespace: lab, annotations: {"bad key/with/slashes": "x"}`, ports), "metadata.annotations"},
		{svc(`name: web, namespace: lab, annotations: {big: "`+strings.Repeat("x", 256*1024)+`"}`, ports), "metadata.annotations"},
		{svc(`name: web, namespace: lab, labels: {app: "not a value"}`, ports), "metadata.labels"},
		{"apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: s, namespace: lab, labels: {kubernetes.io/service-name: web}, annotations: {\"-x\": y}}\naddressType: IPv4\nendpoints: []\n", "metadata.annotations"},
	} {
		_, err := ParseManifests("m.yaml", []byte(tc.doc), "node")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%.60q: %v, want an error naming %s", tc.doc, err, tc.want)
		}
	}
	// What the API server accepts is accepted: a service port's name is a
	// DNS label (up to 63 characters), not a container port's 15.
	if _, err := ParseManifests("m.yaml", []byte(svc("name: web, namespace: lab", "ports: [{name: mutable-named-port, port: 8001}]")), "node"); err != nil {
		t.Errorf("an 18-character port name: %v", err)
	}
}
