package config

import (
	"net/netip"
	"reflect"
	"slices"
	"testing"
	"time"
)

// Every ServicePort field is in exactly one group of ComparePorts: a port
// differing in that field alone compares as that group. A field added to
// ServicePort and not to ComparePorts compares as PortSame and fails here;
// a field added here but not in ComparePorts likewise.
func TestComparePortsSeesEveryField(t *testing.T) {
	want := map[string]PortChange{
		"Name": PortFrontend, "Protocol": PortFrontend, "Port": PortFrontend, "NodePort": PortFrontend,
		"ClusterIPs": PortFrontend, "ExternalIPs": PortFrontend, "LoadBalancerIPs": PortFrontend,
		"InternalLocal": PortRules, "ExternalLocal": PortRules,
		"SourceRanges":    PortRules,
		"AffinityTimeout": PortBalancing, "Scheduler": PortBalancing, "ProxyProtocol": PortBalancing, "BackendSource": PortBalancing,
		"Created": PortBalancing, "OutlierDetection": PortBalancing, "HealthCheckNodePort": PortBalancing,
		"TrafficDistribution": PortBalancing, "Endpoints": PortBalancing,
	}
	typ := reflect.TypeFor[ServicePort]()
	for i := range typ.NumField() {
		f := typ.Field(i)
		group, ok := want[f.Name]
		if !ok {
			t.Errorf("ServicePort.%s: not in this test's table; put it in a group of ComparePorts and here", f.Name)
			continue
		}
		delete(want, f.Name)
		a, b := &ServicePort{}, &ServicePort{}
		setOther(t, reflect.ValueOf(b).Elem().Field(i), f.Name)
		if got := ComparePorts(a, b); got != group {
			t.Errorf("ports differing in %s alone compare as %d, want %d", f.Name, got, group)
		}
		if a.Equal(b) || b.Equal(a) {
			t.Errorf("ports differing in %s alone are Equal", f.Name)
		}
		if got := a.SameFrontend(b); got != (group < PortFrontend) {
			t.Errorf("ports differing in %s alone: SameFrontend %v", f.Name, got)
		}
		if got := a.SameRules(b); got != (group < PortRules) {
			t.Errorf("ports differing in %s alone: SameRules %v", f.Name, got)
		}
	}
	for name := range want {
		t.Errorf("the table names %s, which ServicePort no longer has", name)
	}
}

// setOther sets v to a value other than its zero value.
func setOther(t *testing.T, v reflect.Value, name string) {
	switch v.Interface().(type) {
	case ServicePortName:
		v.Set(reflect.ValueOf(ServicePortName{Namespace: "ns", Name: "n"}))
	case Protocol:
		v.Set(reflect.ValueOf(UDP))
	case []netip.Addr:
		v.Set(reflect.ValueOf([]netip.Addr{netip.MustParseAddr("10.0.0.1")}))
	case []netip.Prefix:
		v.Set(reflect.ValueOf([]netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}))
	case []Endpoint:
		v.Set(reflect.ValueOf([]Endpoint{{Addr: netip.MustParseAddrPort("10.0.0.1:80")}}))
	case time.Time:
		v.Set(reflect.ValueOf(time.Unix(1, 0)))
	case time.Duration:
		v.SetInt(int64(time.Second))
	case int:
		v.SetInt(1)
	case bool:
		v.SetBool(true)
	case string:
		v.SetString("x")
	default:
		t.Fatalf("ServicePort.%s: no other value known for %s; teach setOther", name, v.Type())
	}
}

func TestDiffAndMerge(t *testing.T) {
	a := ServicePortName{Namespace: "ns", Name: "a"}
	b := ServicePortName{Namespace: "ns", Name: "b"}
	s1 := &State{Seq: 1, Ports: map[ServicePortName]*ServicePort{a: {Name: a}}}
	s2 := &State{Seq: 2, Since: 1, Changed: []ServicePortName{b, b}, Ports: map[ServicePortName]*ServicePort{a: s1.Ports[a], b: {Name: b}}}
	s3 := &State{Seq: 3, Since: 2, Changed: []ServicePortName{a}, Ports: map[ServicePortName]*ServicePort{b: s2.Ports[b]}}
	unnumbered := &State{Ports: s3.Ports}

	if d := Diff(s1, s2); !slices.Equal(d.Changed, []ServicePortName{b}) || d.Port(a) != PortSame || d.Port(b) != PortFrontend {
		t.Fatalf("Diff(s1, s2) = %+v: want b alone, once, added", d.Changed)
	}
	if d := Diff(s1, s3); !d.All() {
		t.Fatalf("Diff(s1, s3): s3 was not made from s1, want every port, got %v", d.Changed)
	}
	if d := Diff(nil, s1); !d.All() || len(d.Names()) != 1 {
		t.Fatalf("the first State: want every port, got %+v", d)
	}
	if d := Diff(s2, s2); d.All() || len(d.Changed) != 0 {
		t.Fatalf("a State against itself: want nothing changed, got %+v", d)
	}
	m := Diff(s1, s2).Merge(Diff(s2, s3))
	if m.From != s1 || m.To != s3 || !slices.Equal(m.Changed, []ServicePortName{b, a}) {
		t.Fatalf("merged: %+v, want s1 → s3 changing b and a", m)
	}
	if svc, eps := m.Counts(); svc != 2 || eps != 0 {
		t.Fatalf("merged counts %d services, %d endpoints; want a removed and b added", svc, eps)
	}
	if m := Diff(s1, s2).Merge(Diff(s2, unnumbered)); !m.All() {
		t.Fatalf("merged with an unnumbered State: want every port, got %v", m.Changed)
	}
	if names := Diff(s2, unnumbered).Names(); len(names) != 2 {
		t.Fatalf("every port of both States: got %v, want a (removed) and b", names)
	}
}
