package proxy

// Failing endpoints (issue: teardown that cannot hang, passive ejection, UDP
// failover): each test has a real misbehaving peer on loopback.

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
)

// One of two endpoints blackholed: after the first one or two connections
// paid the dial timeout, it is ejected and no one else waits for it; none
// fails. Each failed attempt says why in the connection's line.
func TestOutlierBlackholedEndpoint(t *testing.T) {
	h := startProxier(t, Config{
		DialTimeouts: []time.Duration{250 * time.Millisecond, 5 * time.Second},
		Outlier:      balance.OutlierConfig{ConsecutiveFailures: 2, BaseEjectionTime: time.Minute, MaxEjectionTime: time.Minute},
	})
	dead := blackhole(t)
	h.apply(svc("bh", config.TCP, tcpBackend(t, "good"), dead))
	for i := 0; i < 20; i++ {
		if got := fetchName(t, h.addr("bh")); got != "good" {
			t.Fatalf("connection %d reached %q", i, got)
		}
	}
	waitFor(t, "20 lines", func() bool { return len(h.logs.Find("Connection closed")) == 20 })
	paid := 0
	for _, f := range h.logs.Find("Connection closed") {
		if errs, ok := f["dialErrors"].(string); ok {
			paid++
			if errs != "timeout "+dead.String() {
				t.Errorf("dialErrors %q, want %q", errs, "timeout "+dead.String())
			}
		}
	}
	if paid == 0 || paid > 2 {
		t.Fatalf("%d of 20 connections paid a dial timeout, want 1 or 2", paid)
	}
	if len(h.logs.Find("Endpoint ejected after failures in a row; new connections go to the others")) != 1 {
		t.Fatal("no ejection logged")
	}
	fe := h.frontend("bh") // any protocol: the lookup is by name
	var ejected bool
	for _, hl := range h.p.EndpointHealth(fe) {
		ejected = ejected || (hl.Endpoint == dead && hl.EjectedUntil != nil)
	}
	if !ejected {
		t.Fatalf("health %+v: the blackholed endpoint is not shown ejected", h.p.EndpointHealth(fe))
	}
	if n := value(t, "kube_userspace_proxy_endpoint_ejections_total", "service", "ns/bh", "endpoint", dead.String()); n != 1 {
		t.Fatalf("ejections metric %v, want 1", n)
	}
	if n := value(t, "kube_userspace_proxy_dial_failures_total", "service", "ns/bh", "endpoint", dead.String(), "reason", "timeout"); n != float64(paid) {
		t.Fatalf("dial failures{reason=timeout} %v, want %d", n, paid)
	}
	if !strings.Contains(gatherText(t), `kube_userspace_proxy_endpoints_ejected{endpoint="`+dead.String()+`",service="ns/bh"} 1`) {
		t.Fatal("the ejected gauge does not show the endpoint")
	}
}

// value reads the counter or gauge name whose labels are those of
// labels (name, value pairs), as /metrics would show it; 0 when absent.
func value(t *testing.T, name string, labels ...string) float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	RegisterMetrics(reg)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if have[labels[i]] != labels[i+1] {
					continue series
				}
			}
			return m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return 0
}

