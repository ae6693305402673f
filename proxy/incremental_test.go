package proxy

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"net"
	"net/netip"
	"slices"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
)

// A sync that visits only the ports a State names as changed ends where a
// sync of every port ends: the same frontends, each serving the State's
// port, and the same view for the rules. 200 random steps of adds, deletes,
// endpoint changes, traffic policy splits (two frontends) and joins, and
// re-adds of the same pointer.
func TestIncrementalSyncEqualsFull(t *testing.T) {
	// Each its own port range: two proxiers in one namespace would take
	// each other's ports while a frontend without endpoints refuses.
	base := freePorts(t, 200)
	inc, full := benchProxier(t, config.PortRange{Base: base, Size: 100}), benchProxier(t, config.PortRange{Base: base + 100, Size: 100})
	defer inc.shutdownSynced(0)
	defer full.shutdownSynced(0)
	r := rand.New(rand.NewPCG(3, 4))
	port := func(i int) *config.ServicePort {
		sp := svc(fmt.Sprintf("s%d", i), config.TCP)
		sp.ClusterIPs = []netip.Addr{netip.AddrFrom4([4]byte{10, 96, 0, byte(i + 1)})}
		for e := 0; e < r.IntN(4); e++ {
			sp.Endpoints = append(sp.Endpoints, config.Endpoint{Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, 0, byte(r.IntN(5) + 1)}), 8080),
				Ready: true, Serving: true, NodeName: []string{"node-a", "node-b"}[r.IntN(2)]})
		}
		if r.IntN(3) == 0 {
			sp.ExternalIPs = []netip.Addr{netip.AddrFrom4([4]byte{192, 0, 2, byte(i + 1)})}
			sp.ExternalLocal = r.IntN(2) == 0 // a split into internal and external frontends
		}
		return sp
	}
	ports := map[config.ServicePortName]*config.ServicePort{}
	var seq uint64
	visitedOnly := 0
	for step := 0; step < 200; step++ {
		next := maps.Clone(ports)
		var changed []config.ServicePortName
		for k := 0; k < 1+r.IntN(3); k++ {
			i := r.IntN(25)
			name := config.ServicePortName{Namespace: "ns", Name: fmt.Sprintf("s%d", i)}
			switch op := r.IntN(5); {
			case op == 0:
				delete(next, name)
			case op == 1 && next[name] != nil:
				// Named as changed, yet the same pointer.
			default:
				next[name] = port(i)
			}
			changed = append(changed, name)
		}
		seq++
		since := seq - 1
		st := &config.State{Ports: next, Node: "node-a", Seq: seq, Since: since, Changed: changed}
		if got := inc.rec.changedSince(config.Diff(inc.rec.synced, st), false); got != nil {
			visitedOnly++
		}
		if err := inc.sync(st, false); err != nil {
			t.Fatal(err)
		}
		if err := full.sync(&config.State{Ports: next, Node: "node-a"}, false); err != nil {
			t.Fatal(err)
		}
		for _, p := range []*Proxier{inc, full} {
			for key, fe := range p.rec.frontends {
				if fe.Spec() != next[key.Name] {
					t.Fatalf("step %d: %v serves a stale port (%p, want %p)", step, key, fe.Spec(), next[key.Name])
				}
			}
		}
		if a, b := viewSet(t, inc.rec.view), viewSet(t, full.rec.view); !maps.Equal(a, b) {
			t.Fatalf("step %d: incremental view\n%v\nfull view\n%v", step, a, b)
		}
		if len(inc.rec.frontends) != len(full.rec.frontends) || len(inc.rec.view) != len(inc.rec.frontends) {
			t.Fatalf("step %d: %d frontends (view %d), full %d", step, len(inc.rec.frontends), len(inc.rec.view), len(full.rec.frontends))
		}
		for key := range full.rec.frontends {
			if inc.rec.frontends[key] == nil {
				t.Fatalf("step %d: %v missing from the incremental sync", step, key)
			}
		}
		ports = next
	}
	if visitedOnly < 150 {
		t.Errorf("only %d of 200 syncs visited the changed ports alone", visitedOnly)
	}
}

// viewSet is a view as a set, without listener ports (two proxiers choose
// their own); a key twice fails the test.
func viewSet(t *testing.T, view []config.Frontend) map[dataplane.Key]*config.ServicePort {
	t.Helper()
	out := map[dataplane.Key]*config.ServicePort{}
	for _, f := range view {
		if f.Err != nil {
			t.Fatalf("%v: %v", dataplane.KeyOf(f), f.Err)
		}
		if _, dup := out[dataplane.KeyOf(f)]; dup {
			t.Fatalf("%v twice in the view", dataplane.KeyOf(f))
		}
		out[dataplane.KeyOf(f)] = f.Service
	}
	return out
}

