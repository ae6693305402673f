package balance

import (
	"net/netip"
	"testing"
	"time"
)

// Predict answers what the next Pick returns, for every scheduler, through
// affinity, ejection and drain, and changes nothing by asking.
func TestPredictAgreesWithPick(t *testing.T) {
	outlier := OutlierConfig{ConsecutiveFailures: 1, BaseEjectionTime: time.Minute, MaxEjectionTime: time.Hour}
	for _, sched := range []string{SchedRoundRobin, SchedLeastConn, SchedSourceHash} {
		for _, affinity := range []time.Duration{0, time.Hour} {
			t.Run(sched+"/affinity="+affinity.String(), func(t *testing.T) {
				clk := &fakeClock{t: time.Unix(1000, 0)}
				b := New(sched)
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
	b := New(SchedRandom)
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
