package proxy

import (
	"bufio"
	"net"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// The default connection log leaves normal closes out and logs the rest.
func TestConnLogErrorsOnly(t *testing.T) {
	h := startProxier(t, Config{ConnLogMode: ConnLogErrors, DialTimeouts: []time.Duration{time.Second}})
	h.apply(svc("ok", config.TCP, tcpBackend(t, "a")), svc("dead", config.TCP, closedPort(t)))
	fetchName(t, h.addr("ok"))
	expectReset(t, h.addr("dead"))
	waitFor(t, "the reset's line", func() bool { return len(h.logs.Find("Connection closed")) == 1 })
	time.Sleep(100 * time.Millisecond) // proving an absence: the normal close's line
	if lines := h.logs.Find("Connection closed"); len(lines) != 1 || lines[0]["cause"] != CauseDialFailed.String() {
		t.Fatalf("lines %v: want only the failed dial's reset", lines)
	}
}

// seriesOf counts the series of the per-service metrics labelled service.
func seriesOf(service string) int {
	n := 0
	for _, c := range []prometheus.Collector{connsAccepted, connsActive, dialAttempts, dialFailures, retries,
		noEndpointResets, bytesTotal, udpFlowsActive, udpFlowsEvicted, connDuration} {
		ch := make(chan prometheus.Metric, 1024)
		c.Collect(ch)
		close(ch)
		for m := range ch {
			var d dto.Metric
			_ = m.Write(&d)
			for _, l := range d.GetLabel() {
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
	if n := seriesOf(name); n != 0 {
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
	waitFor(t, "the connection's series", func() bool { return seriesOf(name) >= 5 })
	h.apply(svc("stays", config.TCP, backend))
	waitFor(t, "the removed service's series to go", func() bool { return seriesOf(name) == 0 })
}