// States that arrive while none is synced merge: the one synced says what
// changed since the one synced before, so the sync still visits only those.
func TestUpdateMergesChanges(t *testing.T) {
	p := New(Config{})
	a := config.ServicePortName{Namespace: "ns", Name: "a"}
	b := config.ServicePortName{Namespace: "ns", Name: "b"}
	s1 := &config.State{Ports: map[config.ServicePortName]*config.ServicePort{}, Seq: 1}
	p.rec.synced, p.latest = s1, s1
	p.Update(&config.State{Ports: s1.Ports, Seq: 2, Since: 1, Changed: []config.ServicePortName{a}})
	s3 := &config.State{Ports: s1.Ports, Seq: 3, Since: 2, Changed: []config.ServicePortName{b}}
	p.Update(s3)
	got := *p.pending
	if got.To != s3 || got.From != s1 || len(got.Changed) != 2 || got.Changed[0] != a || got.Changed[1] != b {
		t.Fatalf("merged change: from seq %d to seq %d changing %v, want 1, 3, [a b]", got.From.Seq, got.To.Seq, got.Changed)
	}
	if len(s3.Changed) != 1 {
		t.Error("the source's State was changed")
	}
	if names := p.rec.changedSince(got, false); len(names) != 2 {
		t.Errorf("changedSince: %v, want both ports", names)
	}
	// A State made from nothing (Since 0) merges into a full visit.
	p.Update(&config.State{Ports: s1.Ports, Seq: 4})
	p.Update(&config.State{Ports: s1.Ports, Seq: 5, Since: 4, Changed: []config.ServicePortName{a}})
	if names := p.rec.changedSince(*p.pending, false); names != nil {
		t.Errorf("after a State made from nothing: changedSince %v, want a full visit", names)
	}
}

// A NodePort another process holds is tried again by every sync, yet a
// sync of one changed port visits that port and the failed one, not all of
// them (at 10k service ports one held NodePort made every change cost a
// full visit: 30-60 ms). A retry of the same State visits the failed one
// alone, and takes the NodePort once it is free.
func TestFailedNodePortKeepsSyncsSmall(t *testing.T) {
	p := benchProxier(t, config.PortRange{})
	defer p.shutdownSynced(0)
	other, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	held := other.Addr().(*net.TCPAddr).Port

	ports := map[config.ServicePortName]*config.ServicePort{}
	for i := range 40 {
		sp := svc(fmt.Sprintf("s%d", i), config.TCP)
		sp.ClusterIPs = []netip.Addr{netip.AddrFrom4([4]byte{10, 96, 0, byte(i + 1)})}
		ports[sp.Name] = sp
	}
	taken := svc("taken", config.TCP)
	taken.NodePort = held
	ports[taken.Name] = taken
	st := &config.State{Ports: ports, Node: "node-a", Seq: 1}
	if err := p.sync(st, false); err != nil {
		t.Fatal(err)
	}
	if fe, ok := p.Lookup(taken.Name, 4, config.KindAll); !ok || fe.NodePortErr == nil {
		t.Fatalf("frontend %+v: want a NodePort error", fe)
	}

	changed := svc("s3", config.TCP, netip.MustParseAddrPort("10.244.0.1:8080"))
	changed.ClusterIPs = ports[changed.Name].ClusterIPs
	next := maps.Clone(ports)
	next[changed.Name] = changed
	st2 := &config.State{Ports: next, Node: "node-a", Seq: 2, Since: 1, Changed: []config.ServicePortName{changed.Name}}
	got := p.rec.changedSince(config.Diff(p.rec.synced, st2), false)
	slices.SortFunc(got, config.ServicePortName.Compare)
	if want := []config.ServicePortName{changed.Name, taken.Name}; !slices.Equal(got, want) {
		t.Fatalf("a change beside a failed NodePort visits %v, want %v", got, want)
	}
	if err := p.sync(st2, false); err != nil {
		t.Fatal(err)
	}
	if fe, _ := p.Lookup(changed.Name, 4, config.KindAll); fe.Service != changed {
		t.Fatal("the changed port is not served")
	}

	// Freed: the retry (the same State again) visits the failed port alone
	// and takes the NodePort.
	other.Close()
	if got := p.rec.changedSince(config.Diff(p.rec.synced, st2), false); !slices.Equal(got, []config.ServicePortName{taken.Name}) {
		t.Fatalf("a retry visits %v, want the failed port alone", got)
	}
	if err := p.sync(st2, false); err != nil {
		t.Fatal(err)
	}
	fe, _ := p.Lookup(taken.Name, 4, config.KindAll)
	if fe.NodePortErr != nil {
		t.Fatalf("after the NodePort was freed: %v", fe.NodePortErr)
	}
	if p.rec.failing != 0 || len(p.rec.view) != len(next) {
		t.Fatalf("failing %d, view of %d frontends, want 0 and %d", p.rec.failing, len(p.rec.view), len(next))
	}
	if got := p.rec.changedSince(config.Diff(p.rec.synced, st2), false); len(got) != 0 || got == nil {
		t.Fatalf("with nothing failed a retry visits %v, want nothing", got)
	}
}
