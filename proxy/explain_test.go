package proxy

import (
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// Predict answers what the next Pick returns, for every scheduler, through
// affinity, ejection and drain, and changes nothing by asking.
func TestPredictAgreesWithPick(t *testing.T) {
	outlier := OutlierConfig{ConsecutiveFailures: 1, BaseEjectionTime: time.Minute, MaxEjectionTime: time.Hour}
	for _, sched := range []string{SchedRoundRobin, SchedLeastConn, SchedSourceHash} {
		for _, affinity := range []time.Duration{0, time.Hour} {
			t.Run(sched+"/affinity="+affinity.String(), func(t *testing.T) {
				clk := &fakeClock{t: time.Unix(1000, 0)}
				b := NewBalancer(sched)
				b.now = clk.now
				b.Update(eps("10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:80"), affinity, outlier, sched)
				clients := []netip.Addr{clientA, clientB, clientA, netip.MustParseAddr("192.0.2.3")}
				for i := 0; i < 24; i++ {
					c := clients[i%len(clients)]
					switch i {
					case 8: // eject one endpoint
						b.Report(netip.MustParseAddrPort("10.0.0.2:80"), true)
					case 12:
						b.SetDrained(netip.MustParseAddrPort("10.0.0.3:80"), true)
					case 16:
						clk.advance(2 * time.Hour) // pins expire, ejection ends
					}
					pr := b.Predict(c)
					if again := b.Predict(c); !samePrediction(pr, again) {
						t.Fatalf("step %d: asking twice changed the answer: %+v, then %+v", i, pr, again)
					}
					ep, why, ok := b.Pick(c, 0)
					if !ok || pr.Endpoint == nil || *pr.Endpoint != ep || pr.Reason != why {
						t.Fatalf("step %d (client %s): predicted %v (%s), picked %s (%s)", i, c, pr.Endpoint, pr.Reason, ep, why)
					}
					if i%3 == 0 {
						b.Done(ep) // lc sees connections end
					}
				}
			})
		}
	}
}

func samePrediction(a, b Prediction) bool {
	return (a.Endpoint == nil) == (b.Endpoint == nil) && (a.Endpoint == nil || *a.Endpoint == *b.Endpoint) && a.Reason == b.Reason
}

func TestPredictRandomAndEmpty(t *testing.T) {
	b := NewBalancer(SchedRandom)
	if pr := b.Predict(clientA); pr.Endpoint != nil || len(pr.Candidates) != 0 {
		t.Fatalf("no endpoints: %+v", pr)
	}
	b.Update(eps("10.0.0.1:80", "10.0.0.2:80"), 0, OutlierConfig{}, SchedRandom)
	b.SetDrained(netip.MustParseAddrPort("10.0.0.2:80"), true)
	pr := b.Predict(clientA)
	if pr.Endpoint != nil || len(pr.Candidates) != 1 || pr.Candidates[0] != netip.MustParseAddrPort("10.0.0.1:80") || pr.Reason != ReasonRandom {
		t.Fatalf("random: %+v", pr)
	}
}

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
	x := ExplainPlanned(internal, AsClusterIP, clientA, "a", "")
	if x.TrafficPolicy != "Cluster" || !x.Endpoints[0].Selected || !x.Endpoints[1].Selected || x.Endpoints[2].Selected || x.Endpoints[3].Selected {
		t.Fatalf("internal: %+v", x.Endpoints)
	}
	if x.Endpoints[2].Why != "terminating: used only when no endpoint is ready" || x.Endpoints[3].Why != "not ready" {
		t.Fatalf("why: %q, %q", x.Endpoints[2].Why, x.Endpoints[3].Why)
	}
	if x.Next.Endpoint != nil || len(x.Next.Candidates) != 2 {
		t.Fatalf("offline round-robin with two endpoints predicted %+v; want the two candidates", x.Next)
	}
	x = ExplainPlanned(external, AsNodePort, clientA, "a", "")
	if x.TrafficPolicy != "Local" || !x.Endpoints[0].Selected || x.Endpoints[1].Selected ||
		x.Endpoints[1].Why != "traffic policy Local, and the endpoint is on node b" {
		t.Fatalf("external: %+v", x.Endpoints)
	}
	if x.Next.Endpoint == nil || *x.Next.Endpoint != netip.MustParseAddrPort("10.1.0.1:8080") {
		t.Fatalf("external, one local endpoint: predicted %+v", x.Next)
	}
}
