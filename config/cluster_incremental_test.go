package config

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// The incremental builds agree with a full build after every one of a
// random run of creates, updates and deletes of Services and slices
// (a slice moving between Services among them), and an unchanged Service
// keeps its ports' pointers.
func TestClusterSourceIncrementalEqualsFull(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	svc := func(i int, port int32) *v1.Service {
		return &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("s%d", i), Namespace: "ns",
			Annotations: map[string]string{"other.io/x": "big", AnnotationScheduler: "lc"}},
			Spec: v1.ServiceSpec{ClusterIP: fmt.Sprintf("10.96.0.%d", i+1),
				Ports: []v1.ServicePort{{Name: "a", Port: port, Protocol: v1.ProtocolTCP}, {Name: "b", Port: port + 1, Protocol: v1.ProtocolUDP}}}}
	}
	slice := func(j, owner, n int) *discovery.EndpointSlice {
		es := &discovery.EndpointSlice{
			ObjectMeta: metav1.ObjectMeta{
				Name:      fmt.Sprintf("e%d", j),
				Namespace: "ns",
				Labels:    map[string]string{LabelServiceName: fmt.Sprintf("s%d", owner)},
			},
			AddressType: discovery.AddressTypeIPv4,
			Ports:       []discovery.EndpointPort{{Name: ptr("a"), Port: ptr(int32(8080))}, {Name: ptr("b"), Port: ptr(int32(53))}},
		}
		for k := 0; k < n; k++ {
			es.Endpoints = append(es.Endpoints, discovery.Endpoint{Addresses: []string{fmt.Sprintf("10.1.%d.%d", j, k+1)},
				Conditions: discovery.EndpointConditions{Ready: ptr(k%3 != 0)}})
		}
		return es
	}
	client := fake.NewClientset()
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
	// The fake clientset loses events sent before the watch is up.
	waitState(t, sink, "the watch", func(st *State) bool {
		_, _ = client.CoreV1().Services("ns").Create(ctx, svc(99, 9000), metav1.CreateOptions{})
		return len(st.Ports) > 0
	})

	services, slices := map[int]*v1.Service{99: svc(99, 9000)}, map[int]*discovery.EndpointSlice{}
	for step := 0; step < 120; step++ {
		i, j := r.IntN(8), r.IntN(12)
		switch op := r.IntN(6); {
		case op == 0 && services[i] == nil:
			services[i] = svc(i, int32(80+r.IntN(3)))
			_, err = client.CoreV1().Services("ns").Create(ctx, services[i], metav1.CreateOptions{})
		case op <= 1 && services[i] != nil:
			services[i] = svc(i, int32(80+r.IntN(3)))
			_, err = client.CoreV1().Services("ns").Update(ctx, services[i], metav1.UpdateOptions{})
		case op == 2 && services[i] != nil:
			delete(services, i)
			err = client.CoreV1().Services("ns").Delete(ctx, fmt.Sprintf("s%d", i), metav1.DeleteOptions{})
		case op == 3 && slices[j] == nil:
			slices[j] = slice(j, r.IntN(8), 1+r.IntN(3))
			_, err = client.DiscoveryV1().EndpointSlices("ns").Create(ctx, slices[j], metav1.CreateOptions{})
		case op == 4 && slices[j] != nil:
			slices[j] = slice(j, r.IntN(8), 1+r.IntN(3)) // may move to another Service
			_, err = client.DiscoveryV1().EndpointSlices("ns").Update(ctx, slices[j], metav1.UpdateOptions{})
		case op == 5 && slices[j] != nil:
			delete(slices, j)
			err = client.DiscoveryV1().EndpointSlices("ns").Delete(ctx, fmt.Sprintf("e%d", j), metav1.DeleteOptions{})
		default:
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		var svcList []*v1.Service
		for _, s := range services {
			svcList = append(svcList, s)
		}
		var sliceList []*discovery.EndpointSlice
		for _, es := range slices {
			sliceList = append(sliceList, es)
		}
		want := src.buildState(svcList, sliceList)
		waitState(t, sink, fmt.Sprintf("step %d", step), func(st *State) bool { return sameState(st, want) })
	}

	// A change of one Service leaves every other port's pointer alone.
	before, _ := sink.last()
	services[99] = svc(99, 9100)
	if _, err := client.CoreV1().Services("ns").Update(ctx, services[99], metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitState(t, sink, "s99 changed", func(st *State) bool {
		return st.Ports[ServicePortName{Namespace: "ns", Name: "s99", Port: "a"}].Port == 9100
	})
	after, _ := sink.last()
	for name, sp := range after.Ports {
		if name.Name != "s99" && before.Ports[name] != sp {
			t.Fatalf("%s was rebuilt by another Service's change", name)
		}
	}
}

func sameState(a, b *State) bool {
	if len(a.Ports) != len(b.Ports) {
		return false
	}
	for name, sp := range a.Ports {
		if o := b.Ports[name]; o == nil || !o.Equal(sp) {
			return false
		}
	}
	return true
}

func waitState(t *testing.T, sink *recordingSink, what string, ok func(*State) bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if st, n := sink.last(); n > 0 && ok(st) {
			return
		}
		if time.Now().After(deadline) {
			st, _ := sink.last()
			t.Fatalf("%s: the source's state never matched (last: %d ports)", what, len(st.Ports))
		}
		time.Sleep(5 * time.Millisecond)
	}
}
