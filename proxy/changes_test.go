package proxy

import (
	"net/netip"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// A State that says which ports changed since the last one is counted by
// those alone; any other State by comparing every port.
func TestCountChanges(t *testing.T) {
	a, b := svc("a", config.TCP), svc("b", config.TCP)
	a2 := *a
	a2.Endpoints = []config.Endpoint{{Addr: netip.MustParseAddrPort("10.0.0.1:80"), Ready: true}}
	b2 := *b
	b2.Port = 81
	c := svc("c", config.TCP)
	ports := func(sps ...*config.ServicePort) map[config.ServicePortName]*config.ServicePort {
		m := map[config.ServicePortName]*config.ServicePort{}
		for _, sp := range sps {
			m[sp.Name] = sp
		}
		return m
	}
	old := &config.State{Ports: ports(a, b), Seq: 7}
	full := &config.State{Ports: ports(&a2, &b2, c)}
	if s, e := config.Diff(old, full).Counts(); s != 2 || e != 1 {
		t.Fatalf("full comparison: %d service, %d endpoint changes; want 2 (b changed, c added) and 1 (a)", s, e)
	}
	// The hint names a and c: b's change is not looked at (the source
	// vouches that it did not change).
	hinted := &config.State{Ports: ports(&a2, &b2, c), Seq: 8, Since: 7, Changed: []config.ServicePortName{a.Name, c.Name, c.Name}}
	if s, e := config.Diff(old, hinted).Counts(); s != 1 || e != 1 {
		t.Fatalf("hinted: %d, %d; want 1 (c added) and 1 (a)", s, e)
	}
	removed := &config.State{Ports: ports(a), Seq: 8, Since: 7, Changed: []config.ServicePortName{b.Name}}
	if s, e := config.Diff(old, removed).Counts(); s != 1 || e != 0 {
		t.Fatalf("hinted removal: %d, %d", s, e)
	}
	// A hint relative to another State is ignored.
	stale := &config.State{Ports: ports(&a2, &b2, c), Seq: 9, Since: 3, Changed: []config.ServicePortName{a.Name}}
	if s, e := config.Diff(old, stale).Counts(); s != 2 || e != 1 {
		t.Fatalf("stale hint: %d, %d", s, e)
	}
}
