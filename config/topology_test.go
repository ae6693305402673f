package config

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func hintedEP(addr string, ready bool, node, zones, nodes string) Endpoint {
	return Endpoint{Addr: netip.MustParseAddrPort(addr), Ready: ready, Serving: ready, NodeName: node, ZoneHints: zones, NodeHints: nodes}
}

// kube-proxy's rules: hints count only when every ready endpoint has them
// and one is for this node (or its zone); node hints before zone hints;
// traffic policy Local ignores them.
func TestTopologyHints(t *testing.T) {
	a1 := hintedEP("10.0.0.1:80", true, "n1", "a", "n1")
	a2 := hintedEP("10.0.0.2:80", true, "n2", "a", "n2")
	b3 := hintedEP("10.0.0.3:80", true, "n3", "b", "n3")
	noHints := hintedEP("10.0.0.4:80", true, "n4", "", "")
	notReadyNoHints := hintedEP("10.0.0.5:80", false, "n5", "", "")
	addrs := func(eps ...Endpoint) []netip.AddrPort {
		var out []netip.AddrPort
		for _, e := range eps {
			out = append(out, e.Addr)
		}
		return out
	}
	zoneOnly := func(eps ...Endpoint) []Endpoint {
		out := slices.Clone(eps)
		for i := range out {
			out[i].NodeHints = ""
		}
		return out
	}
	for _, tc := range []struct {
		name       string
		eps        []Endpoint
		node, zone string
		local      bool
		mode       string
		want       []netip.AddrPort
	}{
		{"node hints for this node", []Endpoint{a1, a2, b3}, "n2", "a", false, TopologyNode, addrs(a2)},
		{"zone hints when no node hint is for this node", []Endpoint{a1, a2, b3}, "n9", "a", false, TopologyZone, addrs(a1, a2)},
		{"zone hints only", zoneOnly(a1, a2, b3), "n3", "b", false, TopologyZone, addrs(b3)},
		{"no endpoint for this zone: all", zoneOnly(a1, b3), "n9", "c", false, TopologyNone, addrs(a1, b3)},
		{"zone unknown: all", zoneOnly(a1, b3), "n9", "", false, TopologyNone, addrs(a1, b3)},
		{"one ready endpoint without hints: all", zoneOnly(a1, b3, noHints), "n9", "a", false, TopologyNone, addrs(a1, b3, noHints)},
		{"a not-ready endpoint without hints does not matter", zoneOnly(a1, b3, notReadyNoHints), "n9", "b", false, TopologyZone, addrs(b3)},
		{"traffic policy Local wins", []Endpoint{a1, a2, b3}, "n3", "a", true, TopologyNone, addrs(b3)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !tc.local {
				if m := TopologyMode(tc.eps, 4, tc.node, tc.zone); m != tc.mode {
					t.Fatalf("mode %q, want %q", m, tc.mode)
				}
			}
			if got := UsableEndpoints(tc.eps, 4, tc.local, tc.node, tc.zone); !slices.Equal(got, tc.want) {
				t.Fatalf("usable %v, want %v", got, tc.want)
			}
		})
	}
	// Terminating endpoints stand in only within the topology.
	ta := hintedEP("10.0.0.6:80", false, "n1", "a", "")
	ta.Serving, ta.Terminating = true, true
	tb := hintedEP("10.0.0.7:80", false, "n3", "b", "")
	tb.Serving, tb.Terminating = true, true
	if got := UsableEndpoints([]Endpoint{hintedEP("10.0.0.1:80", true, "n1", "a", ""), ta, tb}, 4, false, "n9", "a"); !slices.Equal(got, addrs(a1)) {
		t.Fatalf("%v", got)
	}
}

// Manifests carry what the cluster would: hints, source ranges, the health
// check node port, and this node's Node object (zone, removal taint).
func TestManifestsTopologyAndLoadBalancerFields(t *testing.T) {
	m := filepath.Join(t.TempDir(), "m.yaml")
	os.WriteFile(m, []byte(`apiVersion: v1
kind: Node
metadata: {name: node-a, labels: {topology.kubernetes.io/zone: zone-a}}
spec:
  taints: [{key: ToBeDeletedByClusterAutoscaler, value: "1", effect: NoSchedule}]
---
apiVersion: v1
kind: Node
metadata: {name: node-b, labels: {topology.kubernetes.io/zone: zone-b}}
---
apiVersion: v1
kind: Service
metadata: {name: lb, namespace: ns}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.5
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  loadBalancerSourceRanges: [" 10.244.1.0/24", "2001:db8::/32"]
  trafficDistribution: PreferSameZone
  ports: [{port: 80, targetPort: 8080, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-1, namespace: ns, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- {addresses: [10.244.1.5], nodeName: node-a, hints: {forZones: [{name: zone-a}], forNodes: [{name: node-a}]}}
- {addresses: [10.244.2.5], nodeName: node-b, hints: {forZones: [{name: zone-b}]}}
`), 0o644)
	st, _, err := LoadManifests(m, "node-a")
	if err != nil {
		t.Fatal(err)
	}
	if st.Zone != "zone-a" || !st.NodeDeleting {
		t.Fatalf("zone %q, deleting %v", st.Zone, st.NodeDeleting)
	}
	sp := st.Ports[ServicePortName{Namespace: "ns", Name: "lb"}]
	if sp.HealthCheckNodePort != 32000 || sp.TrafficDistribution != "PreferSameZone" ||
		!slices.Equal(sp.SourceRanges, []netip.Prefix{netip.MustParsePrefix("10.244.1.0/24"), netip.MustParsePrefix("2001:db8::/32")}) {
		t.Fatalf("%+v", sp)
	}
	if sp.Endpoints[0].ZoneHints != "zone-a" || sp.Endpoints[0].NodeHints != "node-a" || sp.Endpoints[1].ZoneHints != "zone-b" {
		t.Fatalf("hints %+v", sp.Endpoints)
	}
	if got := UsableEndpoints(sp.Endpoints, 4, false, st.Node, st.Zone); len(got) != 1 || got[0].String() != "10.244.1.5:8080" {
		t.Fatalf("usable in zone-a: %v", got)
	}
	st, _, _ = LoadManifests(m, "node-b")
	if st.Zone != "zone-b" || st.NodeDeleting {
		t.Fatalf("node-b: zone %q, deleting %v", st.Zone, st.NodeDeleting)
	}
	os.WriteFile(m, []byte("apiVersion: v1\nkind: Service\nmetadata: {name: x, namespace: ns}\nspec:\n  clusterIP: 10.96.0.6\n  loadBalancerSourceRanges: [nope]\n  ports: [{port: 80}]\n"), 0o644)
	if _, _, err := LoadManifests(m, "n"); err == nil || !strings.Contains(err.Error(), "spec.loadBalancerSourceRanges[0]") {
		t.Fatalf("a bad range: %v", err)
	}
}
