package proxy

import (
	"fmt"
	"io"
	"maps"
	"net/netip"
	"testing"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// BenchmarkSyncOneAddedAt10k is the proxier's part of "one Service added at
// 10k service ports" (make bench's programming table): the source hands on
// a state with one more port (Update) and the sync goroutine opens its
// listener. Each op adds the port and removes it again: two syncs.
func BenchmarkSyncOneAddedAt10k(b *testing.B) {
	p := benchProxier(b, config.PortRange{})
	base := &config.State{Ports: map[config.ServicePortName]*config.ServicePort{}, Node: "node-a"}
	mk := func(i int) *config.ServicePort {
		sp := svc(fmt.Sprintf("s%d", i), config.TCP, netip.MustParseAddrPort("10.1.0.1:8080"))
		sp.ClusterIPs = []netip.Addr{netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)})}
		return sp
	}
	for i := 0; i < 10000; i++ {
		sp := mk(i)
		base.Ports[sp.Name] = sp
	}
	added := &config.State{Ports: map[config.ServicePortName]*config.ServicePort{}, Node: "node-a"}
	for k, v := range base.Ports {
		added.Ports[k] = v
	}
	extra := mk(10000)
	added.Ports[extra.Name] = extra
	p.Update(base)
	if err := p.sync(base, false); err != nil {
		b.Fatal(err)
	}
	defer p.shutdownSynced(0)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, st := range []*config.State{added, base} {
			p.Update(st)
			if err := p.sync(st, false); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// BenchmarkSyncOneChangedAt10k is one endpoint change at 10k service ports
// from a source that says what changed (the cluster source): the sync
// visits that port alone. Each op is two syncs (the change and back).
func BenchmarkSyncOneChangedAt10k(b *testing.B) {
	p := benchProxier(b, config.PortRange{})
	st := &config.State{Ports: map[config.ServicePortName]*config.ServicePort{}, Node: "node-a", Seq: 1}
	for i := 0; i < 10000; i++ {
		sp := svc(fmt.Sprintf("s%d", i), config.TCP, netip.MustParseAddrPort("10.1.0.1:8080"))
		sp.ClusterIPs = []netip.Addr{netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)})}
		st.Ports[sp.Name] = sp
	}
	if err := p.sync(st, false); err != nil {
		b.Fatal(err)
	}
	defer p.shutdownSynced(0)
	name := config.ServicePortName{Namespace: "ns", Name: "s42"}
	other := *st.Ports[name]
	other.Endpoints = []config.Endpoint{{Addr: netip.MustParseAddrPort("10.1.0.2:8080"), Ready: true, Serving: true}}
	specs := []*config.ServicePort{&other, st.Ports[name]}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, sp := range specs {
			next := &config.State{Ports: st.Ports, Node: "node-a", Seq: st.Seq + 1, Since: st.Seq, Changed: []config.ServicePortName{name}}
			next.Ports = maps.Clone(st.Ports) // as the source does
			next.Ports[name] = sp
			b.StartTimer()
			if err := p.sync(next, false); err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			st = next
		}
	}
}

// benchProxier is a Proxier on loopback without rules and without Run
// (tests call sync), logging nowhere.
func benchProxier(tb testing.TB, ports config.PortRange) *Proxier {
	if _, err := kernel.RaiseFileLimit(); err != nil {
		tb.Skip(err)
	}
	log := logrus.New()
	log.SetOutput(io.Discard)
	p := New(Config{BindAddress: loopback, PortRange: ports, Log: log})
	return p
}
