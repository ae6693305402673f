package e2e

import (
	"context"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

// requireChromium returns Debian's chromium, or skips (fails under
// KUP_REQUIRE_ROOT_TESTS: .ci/run installs it; make test never does).
func requireChromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("KUP_REQUIRE_ROOT_TESTS") != "" {
		t.Fatal("the browser test needs chromium (Debian package chromium; .ci/run installs it) and KUP_REQUIRE_ROOT_TESTS is set")
	}
	t.Skip("needs chromium (apt-get install chromium) for the live page's browser test")
	return ""
}

// dom loads url in headless Chromium inside namespace ns and returns the
// DOM after the page's scripts ran for budget of virtual time.
func (l *Lab) dom(t *testing.T, chromium, ns, url string, budget time.Duration) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "ip", "netns", "exec", l.NS(ns), chromium,
		"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync",
		"--user-data-dir="+t.TempDir(), "--virtual-time-budget="+strconv.Itoa(int(budget.Milliseconds())),
		"--dump-dom", url)
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.Output()
	if err != nil {
		stderr := ""
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("chromium %s: %v\n%s", url, err, stderr)
	}
	return string(out)
}

var (
	refreshedRE = regexp.MustCompile(`<body[^>]*data-refreshed="(\d+)"`)
	bytesDownRE = regexp.MustCompile(`<tr data-conn="\d+"><td>lab/web:http</td>.*?class="num bytes-down">\d+</td><td class="num acked-down">(\d+)</td>`)
	rulePktsRE  = regexp.MustCompile(`<tr class="rule" data-chain="KUBE-PORTALS-CONTAINER">(?:<td[^>]*>[^<]*</td>){3}<td class="mono">-d 10\.96\.0\.10/32 -p tcp[^<]*</td><td class="num packets">(\d+)</td>`)
)

// The live page at /, in a real browser: after its scripts ran, the DOM
// holds the Services with their endpoints, a live download with its bytes
// moving, the connection log, the rules with packet counters, and an
// explain answer.
func TestLivePageInChromium(t *testing.T) {
	chromium := requireChromium(t)
	l, d, _ := startWeb(t, webManifest(), "--connection-log", "all")
	defer func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", d.Output())
		}
	}()
	reachesBoth(t, l, "client", "http://10.96.0.10:80/")
	// A download slower than the proxy can send: its bytes must move on
	// the page while backpressure holds the splice. They move in steps, as
	// the client's kernel reopens its window (half a receive buffer of
	// megabytes at a time): a second or two apart at 2 MiB/s.
	l.Start("client", "curl", "-s", "-o", "/dev/null", "--limit-rate", "2M", "http://10.96.0.10:80/bytes?n=100000000000")
	waitFor(t, "the download on /debug/connections", func() bool {
		_, body := l.get("node", "http://127.0.0.1:10249/debug/connections")
		return strings.Contains(body, `"bytesDown"`) && !strings.Contains(body, `"bytesDown": 0`)
	})

	page := l.dom(t, chromium, "node", "http://127.0.0.1:10249/", 3*time.Second)
	for _, want := range []string{
		`data-service="lab/web:http" data-family="4" data-protocol="TCP"`,
		`data-service="lab/web:dns" data-family="6" data-protocol="UDP"`,
		`<span class="ep" data-endpoint="10.251.19.12:8080">`,
		`<span class="tag ready">ready</span>`,
		`203.0.113.11:80`,
		`class="log-line"`,
		`Connection closed`,
	} {
		if !strings.Contains(page, want) {
			t.Fatalf("the page lacks %q after its scripts ran:\n%s", want, page)
		}
	}
	if m := refreshedRE.FindStringSubmatch(page); m == nil || m[1] == "0" {
		t.Fatalf("the page never refreshed itself: %v", m)
	}
	first := bytesDownRE.FindStringSubmatch(page)
	rule := rulePktsRE.FindStringSubmatch(page)
	if first == nil || rule == nil {
		t.Fatalf("no live download (%v) or no ClusterIP rule with a counter (%v) on the page:\n%s", first, rule, page)
	}
	if n, _ := strconv.Atoi(rule[1]); n == 0 {
		t.Fatalf("the ClusterIP rule's packet counter is 0 after connections through it")
	}
	// Each try starts a browser (seconds on a loaded machine): a minute.
	testutil.WaitFor(t, "the download's bytes moving on the page", time.Minute, 100*time.Millisecond, func() bool {
		second := bytesDownRE.FindStringSubmatch(l.dom(t, chromium, "node", "http://127.0.0.1:10249/", 3*time.Second))
		a, _ := strconv.Atoi(first[1])
		b := 0
		if second != nil {
			b, _ = strconv.Atoi(second[1])
		}
		if b <= a {
			t.Logf("acked bytes on the page: %d, then %v", a, second)
		}
		return b > a
	})

	// A shared link explains at once; the answer is the daemon's own.
	page = l.dom(t, chromium, "node", "http://127.0.0.1:10249/?from=10.251.19.20&to=10.96.0.10:80&protocol=TCP", 2*time.Second)
	for _, want := range []string{`id="explain-result" class="" data-status="200"`, "is its clusterIP", "KUBE-PORTALS-CONTAINER, rule",
		"The next connection from 10.251.19.20 goes to"} {
		if !strings.Contains(page, want) {
			t.Fatalf("the explain answer lacks %q:\n%s", want, page)
		}
	}
}
