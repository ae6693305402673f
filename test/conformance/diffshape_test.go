package main

import (
	"context"
	"net"
	"reflect"
	"regexp"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
)

// The generator is a pure function of seed and case, and draws every
// dimension the differential promises, in shapes the API server takes.
func TestGenerateIsDeterministicAndCoversTheDimensions(t *testing.T) {
	seen := map[string]bool{}
	for c := 0; c < 400; c++ {
		a, b := generate(7, c), generate(7, c)
		if !reflect.DeepEqual(a, b) {
			t.Fatalf("case %d drawn twice differs:\n%+v\n%+v", c, a, b)
		}
		if !a.valid() {
			continue
		}
		svc := a.service()
		seen["type="+string(svc.Spec.Type)] = true
		for k, ok := range map[string]bool{
			"headless": a.Headless, "other-proxy": a.OtherProxy, "external-ip": a.ExternalIP, "lb-ip": a.LBIP,
			"source-range": a.SourceRange != "", "etp-local": a.ETPLocal, "itp-local": a.ITPLocal, "affinity": a.Affinity != 0,
			"dual-stack": a.DualStack, "prefer-close": a.PreferClose, "edit": a.Edit != nil, "no-endpoints": len(a.Endpoints) == 0,
		} {
			seen[k] = seen[k] || ok
		}
		for _, p := range a.Ports {
			seen["proto="+string(p.Proto)] = true
			seen["named="+map[bool]string{true: "yes", false: "no"}[p.Named]] = true
		}
		for _, ep := range a.Endpoints {
			seen["alt"] = seen["alt"] || ep.Alt
			seen["terminating"] = seen["terminating"] || ep.Terminating
			seen["not-ready"] = seen["not-ready"] || (!ep.Ready && !ep.Terminating)
			seen["hint"] = seen["hint"] || ep.Hint != ""
		}
		if a.Edit != nil {
			seen["edit="+a.Edit.Kind] = true
			if e := a.edited(); !e.valid() {
				t.Errorf("case %d: the edit makes an invalid shape: %+v", c, e)
			}
		}
		if svc.Spec.ExternalTrafficPolicy == v1.ServiceExternalTrafficPolicyLocal && svc.Spec.Type == v1.ServiceTypeClusterIP &&
			len(svc.Spec.ExternalIPs) == 0 {
			t.Errorf("case %d: externalTrafficPolicy Local on a ClusterIP Service without external IPs", c)
		}
	}
	for _, want := range []string{"type=ClusterIP", "type=NodePort", "type=LoadBalancer", "headless", "other-proxy", "external-ip", "lb-ip",
		"source-range", "etp-local", "itp-local", "affinity", "dual-stack", "prefer-close", "no-endpoints", "proto=TCP", "proto=UDP",
		"named=yes", "named=no", "alt", "terminating", "not-ready", "hint",
		"edit=scale-up", "edit=scale-down", "edit=rename-port", "edit=flip-policy", "edit=terminate"} {
		if !seen[want] {
			t.Errorf("400 cases never drew %s", want)
		}
	}
}

// A renamed port keeps its EndpointSlices' name: the Service's port then
// has no endpoints, as after a real rename before the controller catches up.
func TestRenameEditLeavesTheSlicesBehind(t *testing.T) {
	s := shape{Case: 1, Type: v1.ServiceTypeClusterIP, Ports: []shapePort{{Name: "p0", Proto: v1.ProtocolTCP, Port: 80}},
		Endpoints: []shapeEP{{Pod: 0, Ready: true, Serving: true}}, Edit: &shapeEdit{Kind: "rename-port"}}
	e := s.edited()
	if got := e.service().Spec.Ports[0].Name; got != "p0x" {
		t.Fatalf("the Service's port after the rename: %q", got)
	}
	if got := *e.slices(map[string]string{"pool-1a": "10.244.1.5"})[0].Ports[0].Name; got != "p0" {
		t.Fatalf("the slice's port after the rename: %q, want the old p0", got)
	}
	if s.Ports[0].Name != "p0" {
		t.Fatal("edited() changed the shape it was called on")
	}
}

