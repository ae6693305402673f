package config

import (
	"context"
	"fmt"
	"io"
	"reflect"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// A unit test with client-go's fake clientset; the real API server is in
// test/e2e.
func TestClusterSourceFiltersAndUpdates(t *testing.T) {
	svc := func(name string, labels map[string]string) *v1.Service {
		return &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", Labels: labels},
			Spec: v1.ServiceSpec{ClusterIP: "10.96.0.1", Ports: []v1.ServicePort{{Port: 80, Protocol: v1.ProtocolTCP}}}}
	}
	ready := true
	slice := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: "web-1", Namespace: "ns", Labels: map[string]string{LabelServiceName: "web"}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Port: ptr(int32(8080))}},
		Endpoints:   []discovery.Endpoint{{Addresses: []string{"10.1.0.1"}, Conditions: discovery.EndpointConditions{Ready: &ready}}},
	}
	client := fake.NewClientset(svc("web", nil), svc("other", map[string]string{LabelServiceProxyName: "x"}), slice)
	log := logrus.New()
	log.SetOutput(io.Discard)
	sink := &recordingSink{}
	ctx, cancel := context.WithCancel(context.Background())
	src := &ClusterSource{Client: client, Node: "n", Sink: sink, Log: log, Probe: func(context.Context) error { return nil }}
	done, err := src.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { cancel(); <-done }()

	st, n := sink.last()
	if n != 1 {
		t.Fatalf("%d states before Start returned, want exactly the synced one", n)
	}
	// The fake clientset ignores label selectors, so the filter that matters
	// here is SkipReason's; the real API server test covers the selector.
	sp := st.Ports[ServicePortName{Namespace: "ns", Name: "web"}]
	if sp == nil || len(st.Ports) != 1 || len(sp.Endpoints) != 1 || sp.Endpoints[0].Addr.String() != "10.1.0.1:8080" {
		t.Fatalf("state %+v", st.Ports)
	}
	// The fake clientset loses events sent before the informer's watch is
	// up; create probe Services until one shows, so the watch is live.
	deadline := time.Now().Add(10 * time.Second)
	for i := 0; ; i++ {
		probe := svc(fmt.Sprintf("probe-%d", i), nil)
		if _, err := client.CoreV1().Services("ns").Create(ctx, probe, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
		if st, _ := sink.last(); len(st.Ports) > 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the informers never saw a change")
		}
	}
	// An event that changes nothing the model reads (an annotation of
	// another tool) hands on no State; the next real change does.
	_, before := sink.last()
	web, err := client.CoreV1().Services("ns").Get(ctx, "web", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	web.Annotations = map[string]string{"example.com/owner": "team-a"}
	if _, err := client.CoreV1().Services("ns").Update(ctx, web, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.CoreV1().Services("ns").Create(ctx, svc("after", nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(5 * time.Second)
	for {
		if st, _ := sink.last(); st.Ports[ServicePortName{Namespace: "ns", Name: "after"}] != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the Service created after the annotation never showed")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, n := sink.last(); n != before+1 {
		t.Fatalf("%d States for an annotation change and a new Service, want 1 (the annotation changes nothing)", n-before)
	}
	if err := client.CoreV1().Services("ns").Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(5 * time.Second)
	for {
		if st, _ := sink.last(); st.Ports[ServicePortName{Namespace: "ns", Name: "web"}] == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("deleted Service still in the state")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// slim keeps what the model reads and drops the rest, and the model built
// from a slimmed slice equals the one built from the original.
func TestSlimKeepsTheModel(t *testing.T) {
	ready, notServing := true, false
	node, zone := "node-a", "zone-1"
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "ns", UID: "u1", ResourceVersion: "7",
			CreationTimestamp: metav1.Now(), OwnerReferences: []metav1.OwnerReference{{Name: "x"}},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl"}},
			Annotations:   map[string]string{"kubectl.kubernetes.io/last-applied-configuration": "{}", AnnotationScheduler: "lc"}},
		Spec: v1.ServiceSpec{ClusterIP: "10.96.0.10", Ports: []v1.ServicePort{{Name: "http", Port: 80, Protocol: v1.ProtocolTCP}}},
	}
	es := &discovery.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "web-abc", Namespace: "ns", UID: "u2", GenerateName: "web-", ResourceVersion: "9",
			Labels:          map[string]string{discovery.LabelServiceName: "web"},
			OwnerReferences: []metav1.OwnerReference{{Kind: "Service", Name: "web"}}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptrTo("http"), Port: ptrTo(int32(8080))}},
		Endpoints: []discovery.Endpoint{
			{Addresses: []string{"10.244.0.1"}, Conditions: discovery.EndpointConditions{Ready: &ready, Serving: &ready},
				NodeName: &node, Zone: &zone, TargetRef: &v1.ObjectReference{Kind: "Pod", Name: "web-1"}},
			{Addresses: []string{"10.244.0.2"}, Conditions: discovery.EndpointConditions{Ready: &notServing, Serving: &notServing, Terminating: &ready},
				TargetRef: &v1.ObjectReference{Kind: "Pod", Name: "web-2"}},
		},
	}
	build := func(svc *v1.Service, es *discovery.EndpointSlice) *State {
		b := NewBuilder("node-a")
		if _, err := b.AddService(svc); err != nil {
			t.Fatal(err)
		}
		if _, err := b.AddSlice(es); err != nil {
			t.Fatal(err)
		}
		return b.State()
	}
	want := build(svc.DeepCopy(), es.DeepCopy())
	s, _ := slim(svc.DeepCopy())
	e, _ := slim(es.DeepCopy())
	slimSvc, slimES := s.(*v1.Service), e.(*discovery.EndpointSlice)
	got := build(slimSvc, slimES)
	if len(got.Ports) != 1 || len(want.Ports) != 1 {
		t.Fatalf("ports: got %d, want %d", len(got.Ports), len(want.Ports))
	}
	for name, w := range want.Ports {
		g := got.Ports[name]
		if g == nil || !reflect.DeepEqual(g, w) {
			t.Errorf("%s: slimmed model\n%+v\nwant\n%+v", name, g, w)
		}
	}
	if slimSvc.ManagedFields != nil || slimSvc.UID != "" || slimSvc.Annotations["kubectl.kubernetes.io/last-applied-configuration"] != "" {
		t.Errorf("Service kept what the model never reads: %+v", slimSvc.ObjectMeta)
	}
	if slimSvc.ResourceVersion != "7" || slimSvc.CreationTimestamp.IsZero() || slimSvc.Annotations[AnnotationScheduler] != "lc" {
		t.Errorf("Service lost what is read: %+v", slimSvc.ObjectMeta)
	}
	if slimES.OwnerReferences != nil || slimES.Endpoints[0].TargetRef != nil || slimES.ResourceVersion != "9" {
		t.Errorf("slice: owner %v, target %v, resource version %q", slimES.OwnerReferences, slimES.Endpoints[0].TargetRef, slimES.ResourceVersion)
	}
	if slimES.Endpoints[0].Conditions.Ready != slimES.Endpoints[1].Conditions.Terminating {
		t.Error("true conditions do not share one pointer")
	}
}

func ptrTo[T any](v T) *T { return &v }