// gatherText renders the proxy's metrics as the exposition format.
func gatherText(t *testing.T) string {
	t.Helper()
	reg := prometheus.NewRegistry()
	RegisterMetrics(reg)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, mf := range mfs {
		for _, m := range mf.Metric {
			var labels []string
			for _, l := range m.Label {
				labels = append(labels, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			fmt.Fprintf(&b, "%s{%s} %v\n", mf.GetName(), strings.Join(labels, ","), v)
		}
	}
	return b.String()
}

// A dead endpoint (connection refused) is ejected; once it is back it gets
// connections again within one ejection time: the first after it is the probe.
func TestOutlierEndpointComesBack(t *testing.T) {
	const base = time.Second
	h := startProxier(t, Config{
		DialTimeouts: []time.Duration{time.Second, time.Second},
		Outlier:      balance.OutlierConfig{ConsecutiveFailures: 2, BaseEjectionTime: base, MaxEjectionTime: time.Minute},
	})
	dead := closedPort(t)
	h.apply(svc("back", config.TCP, tcpBackend(t, "good"), dead))
	waitFor(t, "the dead endpoint to be ejected", func() bool {
		fetchName(t, h.addr("back"))
		return len(h.logs.Find("Endpoint ejected after failures in a row; new connections go to the others")) == 1
	})
	ejectedAt := time.Now()
	// Back, on the same address.
	ln, err := net.Listen("tcp4", dead.String())
	if err != nil {
		t.Skipf("the port of the dead endpoint was taken meanwhile: %v", err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			fmt.Fprintf(c, "revived\n")
			c.Close()
		}
	}()
	waitFor(t, "the endpoint to get connections again", func() bool { return fetchName(t, h.addr("back")) == "revived" })
	if d := time.Since(ejectedAt); d > base+5*time.Second {
		t.Errorf("used again %v after its ejection, want within about %v", d, base)
	}
	waitFor(t, "the recovery log", func() bool { return len(h.logs.Find("Endpoint back in rotation")) == 1 })
}

// The annotation turns detection off for one Service.
func TestOutlierAnnotationOff(t *testing.T) {
	h := startProxier(t, Config{
		DialTimeouts: []time.Duration{time.Second, time.Second},
		Outlier:      balance.OutlierConfig{ConsecutiveFailures: 1, BaseEjectionTime: time.Minute, MaxEjectionTime: time.Minute},
	})
	sp := svc("noeject", config.TCP, tcpBackend(t, "good"), closedPort(t))
	sp.OutlierDetection = "off"
	h.apply(sp)
	for i := 0; i < 6; i++ {
		fetchName(t, h.addr("noeject"))
	}
	waitFor(t, "6 lines", func() bool { return len(h.logs.Find("Connection closed")) == 6 })
	retried := 0
	for _, f := range h.logs.Find("Connection closed") {
		if f["reason"] == string(balance.ReasonRetry) {
			retried++
		}
	}
	if retried < 5 || len(h.logs.Find("Endpoint ejected after failures in a row; new connections go to the others")) != 0 {
		// Each connection's retry moves round-robin on, so the next
		// connection starts at the dead endpoint again: all pay but
		// perhaps the first.
		t.Fatalf("%d of 6 connections retried (want 5 or 6: the dead endpoint stays in rotation), ejections logged %d",
			retried, len(h.logs.Find("Endpoint ejected after failures in a row; new connections go to the others")))
	}
}

// deadUDPPort returns a loopback UDP port nobody listens on: datagrams to it
// draw ICMP port unreachable.
func deadUDPPort(t *testing.T) netip.AddrPort {
	c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	ap := c.LocalAddr().(*net.UDPAddr).AddrPort()
	c.Close()
	return ap
}

// One of two UDP endpoints dead: a query that went to it moves to the other
// with its datagram re-sent, so every fresh client gets an answer quickly;
// the dead one is ejected and counted.
func TestUDPFailoverFromDeadEndpoint(t *testing.T) {
	h := startProxier(t, Config{
		Outlier:     balance.OutlierConfig{ConsecutiveFailures: 2, BaseEjectionTime: time.Minute, MaxEjectionTime: time.Minute},
		ConnLogMode: dataplane.ConnLogErrors,
	})
	dead := deadUDPPort(t)
	h.apply(svc("dns", config.UDP, udpBackend(t, "alive"), dead))
	answered := 0
	for i := 0; i < 20; i++ {
		c := dialUDP(t, h.addr("dns")) // a fresh source port: a fresh flow
		if _, err := fmt.Fprintf(c, "q%d", i); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(time.Second))
		buf := make([]byte, 100)
		n, err := c.Read(buf)
		if err == nil && string(buf[:n]) == fmt.Sprintf("alive:q%d", i) {
			answered++
		}
	}
	if answered < 19 {
		t.Fatalf("%d of 20 fresh queries answered within 1 s, want at least 19", answered)
	}
	if n := value(t, "kube_userspace_proxy_udp_endpoint_errors_total", "service", "ns/dns", "endpoint", dead.String(), "reason", "refused"); n < 1 || n > 2 {
		t.Fatalf("UDP endpoint errors{refused} %v, want 1 or 2 (then it is ejected)", n)
	}
	if n := value(t, "kube_userspace_proxy_endpoint_ejections_total", "service", "ns/dns", "endpoint", dead.String()); n != 1 {
		t.Fatalf("ejections %v, want 1", n)
	}
	// The failed flows are logged as errors, naming the endpoint error.
	for _, f := range h.logs.Find("UDP flow closed") {
		if f["cause"] != dataplane.CauseEndpointError.String() || f["endpoint"] != dead.String() {
			t.Errorf("line %v: want only the dead endpoint's failures logged", f)
		}
		if _, ok := f["origDst"]; ok {
			t.Errorf("line %v: origDst given, but the kernel cannot tell it here", f)
		}
	}
}

// Under the default log, UDP flows that end by going quiet (every DNS
// query's) write no line.
func TestUDPIdleEndsAreNotErrors(t *testing.T) {
	h := startProxier(t, Config{UDPTimeout: 100 * time.Millisecond, ConnLogMode: dataplane.ConnLogErrors})
	h.apply(svc("quiet", config.UDP, udpBackend(t, "a")))
	for i := 0; i < 50; i++ {
		c := dialUDP(t, h.addr("quiet"))
		udpExchange(t, c, []byte("q"))
	}
	fe := h.frontend("quiet")
	waitFor(t, "every flow to expire", func() bool { n, _ := h.p.UDPFlows(fe); return n == 0 })
	if n := h.p.dp.Budget().UDPFlows; n != 0 {
		t.Fatalf("the descriptor budget still counts %d flows", n)
	}
	if lines := h.logs.Find("UDP flow closed"); len(lines) != 0 {
		t.Fatalf("%d lines for flows that ended by idle timeout, e.g. %v", len(lines), lines[0])
	}
}
