package balance

import (
	"encoding/json"
	"net/netip"
	"reflect"
	"testing"
	"time"
)

// A balancer's pick state, through JSON into a new balancer with the same
// endpoints (a successor's frontend), decides the same picks: the pinned
// client keeps its endpoint, the ejected endpoint stays out until its
// ejection ends, the drained one stays drained, round-robin goes on where
// it was. What refers to an endpoint the successor does not have is
// dropped.
func TestPickStateCarriesOver(t *testing.T) {
	outlier := OutlierConfig{ConsecutiveFailures: 2, BaseEjectionTime: time.Minute, MaxEjectionTime: time.Hour}
	all := eps("10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:80")
	old := New(SchedRoundRobin)
	old.Update(all, time.Hour, outlier, SchedRoundRobin)
	pinned := netip.MustParseAddr("10.9.0.1")
	pinnedTo, _, _ := old.Pick(pinned, 0)
	ejected := all[0]
	if ejected == pinnedTo {
		ejected = all[1]
	}
	old.Report(ejected, true)
	old.Report(ejected, true)
	drained := all[3]
	if drained == pinnedTo || drained == ejected {
		drained = all[2]
	}
	old.SetDrained(drained, true)
	for i := 0; i < 3; i++ {
		old.Pick(netip.AddrFrom4([4]byte{10, 9, 1, byte(i)}), 0)
	}

	b, err := json.Marshal(old.ExportPicks())
	if err != nil {
		t.Fatal(err)
	}
	var st PickState
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	next := New(SchedRoundRobin)
	next.Update(all, time.Hour, outlier, SchedRoundRobin)
	if kept := next.ImportPicks(st); kept != 4 {
		t.Errorf("kept %d pins, want 4", kept)
	}
	if got, why, _ := next.Pick(pinned, 0); got != pinnedTo || why != ReasonAffinity {
		t.Errorf("the pinned client got %v (%s), want %v by affinity", got, why, pinnedTo)
	}
	// Active counts come with the connections (Transferred), not with the state.
	withoutActive := func(hs []EndpointHealth) []EndpointHealth {
		for i := range hs {
			hs[i].Active = 0
		}
		return hs
	}
	if got, want := withoutActive(next.Health()), withoutActive(old.Health()); !reflect.DeepEqual(got, want) {
		t.Errorf("health %+v, want %+v", got, want)
	}
	// The same next picks for new clients: neither the ejected nor the
	// drained endpoint, in the same order.
	for i := 0; i < 6; i++ {
		c := netip.AddrFrom4([4]byte{10, 9, 2, byte(i)})
		want, _, _ := old.Pick(c, 0)
		got, _, _ := next.Pick(c, 0)
		if got != want {
			t.Fatalf("pick %d: %v, the predecessor's would be %v", i, got, want)
		}
		if got == ejected || got == drained {
			t.Fatalf("pick %d chose %v (ejected %v, drained %v)", i, got, ejected, drained)
		}
	}

	// A successor whose endpoints changed meanwhile keeps what still
	// applies and drops the rest; without affinity no pin is kept.
	fewer := New(SchedRoundRobin)
	fewer.Update([]netip.AddrPort{pinnedTo}, time.Hour, outlier, SchedRoundRobin)
	toPinned := 0
	for _, p := range st.Pins {
		if p.Endpoint == pinnedTo {
			toPinned++
		}
	}
	if kept := fewer.ImportPicks(st); kept != toPinned {
		t.Errorf("with one endpoint left, kept %d pins, want %d (those to it)", kept, toPinned)
	}
	noAffinity := New(SchedRoundRobin)
	noAffinity.Update(all, 0, outlier, SchedRoundRobin)
	if kept := noAffinity.ImportPicks(st); kept != 0 || len(noAffinity.Affinities()) != 0 {
		t.Errorf("without affinity kept %d pins", kept)
	}
}