// Shrinking only ever offers valid shapes strictly smaller than the one
// it starts from, and reaches a one-port shape.
func TestSmallerShrinks(t *testing.T) {
	for c := 0; c < 100; c++ {
		s := generate(3, c)
		if !s.valid() {
			continue
		}
		for _, n := range s.smaller() {
			if !n.valid() || n.size() >= s.size() {
				t.Fatalf("case %d: candidate %+v (size %d) from size %d", c, n, n.size(), s.size())
			}
		}
		for steps := 0; ; steps++ {
			cands := s.smaller()
			if len(cands) == 0 {
				break
			}
			s = cands[0]
			if steps > 100 {
				t.Fatal("shrinking does not end")
			}
		}
		if len(s.Ports) != 1 || len(s.Endpoints) != 0 || s.Type != v1.ServiceTypeClusterIP {
			t.Errorf("case %d shrinks to %s with %d ports", c, s.describe(), len(s.Ports))
		}
	}
}

// Known differences match what an observation looks like.
func TestKnownDifferencesMatchTheLine(t *testing.T) {
	s := shape{Case: 9, Type: v1.ServiceTypeNodePort, ETPLocal: true, Ports: []shapePort{{Name: "p0", Proto: v1.ProtocolTCP, Port: 80}}}
	df := difference{shape: s, key: "outside → node-port@node3/p0/TCP", field: "outcome", ours: "refused", ref: "timeout"}
	line := df.line()
	for _, want := range []string{"outcome: ours=refused kube-proxy=timeout", "outside → node-port@node3/p0/TCP", "created", "type=NodePort", "etp=Local"} {
		if !strings.Contains(line, want) {
			t.Errorf("line %q lacks %q", line, want)
		}
	}
	d := &differ{
		known: []knownDiff{
			{pattern: "x", reason: "on purpose", re: regexp.MustCompile(`^outcome: ours=refused kube-proxy=timeout \| outside → node-port.*etp=Local`)},
		},
	}
	if d.explain(df) != "on purpose" {
		t.Error("the pattern does not explain its difference")
	}
	df.ours = "connected"
	if d.explain(df) != "" {
		t.Error("the pattern explains another difference")
	}
}

// Observations compare field by field; an outcome difference hides the rest.
func TestCompareObs(t *testing.T) {
	s := shape{}
	a := observation{Outcome: "connected", Endpoints: []string{"pool-1a", "pool-2a"}, Sources: []string{"client"}}
	b := a
	if got := compareObs(s, a, b); len(got) != 0 {
		t.Fatalf("equal observations differ: %v", got)
	}
	b.Endpoints = []string{"pool-1a"}
	b.Sources = []string{"kupc-node1"}
	if got := compareObs(s, a, b); len(got) != 2 || got[0][0] != "endpoints" || got[1][0] != "sources" {
		t.Fatalf("got %v", got)
	}
	b.Outcome = "timeout"
	if got := compareObs(s, a, b); len(got) != 1 || got[0][0] != "outcome" {
		t.Fatalf("got %v", got)
	}
	s.Affinity = 60
	a.Sticky, b = true, a
	b.Endpoints, b.Sticky = []string{"pool-3a"}, true
	if got := compareObs(s, a, b); len(got) != 0 {
		t.Fatalf("two sticky observations on other endpoints differ: %v", got)
	}
}

// The shipped list parses, and each of its patterns is anchored to a field.
func TestKnownDifferencesFileParses(t *testing.T) {
	known, err := readKnownDiffs("differential-known.txt")
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range known {
		if !strings.HasPrefix(k.pattern, "^") {
			t.Errorf("%q is not anchored at the field: it could match anything", k.pattern)
		}
	}
}

// UDP tries send from ports below the ephemeral range, a new one each
// time, skipping a port something else holds.
func TestDialUDPFromUnusedPort(t *testing.T) {
	echo, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer echo.Close()
	dial := func() int {
		t.Helper()
		c, err := dialUDPFromUnusedPort(context.Background(), "", echo.LocalAddr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		p := c.LocalAddr().(*net.UDPAddr).Port
		if p < udpSourcePortFirst || p >= udpSourcePortFirst+udpSourcePorts {
			t.Fatalf("source port %d outside %d+%d", p, udpSourcePortFirst, udpSourcePorts)
		}
		return p
	}
	first := dial()
	// The next port is held: the dial takes the one after.
	held := udpSourcePortFirst + (first+1-udpSourcePortFirst)%udpSourcePorts
	if h, err := net.ListenUDP("udp", &net.UDPAddr{Port: held}); err == nil {
		defer h.Close()
	} // else something here holds it already
	if got := dial(); got == first || got == held {
		t.Fatalf("second dial from port %d (first %d, held %d): want a new, free one", got, first, held)
	}
}
