// Shared by the proxy tests: a Proxier on loopback, real backends (TCP, UDP, a
// closed port, a blackhole, a full accept queue) and waits.

package proxy

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"go.uber.org/goleak"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var loopback = netip.MustParseAddr("127.0.0.1")

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testutil.WaitFor(t, what, 10*time.Second, 10*time.Millisecond, cond)
}

type harness struct {
	t    *testing.T
	p    *Proxier
	logs *testutil.LogHook
	stop func() // ends Run and waits for it (also done when the test ends)
}

// startProxier runs a Proxier on loopback until the test ends; before
// are called with it before it runs (an Inherit, say).
func startProxier(t *testing.T, cfg Config, before ...func(*Proxier)) *harness {
	t.Helper()
	log := logrus.New()
	log.SetOutput(io.Discard)
	log.SetLevel(logrus.DebugLevel)
	h := &harness{t: t, logs: &testutil.LogHook{}}
	log.AddHook(h.logs)
	if !cfg.BindAddress.IsValid() {
		cfg.BindAddress = loopback
	}
	if cfg.MinSyncPeriod == 0 {
		cfg.MinSyncPeriod = time.Millisecond
	}
	if cfg.ConnLogMode == "" {
		cfg.ConnLogMode = dataplane.ConnLogAll
	}
	cfg.Log = log
	h.p = New(cfg)
	for _, f := range before {
		f(h.p)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { h.p.Run(ctx, 0); close(done) }()
	h.stop = func() { cancel(); <-done }
	t.Cleanup(h.stop)
	return h
}

// apply hands st to the proxier and waits until it is what the listeners
// serve and the rules were written for it (or failed).
func (h *harness) apply(ports ...*config.ServicePort) {
	h.t.Helper()
	st := &config.State{Ports: map[config.ServicePortName]*config.ServicePort{}, Node: "node-a"}
	for _, sp := range ports {
		st.Ports[sp.Name] = sp
	}
	h.p.Update(st)
	waitFor(h.t, "sync", func() bool {
		view := h.p.Frontends()
		n := 0
		for _, fe := range view {
			if sp := st.Ports[fe.Service.Name]; sp == fe.Service {
				n++
			}
		}
		return n == len(view) && len(view) >= len(ports) && h.p.writtenFor() == st
	})
}

func (h *harness) port(name string) int {
	return h.p.ListenPort(config.ServicePortName{Namespace: "ns", Name: name}, 4, config.KindAll)
}

func (h *harness) addr(name string) string {
	h.t.Helper()
	p := h.port(name)
	if p == 0 {
		h.t.Fatalf("no listener for %s", name)
	}
	return fmt.Sprintf("127.0.0.1:%d", p)
}

func svc(name string, proto config.Protocol, backends ...netip.AddrPort) *config.ServicePort {
	sp := &config.ServicePort{
		Name:       config.ServicePortName{Namespace: "ns", Name: name},
		Protocol:   proto,
		Port:       80,
		ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")},
	}
	for _, b := range backends {
		sp.Endpoints = append(sp.Endpoints, config.Endpoint{Addr: b, Ready: true, Serving: true})
	}
	return sp
}

// serveBackend is a loopback TCP backend: each connection is handed to
// handle on a goroutine of its own and closed when handle returns. When the
// test ends the listener and every open connection are closed, done is
// closed (for a handler that holds its connection), and the handlers are
// waited for, so that a failed test cannot hang in cleanup.
func serveBackend(t *testing.T, handle func(c net.Conn, done <-chan struct{})) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	open := map[net.Conn]bool{}
	done := make(chan struct{})
	t.Cleanup(func() {
		ln.Close()
		close(done)
		mu.Lock()
		for c := range open {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			open[c] = true
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { mu.Lock(); delete(open, c); mu.Unlock(); c.Close() }()
				handle(c, done)
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// tcpBackend answers every connection with its name and a newline, then
// echoes until the client half-closes, then closes.
func tcpBackend(t *testing.T, name string) netip.AddrPort {
	t.Helper()
	return serveBackend(t, func(c net.Conn, _ <-chan struct{}) {
		fmt.Fprintf(c, "%s\n", name)
		_, _ = io.Copy(c, c)
	})
}

// udpBackend replies to every datagram with "name:" + the datagram.
func udpBackend(t *testing.T, name string) netip.AddrPort {
	t.Helper()
	c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	return serveUDPEcho(t, c, name)
}

// serveUDPEcho replies on c to every datagram with "name:" + the datagram
// until the test ends, and returns c's address.
func serveUDPEcho(t *testing.T, c *net.UDPConn, name string) netip.AddrPort {
	done := make(chan struct{})
	t.Cleanup(func() { c.Close(); <-done })
	go func() {
		defer close(done)
		buf := make([]byte, 70000)
		for {
			n, from, err := c.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			_, _ = c.WriteToUDPAddrPort(append([]byte(name+":"), buf[:n]...), from)
		}
	}()
	return c.LocalAddr().(*net.UDPAddr).AddrPort()
}

// Misbehaving peers (testutil/peers.go).
func closedPort(t *testing.T) netip.AddrPort { return testutil.ClosedPort(t) }
func blackhole(t *testing.T) netip.AddrPort  { return testutil.Blackhole(t) }

// fetchName connects, reads the backend's name line and closes.
func fetchName(t *testing.T, addr string) string {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatalf("read from %s: %v", addr, err)
	}
	return strings.TrimSpace(line)
}

// freePorts returns the first of n consecutive TCP ports, below the
// kernel's ephemeral range, that nothing holds on 127.0.0.1 now: a port range
// for a proxier under test. A closed ephemeral port (closedPort) may be
// taken again at any moment by any connection of the process, its
// neighbour even more so: a range of two made that way failed one run in
// four.
func freePorts(t *testing.T, n int) int {
	t.Helper()
	low := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil {
				low = v
			}
		}
	}
	const from = 10000
	if low-n <= from {
		t.Skipf("the ephemeral range starts at %d: no room below it for a test port range", low)
	}
	for tries := 0; tries < 200; tries++ {
		base := from + rand.IntN(low-n-from)
		ok := true
		for p := base; p < base+n && ok; p++ {
			ln, err := net.Listen("tcp4", fmt.Sprintf("127.0.0.1:%d", p))
			if err != nil {
				ok = false
				continue
			}
			ln.Close()
		}
		if ok {
			return base
		}
	}
	t.Fatalf("no %d consecutive free ports below %d", n, low)
	return 0
}
