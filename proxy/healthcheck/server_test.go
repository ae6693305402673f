package healthcheck

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// freePort returns a loopback port nobody listens on now.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func ask(t *testing.T, port int) (int, http.Header, answer) {
	t.Helper()
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(fmt.Sprintf("http://127.0.0.1:%d/any/path", port))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	var a answer
	if err := json.Unmarshal(body, &a); err != nil {
		t.Fatalf("%v: %s", err, body)
	}
	return resp.StatusCode, resp.Header, a
}

// The answer follows the local endpoints and the proxy's health; a port
// goes away with its Service; a port another process holds is retried.
func TestServer(t *testing.T) {
	log := logrus.New()
	log.SetOutput(io.Discard)
	var healthy atomic.Bool
	healthy.Store(true)
	s := &Server{Addrs: []netip.Addr{netip.MustParseAddr("127.0.0.1")}, Healthy: healthy.Load, Log: log}
	defer s.Close()
	port := freePort(t)
	s.Sync([]Service{{Namespace: "ns", Name: "lb", Port: port, LocalEndpoints: 2}})
	code, h, a := ask(t, port)
	if code != 200 || a.LocalEndpoints != 2 || !a.ServiceProxyHealthy || a.Service.Namespace != "ns" || a.Service.Name != "lb" ||
		h.Get("X-Load-Balancing-Endpoint-Weight") != "2" || h.Get("Content-Type") != "application/json" {
		t.Fatalf("%d %v %+v", code, h, a)
	}
	s.Sync([]Service{{Namespace: "ns", Name: "lb", Port: port, LocalEndpoints: 0}})
	if code, _, a := ask(t, port); code != 503 || a.LocalEndpoints != 0 {
		t.Fatalf("no local endpoint: %d %+v", code, a)
	}
	s.Sync([]Service{{Namespace: "ns", Name: "lb", Port: port, LocalEndpoints: 1}})
	healthy.Store(false)
	if code, _, a := ask(t, port); code != 503 || a.ServiceProxyHealthy {
		t.Fatalf("proxy unhealthy: %d %+v", code, a)
	}
	healthy.Store(true)

	// Another process holds the next port: not served, retried.
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	busy := taken.Addr().(*net.TCPAddr).Port
	s.Sync([]Service{{Namespace: "ns", Name: "lb", Port: port, LocalEndpoints: 1}, {Namespace: "ns", Name: "b", Port: busy, LocalEndpoints: 1}})
	if len(s.ports) != 1 || s.failed[busy] == "" {
		t.Fatalf("ports %v, failed %v", s.ports, s.failed)
	}
	taken.Close()
	s.Sync([]Service{{Namespace: "ns", Name: "lb", Port: port, LocalEndpoints: 1}, {Namespace: "ns", Name: "b", Port: busy, LocalEndpoints: 1}})
	if code, _, a := ask(t, busy); code != 200 || a.Service.Name != "b" {
		t.Fatalf("the freed port: %d %+v", code, a)
	}

	// The Service is gone: so is its port.
	s.Sync([]Service{{Namespace: "ns", Name: "b", Port: busy, LocalEndpoints: 1}})
	if _, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), time.Second); err == nil {
		t.Fatal("the port of a removed Service still answers")
	}
}
