package proxy

import (
	"net/netip"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

func TestExplainEndpointSelection(t *testing.T) {
	sp := &config.ServicePort{
		Name: config.ServicePortName{Namespace: "ns", Name: "web"}, Protocol: config.TCP, Port: 80, NodePort: 30080,
		ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")}, ExternalLocal: true,
		Endpoints: []config.Endpoint{
			{Addr: netip.MustParseAddrPort("10.1.0.1:8080"), Ready: true, Serving: true, NodeName: "a"},
			{Addr: netip.MustParseAddrPort("10.1.0.2:8080"), Ready: true, Serving: true, NodeName: "b"},
			{Addr: netip.MustParseAddrPort("10.1.0.3:8080"), Serving: true, Terminating: true, NodeName: "a"},
			{Addr: netip.MustParseAddrPort("10.1.0.4:8080"), NodeName: "a"},
		},
	}
	st := &config.State{Ports: map[config.ServicePortName]*config.ServicePort{sp.Name: sp}, Node: "a"}
	fes := Plan(st, netip.IPv4Unspecified(), false)
	internal, as, ok := Match(fes, netip.MustParseAddrPort("10.96.0.10:80"), config.TCP, false)
	if !ok || as != AsClusterIP || internal.Kind != config.KindInternal {
		t.Fatalf("ClusterIP matched %v %s %v", ok, as, internal.Kind)
	}
	external, as, ok := Match(fes, netip.MustParseAddrPort("192.168.1.1:30080"), config.TCP, true)
	if !ok || as != AsNodePort || external.Kind != config.KindExternal {
		t.Fatalf("NodePort matched %v %s %v", ok, as, external.Kind)
	}
	if _, _, ok := Match(fes, netip.MustParseAddrPort("192.168.1.1:30080"), config.TCP, false); ok {
		t.Fatal("a NodePort matched on an address that is not the node's")
	}
	if _, _, ok := Match(fes, netip.MustParseAddrPort("10.96.0.10:80"), config.UDP, false); ok {
		t.Fatal("UDP matched a TCP port")
	}
	x := ExplainPlanned(internal, AsClusterIP, netip.MustParseAddr("192.0.2.1"), "a", "")
	if x.TrafficPolicy != "Cluster" || !x.Endpoints[0].Selected || !x.Endpoints[1].Selected || x.Endpoints[2].Selected || x.Endpoints[3].Selected {
		t.Fatalf("internal: %+v", x.Endpoints)
	}
	if x.Endpoints[2].Why != "terminating: used only when no endpoint is ready" || x.Endpoints[3].Why != "not ready" {
		t.Fatalf("why: %q, %q", x.Endpoints[2].Why, x.Endpoints[3].Why)
	}
	if x.Next.Endpoint != nil || len(x.Next.Candidates) != 2 {
		t.Fatalf("offline round-robin with two endpoints predicted %+v; want the two candidates", x.Next)
	}
	x = ExplainPlanned(external, AsNodePort, netip.MustParseAddr("192.0.2.1"), "a", "")
	if x.TrafficPolicy != "Local" || !x.Endpoints[0].Selected || x.Endpoints[1].Selected ||
		x.Endpoints[1].Why != "traffic policy Local, and the endpoint is on node b" {
		t.Fatalf("external: %+v", x.Endpoints)
	}
	if x.Next.Endpoint == nil || *x.Next.Endpoint != netip.MustParseAddrPort("10.1.0.1:8080") {
		t.Fatalf("external, one local endpoint: predicted %+v", x.Next)
	}
}
