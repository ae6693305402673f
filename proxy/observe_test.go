package proxy

import (
	"bufio"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
)

// The default connection log leaves normal closes out and logs the rest.
func TestConnLogErrorsOnly(t *testing.T) {
	h := startProxier(t, Config{ConnLogMode: dataplane.ConnLogErrors, DialTimeouts: []time.Duration{time.Second}})
	h.apply(svc("ok", config.TCP, tcpBackend(t, "a")), svc("dead", config.TCP, closedPort(t)))
	fetchName(t, h.addr("ok"))
	expectReset(t, h.addr("dead"))
	waitFor(t, "the reset's line", func() bool { return len(h.logs.Find("Connection closed")) == 1 })
	time.Sleep(100 * time.Millisecond) // proving an absence: the normal close's line
	if lines := h.logs.Find("Connection closed"); len(lines) != 1 || lines[0]["cause"] != dataplane.CauseDialFailed.String() {
		t.Fatalf("lines %v: want only the failed dial's reset", lines)
	}
}

// seriesOf counts the series of /metrics labelled service.
func seriesOf(t *testing.T, service string) int {
	reg := prometheus.NewRegistry()
	RegisterMetrics(reg)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "service" && l.GetValue() == service {
					n++
				}
			}
		}
	}
	return n
}

// A service port's series appear with its first connection and go when the
// service port is no longer served.
func TestServiceMetricsCreatedOnUseDeletedOnRemoval(t *testing.T) {
	h := startProxier(t, Config{})
	backend := tcpBackend(t, "a")
	h.apply(svc("gone", config.TCP, backend), svc("stays", config.TCP, backend))
	name := config.ServicePortName{Namespace: "ns", Name: "gone"}.String()
	if n := seriesOf(t, name); n != 0 {
		t.Fatalf("%d series before any traffic, want 0", n)
	}
	c, err := net.Dial("tcp", h.addr("gone"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(c).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	c.Close()
	waitFor(t, "the connection's series", func() bool { return seriesOf(t, name) >= 5 })
	h.apply(svc("stays", config.TCP, backend))
	waitFor(t, "the removed service's series to go", func() bool { return seriesOf(t, name) == 0 })
}

// Dial attempts count per endpoint, into the series /metrics exports: also
// after the service port went away (its series deleted) and came back.
func TestDialAttemptsPerEndpoint(t *testing.T) {
	h := startProxier(t, Config{})
	a, b := tcpBackend(t, "a"), tcpBackend(t, "b")
	name := config.ServicePortName{Namespace: "ns", Name: "counted"}.String()
	attempts := func(ep netip.AddrPort) float64 {
		return value(t, "kube_userspace_proxy_dial_attempts_total", "service", name, "endpoint", ep.String())
	}
	for round, want := range []float64{2, 1} {
		h.apply(svc("counted", config.TCP, a, b))
		for range 2 * int(want) {
			fetchName(t, h.addr("counted"))
		}
		if got := [2]float64{attempts(a), attempts(b)}; got != [2]float64{want, want} {
			t.Fatalf("round %d: dial attempts %v, want %v each", round, got, want)
		}
		h.apply()
		waitFor(t, "the removed service's series to go", func() bool { return seriesOf(t, name) == 0 })
	}
}
