package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/internal/options"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// A drain changes state: a page in a browser must not be able to send one.
// Only POST or DELETE with the custom header, and no foreign Origin, reach
// the proxier.
func TestDrainRequestGuards(t *testing.T) {
	d := &debugServer{p: proxy.New(proxy.Config{})}
	const url = "http://127.0.0.1:10249/debug/drain?service=ns/web:http&endpoint=10.0.0.1:80"
	for _, tc := range []struct {
		name   string
		method string
		header map[string]string
		url    string
		want   int
	}{
		{"a GET (a link, an image)", http.MethodGet, map[string]string{drainHeader: "drain"}, url, http.StatusMethodNotAllowed},
		{"a form's POST: no header", http.MethodPost, nil, url, http.StatusForbidden},
		{"a foreign page's script", http.MethodPost, map[string]string{drainHeader: "drain", "Origin": "http://evil.example"}, url, http.StatusForbidden},
		{"a bad service", http.MethodPost, map[string]string{drainHeader: "drain"},
			"http://127.0.0.1:10249/debug/drain?service=web&endpoint=10.0.0.1:80", http.StatusBadRequest},
		{"a bad endpoint", http.MethodDelete, map[string]string{drainHeader: "drain"},
			"http://127.0.0.1:10249/debug/drain?service=ns/web&endpoint=x", http.StatusBadRequest},
		{"the operator's curl, an unknown endpoint", http.MethodPost, map[string]string{drainHeader: "drain"}, url, http.StatusNotFound},
		{"same origin", http.MethodDelete, map[string]string{drainHeader: "drain", "Origin": "http://127.0.0.1:10249"}, url, http.StatusNotFound},
	} {
		req := httptest.NewRequest(tc.method, tc.url, nil)
		for k, v := range tc.header {
			req.Header.Set(k, v)
		}
		rec := httptest.NewRecorder()
		d.drain(rec, req)
		if rec.Code != tc.want {
			t.Errorf("%s: %d %q, want %d", tc.name, rec.Code, rec.Body.String(), tc.want)
		}
	}
}

// kube-proxy's /proxyMode names the mode; tools and the upstream e2e spec
// "should check kube-proxy urls" read it from the metrics address.
func TestProxyModeURL(t *testing.T) {
	d := &debugServer{p: proxy.New(proxy.Config{})}
	srv := httptest.NewServer(d.routes(prometheus.NewRegistry(), false))
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/proxyMode")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || string(body) != "userspace" {
		t.Fatalf("/proxyMode: %d %q, want 200 \"userspace\"", resp.StatusCode, body)
	}
}

// With bindAddressHardFail off (kube-proxy's default) a taken address is
// retried until it frees up; with it on the error is returned at once.
func TestHTTPBindRetriesUnlessHardFail(t *testing.T) {
	holder, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := holder.Addr().String()
	log := logrus.New()
	log.SetOutput(io.Discard)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := startHTTP(ctx, addr, nil, http.NotFoundHandler(), metricsLimits, true, 10*time.Millisecond, log); err == nil {
		t.Fatal("hard fail: a taken address was not an error")
	}
	done, err := startHTTP(ctx, addr, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "mine") }),
		metricsLimits, false, 20*time.Millisecond, log)
	if err != nil {
		t.Fatalf("soft fail: %v", err)
	}
	holder.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := http.Get("http://" + addr + "/")
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if string(body) == "mine" {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the freed address was not taken over: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	select {
	case <-done.done:
	case <-time.After(5 * time.Second):
		t.Fatal("the server did not stop with its context")
	}
}

// /configz shows the effective configuration under kube-proxy's key.
func TestConfigzShowsEffectiveConfig(t *testing.T) {
	o, err := options.Parse([]string{"--manifests", "m.yaml", "--conntrack-tcp-timeout-close-wait", "2h", "--nodeport-addresses", "primary"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	d := &debugServer{p: proxy.New(proxy.Config{}), conf: o.Configz("node-1")}
	srv := httptest.NewServer(d.routes(prometheus.NewRegistry(), false))
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/configz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var got map[string]map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
		t.Fatal(err)
	}
	kp := got["kubeproxy.config.k8s.io"]
	if kp["mode"] != "userspace" || kp["hostnameOverride"] != "node-1" || kp["healthzBindAddress"] != "0.0.0.0:10256" {
		t.Errorf("configz: %v", kp)
	}
	if ct := kp["conntrack"].(map[string]any); ct["tcpCloseWaitTimeout"] != "2h0m0s" {
		t.Errorf("configz conntrack: %v", ct)
	}
	if np := fmt.Sprint(kp["nodePortAddresses"]); np != "[primary]" {
		t.Errorf("configz nodePortAddresses: %s", np)
	}
	if got["kube-userspace-proxy"]["manifests"] != "m.yaml" {
		t.Errorf("configz lacks this proxy's own fields: %v", got["kube-userspace-proxy"])
	}
}

// The bench reads the runtime's scheduling latencies, pauses and allocations
// from /metrics; a rename in the Prometheus client would leave it blind.
func TestRegistryExportsTheRuntimeTail(t *testing.T) {
	families, err := newRegistry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, f := range families {
		have[f.GetName()] = true
	}
	for _, name := range []string{"kube_userspace_proxy_go_sched_latency_seconds", "kube_userspace_proxy_go_gc_pause_seconds",
		"go_gc_heap_allocs_bytes_total", "go_gc_heap_allocs_objects_total", "go_gc_cycles_total_gc_cycles_total"} {
		if !have[name] {
			t.Errorf("/metrics lacks %s", name)
		}
	}
}
