package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/prometheus/client_golang/prometheus"
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
		{"a bad service", http.MethodPost, map[string]string{drainHeader: "drain"}, "http://127.0.0.1:10249/debug/drain?service=web&endpoint=10.0.0.1:80", http.StatusBadRequest},
		{"a bad endpoint", http.MethodDelete, map[string]string{drainHeader: "drain"}, "http://127.0.0.1:10249/debug/drain?service=ns/web&endpoint=x", http.StatusBadRequest},
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
