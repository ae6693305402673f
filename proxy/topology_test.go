package proxy

import (
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/healthcheck"
)

// recordedHealth keeps what the proxier gives its health check server.
type recordedHealth struct{ got chan []healthcheck.Service }

func (r *recordedHealth) Sync(s []healthcheck.Service) { r.got <- s }

// A new zone for the node chooses the endpoints of every port again, with
// the same Service pointers (nothing else changed); the health check
// server hears the ready local endpoints of Services with a port.
func TestZoneChangeAndHealthChecks(t *testing.T) {
	hc := &recordedHealth{got: make(chan []healthcheck.Service, 10)}
	h := startProxier(t, Config{ServiceHealth: hc})
	a, b := tcpBackend(t, "a"), tcpBackend(t, "b")
	sp := svc("zoned", config.TCP, a, b)
	sp.Endpoints[0].ZoneHints, sp.Endpoints[1].ZoneHints = "zone-a", "zone-b"
	sp.Endpoints[0].NodeName = "node-a"
	sp.HealthCheckNodePort = 32000
	state := func(zone string) *config.State {
		return &config.State{Ports: map[config.ServicePortName]*config.ServicePort{sp.Name: sp}, Node: "node-a", Zone: zone}
	}
	h.p.Update(state("zone-a"))
	waitFor(t, "the listener", func() bool { return h.port("zoned") != 0 })
	for i := 0; i < 4; i++ {
		if got := fetchName(t, h.addr("zoned")); got != "a" {
			t.Fatalf("zone-a: connection %d reached %s", i, got)
		}
	}
	if got := <-hc.got; len(got) != 1 || got[0] != (healthcheck.Service{Namespace: "ns", Name: "zoned", Port: 32000, LocalEndpoints: 1}) {
		t.Fatalf("health checks: %+v", got)
	}
	h.p.Update(state("zone-b"))
	waitFor(t, "zone-b's endpoint", func() bool { return fetchName(t, h.addr("zoned")) == "b" })
	for i := 0; i < 4; i++ {
		if got := fetchName(t, h.addr("zoned")); got != "b" {
			t.Fatalf("zone-b: connection %d reached %s", i, got)
		}
	}
	select {
	case got := <-hc.got:
		t.Fatalf("the health checks did not change, yet were given again: %+v", got)
	default:
	}
}
