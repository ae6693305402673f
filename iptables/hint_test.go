package iptables

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"testing"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// A sync told which service ports changed renders what a sync of every
// frontend renders, over random adds, removals, moves to another listener
// port, NodePorts and traffic policy splits; the restore input is the same
// as a full sync's too (iptables-restore replaced by true(1)).
func TestSyncChangedEqualsFull(t *testing.T) {
	log := logrus.New()
	log.SetOutput(io.Discard)
	mk := func() *family {
		f := &family{fam: 4, restore: "true", features: allFeatures, jumpsOK: true}
		f.installed = &Ruleset{Nat: map[string][]string{}, Filter: map[string][]string{}}
		return f
	}
	hinted, full := mk(), mk()
	r := rand.New(rand.NewPCG(5, 6))
	frontendsOf := func(i int) []config.Frontend {
		sp := &config.ServicePort{
			Name:       config.ServicePortName{Namespace: "ns", Name: fmt.Sprintf("s%d", i)},
			Protocol:   config.TCP,
			Port:       80 + r.IntN(2),
			ClusterIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 96, byte(i / 250), byte(i%250 + 1)})},
		}
		if r.IntN(3) == 0 {
			sp.NodePort = 30000 + i
		}
		listen := func() netip.AddrPort {
			return netip.AddrPortFrom(netip.IPv4Unspecified(), uint16(45000+r.IntN(15000)))
		}
		if r.IntN(4) == 0 && sp.NodePort != 0 {
			sp.ExternalLocal = true
			return []config.Frontend{
				{Service: sp, Kind: config.KindInternal, Family: 4, Protocol: config.TCP, Listen: listen()},
				{Service: sp, Kind: config.KindExternal, Family: 4, Protocol: config.TCP, Listen: listen()},
			}
		}
		return []config.Frontend{{Service: sp, Kind: config.KindAll, Family: 4, Protocol: config.TCP, Listen: listen()}}
	}
	byName := map[int][]config.Frontend{}
	view := func() []config.Frontend {
		var out []config.Frontend
		for i := 0; i < 300; i++ {
			out = append(out, byName[i]...)
		}
		return out
	}
	for i := 0; i < 300; i++ {
		byName[i] = frontendsOf(i)
	}
	all := view()
	for _, f := range []*family{hinted, full} {
		if _, _, err := f.sync(context.Background(), all, all4, false, nil, log); err != nil {
			t.Fatal(err)
		}
	}
	for step := 0; step < 200; step++ {
		var changed []config.ServicePortName
		var fresh []config.Frontend
		for k := 0; k < 1+r.IntN(4); k++ {
			i := r.IntN(300)
			changed = append(changed, config.ServicePortName{Namespace: "ns", Name: fmt.Sprintf("s%d", i)})
			switch r.IntN(3) {
			case 0:
				delete(byName, i)
			default:
				byName[i] = frontendsOf(i)
			}
		}
		for _, name := range changed {
			var i int
			fmt.Sscanf(name.Name, "s%d", &i)
			for _, fe := range byName[i] {
				if !contains(fresh, fe) {
					fresh = append(fresh, fe)
				}
			}
		}
		all := view()
		if _, _, err := hinted.sync(context.Background(), all, all4, false, &hint{changed: changed, fresh: fresh}, log); err != nil {
			t.Fatal(err)
		}
		if _, _, err := full.sync(context.Background(), all, all4, false, nil, log); err != nil {
			t.Fatal(err)
		}
		if got, want := hinted.render(), full.render(); !reflect.DeepEqual(got, want) {
			t.Fatalf("step %d: the hinted sync renders\n%v\nthe full one\n%v", step, got, want)
		}
		if len(hinted.records) != len(full.records) {
			t.Fatalf("step %d: %d records, full %d", step, len(hinted.records), len(full.records))
		}
	}
}

func contains(fes []config.Frontend, fe config.Frontend) bool {
	for _, x := range fes {
		if x.Service == fe.Service && x.Kind == fe.Kind {
			return true
		}
	}
	return false
}
