package daemon

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// The page is served at / only, self-contained (no external asset), with a
// policy that forbids loading anything from elsewhere.
func TestPageServed(t *testing.T) {
	d := &debugServer{p: proxy.New(proxy.Config{}), log: newRecentLog(4)}
	srv := httptest.NewServer(d.routes(prometheus.NewRegistry(), false))
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") ||
		!strings.Contains(resp.Header.Get("Content-Security-Policy"), "default-src 'self'") {
		t.Fatalf("%d %v", resp.StatusCode, resp.Header)
	}
	for _, external := range []string{"http://", "https://", "//cdn", "@import"} {
		if strings.Contains(string(body), external) {
			t.Fatalf("the page refers to something outside the daemon: %q", external)
		}
	}
	for _, path := range []string{"/debug/services", "/debug/connections", "/debug/log?n=50", "/debug/rules?format=json", "/debug/explain?"} {
		if !strings.Contains(string(body), strings.SplitN(path, "?", 2)[0]) {
			t.Fatalf("the page does not use %s", path)
		}
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if want := map[bool]int{true: 400, false: 200}[strings.HasPrefix(path, "/debug/explain")]; resp.StatusCode != want {
			t.Fatalf("%s: %d, want %d", path, resp.StatusCode, want)
		}
	}
	if resp, _ := http.Get(srv.URL + "/nothing-here"); resp.StatusCode != 404 {
		t.Fatalf("an unknown path: %d", resp.StatusCode)
	}
}

// The ring holds the connection log lines only, newest first, and forgets
// the oldest.
func TestRecentLog(t *testing.T) {
	log := logrus.New()
	log.SetOutput(io.Discard)
	r := newRecentLog(3)
	log.AddHook(r)
	conn := log.WithField("component", "conn")
	log.WithField("component", "proxier").Info("Synced")
	for i := 0; i < 5; i++ {
		conn.WithFields(logrus.Fields{"client": fmt.Sprint(i)}).WithError(fmt.Errorf("boom %d", i)).Info("Connection closed")
	}
	lines := r.latest(10)
	if len(lines) != 3 || lines[0].Fields["client"] != "4" || lines[2].Fields["client"] != "2" || lines[0].Fields["error"] != "boom 4" {
		t.Fatalf("%+v", lines)
	}
	if _, has := lines[0].Fields["component"]; has {
		t.Fatal("component kept")
	}
	d := &debugServer{log: r}
	rec := httptest.NewRecorder()
	d.connLog(rec, httptest.NewRequest("GET", "/debug/log?n=1", nil))
	var got []logLine
	if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil || len(got) != 1 || got[0].Message != "Connection closed" {
		t.Fatalf("%v %s", err, rec.Body.String())
	}
	rec = httptest.NewRecorder()
	d.connLog(rec, httptest.NewRequest("GET", "/debug/log?n=-1", nil))
	if rec.Code != 400 {
		t.Fatalf("n=-1: %d", rec.Code)
	}
}
