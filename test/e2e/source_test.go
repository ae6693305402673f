package e2e

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

// sourceManifest is lab/web (ClusterIP, NodePort 31341) with pod1 on this
// node and pod2 on another, lab/local the same with externalTrafficPolicy
// Local, an externalIP and a LoadBalancer IP (203.0.113.12), and lab/opaque the same as web with the
// annotation that keeps the node's address, and lab/retry on port 8081,
// where only pod1 listens (pod2 refuses).
func sourceManifest() string {
	other := func(s string) string {
		s = strings.ReplaceAll(s, "- {addresses: [10.251.19.8], nodeName: node}", "- {addresses: [10.251.19.8], nodeName: other}")
		return strings.ReplaceAll(s, `- {addresses: ["fd00:251::8"], nodeName: node}`, `- {addresses: ["fd00:251::8"], nodeName: other}`)
	}
	dual := "  clusterIPs: [%s]\n  ipFamilies: [IPv4, IPv6]\n"
	web := service(
		"web",
		"NodePort",
		"10.96.0.10,fd00:96::10",
		fmt.Sprintf(dual, `10.96.0.10, "fd00:96::10"`),
		webPorts,
	) + other(
		slices("web", webSlicePorts, true),
	)
	local := "---\n" + service(
		"local",
		"LoadBalancer",
		"10.96.0.11",
		"  externalIPs: [203.0.113.10]\n  externalTrafficPolicy: Local\n",
		strings.ReplaceAll(
			webPorts,
			"31341",
			"31342",
		),
	) + "status: {loadBalancer: {ingress: [{ip: 203.0.113.12}]}}\n" + other(slices("local", webSlicePorts, false))
	opaque := "---\n" + strings.Replace(
		service("opaque", "ClusterIP", "10.96.0.12", "", `{name: http, port: 80, targetPort: 8080, protocol: TCP}`),
		"metadata: {name: opaque, namespace: lab}",
		"metadata: {name: opaque, namespace: lab, annotations: {kube-userspace-proxy.io/backend-source-address: node}}",
		1,
	) +
		other(slices("opaque", `{name: http, port: 8080, protocol: TCP}`, false))
	retry := "---\n" + service("retry", "ClusterIP", "10.96.0.14", "", `{name: http, port: 80, targetPort: 8081, protocol: TCP}`) +
		slices("retry", `{name: http, port: 8081, protocol: TCP}`, false)
	return web + local + opaque + retry
}

// sourceLab is the lab of sourceManifest with its backends and a daemon
// (extra flags in flags) that detects this node's pods by --cluster-cidr
// and logs every connection; the daemon's log is shown if the test fails.
func sourceLab(t *testing.T, flags ...string) (*Lab, *Proc) {
	t.Helper()
	l := NewLab(t)
	l.Backends()
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, sourceManifest())
	d := l.Daemon(append([]string{"--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node",
		"--cluster-cidr", "10.251.19.0/24,fd00:251::/64", "--connection-log", "all"}, flags...)...)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", tail(d.Output(), 4000))
		}
	})
	return l, d
}

// peerOf is the client address a backend reports ("pod1 (client A:P)"
// → "A").
func peerOf(body string) string {
	_, rest, ok := strings.Cut(body, "(client ")
	if !ok {
		return ""
	}
	addr := strings.TrimSuffix(strings.TrimSpace(rest), ")")
	if i := strings.LastIndex(addr, ":"); i > 0 {
		addr = addr[:i]
	}
	return strings.Trim(addr, "[]")
}

// seesOnly fetches url n times from ns and fails unless every backend saw
// want.
func seesOnly(t *testing.T, l *Lab, ns, url, want string, n int) {
	t.Helper()
	for i := 0; i < n; i++ {
		body := l.Curl(ns, url)
		if got := peerOf(body); !seenOK(got, want) {
			t.Fatalf("%s → %s: the backend saw %q (%q), want %s", ns, url, got, body, want)
		}
	}
}

// The backend sees who called, wherever kube-proxy would not masquerade: a
// pod of this node through a ClusterIP (the endpoint on this node's
// bridge, IPv4 and IPv6; routed to another node: TestBackendBehindAnotherNode), the node itself, and an
// external client of an externalTrafficPolicy: Local Service. An external
// client of an externalTrafficPolicy: Cluster Service, a Service with the
// annotation, and the flag set to node show the node's address.
func TestBackendSeesTheClient(t *testing.T) {
	l, d := sourceLab(t)
	waitFor(t, "web served", func() bool { return l.Curl("client", "http://10.96.0.10/") != "" })

	// Both endpoints (pod1 "on this node", pod2 "on another"), by round robin.
	seesOnly(t, l, "client", "http://10.96.0.10/", "10.251.19.20", 8)
	seesOnly(t, l, "client", "http://[fd00:96::10]/", "fd00:251::20", 8)
	seesOnly(t, l, "node", "http://10.96.0.10/", "192.168.50.1", 4)
	seesOnly(t, l, "ext", "http://192.168.50.1:31341/", "10.251.19.1", 4) // eTP Cluster: masqueraded
	seesOnly(t, l, "ext", "http://203.0.113.10/", "192.168.50.2", 4)      // eTP Local: the client
	seesOnly(t, l, "ext", "http://192.168.50.1:31342/", "192.168.50.2", 4)
	seesOnly(t, l, "ext", "http://203.0.113.12/", "192.168.50.2", 4)
	seesOnly(t, l, "client", "http://10.96.0.12/", "10.251.19.1", 4) // the annotation

	// A refused dial costs a retry, as without the source NAT: every
	// request answered by pod1, which sees the client.
	l.Start("pod1", filepath.Join(binDir, "backend"), "--name", "pod1-8081", "--tcp", ":8081", "--udp", "")
	waitFor(t, "pod1's second backend", func() bool { return l.Curl("node", "http://10.251.19.12:8081/") != "" })
	for i := range 10 {
		body := l.Curl("client", "http://10.96.0.14/")
		if !strings.HasPrefix(body, "pod1-8081 ") || !seenOK(peerOf(body), "10.251.19.20") {
			t.Fatalf("request %d to lab/retry: %q, want pod1-8081 seeing 10.251.19.20", i, body)
		}
	}
	if !strings.Contains(d.Output(), `dialErrors="refused 10.251.19.8:8081"`) {
		t.Fatalf("no refused dial to pod2:8081 in the log")
	}

	// Hairpin: pod1 through its own Service reaches itself from the
	// node's address (as kube-proxy masquerades it), pod2 from its own.
	for range 8 {
		body := l.Curl("pod1", "http://10.96.0.10/")
		name, _, _ := strings.Cut(body, " ")
		want := map[string]string{"pod1": "10.251.19.1", "pod2": "10.251.19.12"}[name]
		if want == "" || !seenOK(peerOf(body), want) {
			t.Fatalf("pod1 → its own Service: %q, want pod1 seeing 10.251.19.1 or pod2 seeing 10.251.19.12", body)
		}
	}

	// What the operator reads: the connection log and the metric (on the
	// basic kernel: the node's address, and the client's unavailable).
	sawClient, available := "backendSees=10.251.19.20", "1"
	if basicKernel {
		sawClient, available = "backendSees=node", "0"
	}
	waitFor(t, "the connection log names the address the backend saw", func() bool {
		return strings.Contains(d.Output(), sawClient)
	})
	metrics := l.MustExec("node", "curl", "-s", "http://127.0.0.1:10249/metrics")
	wants := []string{`kube_userspace_proxy_client_address_available{ip_family="IPv4"} ` + available,
		`kube_userspace_proxy_client_address_available{ip_family="IPv6"} ` + available}
	if !basicKernel {
		wants = append(wants, `kube_userspace_proxy_backend_source_total{source="client"}`)
	}
	for _, want := range wants {
		if !strings.Contains(metrics, want) {
			t.Fatalf("/metrics lacks %s", want)
		}
	}

	// 1 000 connections in a row and 200 at once, each through a new
	// conntrack entry: every one answered, from the client's address,
	// IPv4 and IPv6.
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true, DialContext: cluster.DialContextIn(l.NS("client"))}}
	for _, tc := range []struct{ url, want string }{{"http://10.96.0.10/", "10.251.19.20"}, {"http://[fd00:96::10]/", "fd00:251::20"}} {
		get := func() error {
			resp, err := c.Get(tc.url)
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			if err != nil {
				return err
			}
			if got := peerOf(string(body)); !seenOK(got, tc.want) {
				return fmt.Errorf("the backend saw %q (%q)", got, body)
			}
			return nil
		}
		for i := range 1000 {
			if err := get(); err != nil {
				t.Fatalf("%s: connection %d in a row: %v", tc.url, i, err)
			}
		}
		var wg sync.WaitGroup
		errs := make(chan error, 200)
		for range 200 {
			wg.Add(1)
			go func() { defer wg.Done(); errs <- get() }()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatalf("%s: one of 200 at once: %v", tc.url, err)
			}
		}
	}

	// A client on one fixed source port, connecting again at once: every
	// connection answered, the backend seeing the client's address. Each
	// new connection of the daemon to the backend has the reply tuple of
	// the one before, which it takes over once that one is in TIME_WAIT
	// (and before, while that one still closes, it shows the client's
	// address from its own port).
	for i := range 50 {
		body, err := getFromPort(l.NS("client"), 40000, "10.96.0.10:80")
		if err != nil {
			t.Fatalf("connection %d at once from port 40000: %v", i, err)
		}
		if !strings.Contains(body, "(client 10.251.19.20:") && (!basicKernel || !strings.Contains(body, "(client 10.251.19.1:")) {
			t.Fatalf("connection %d at once from port 40000: the backend answered %q, want it to see 10.251.19.20", i, body)
		}
	}
	if basicKernel {
		return // no source NAT: no entry of the client's port to take over
	}
	for i := range 10 {
		waitFor(t, "every connection from port 40000 in TIME_WAIT", func() bool {
			out, err := l.Exec("node", "conntrack", "-L", "-p", "tcp", "--reply-port-dst", "40000")
			if err != nil {
				return false
			}
			for _, line := range strings.Split(out, "\n") {
				if strings.HasPrefix(line, "tcp") && !strings.Contains(line, " TIME_WAIT ") && !strings.Contains(line, " CLOSE ") {
					return false
				}
			}
			return true
		})
		body, err := getFromPort(l.NS("client"), 40000, "10.96.0.10:80")
		if err != nil {
			t.Fatalf("connection %d from port 40000: %v", i, err)
		}
		if !strings.Contains(body, "(client 10.251.19.20:40000)") {
			t.Fatalf("connection %d from port 40000: the backend answered %q, want it to see 10.251.19.20:40000", i, body)
		}
	}
}

// getFromPort makes one HTTP/1.0 request to addr from ns, its socket bound
// to port (SO_REUSEADDR), reads the answer to the server's close and then
// resets (no TIME_WAIT of its own), so that the next call can take the
// same port at once.
func getFromPort(ns string, port int, addr string) (string, error) {
	var body string
	err := cluster.InNetns(ns, func() error {
		d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{Port: port},
			Control: func(_, _ string, c syscall.RawConn) error {
				var serr error
				if err := c.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1) }); err != nil {
					return err
				}
				return serr
			}}
		c, err := d.Dial("tcp4", addr)
		if err != nil {
			return err
		}
		tc := c.(*net.TCPConn)
		defer func() { _ = tc.SetLinger(0); _ = tc.Close() }()
		_ = tc.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.WriteString(tc, "GET / HTTP/1.0\r\n\r\n"); err != nil {
			return err
		}
		b, err := io.ReadAll(tc)
		body = string(b)
		return err
	})
	return body, err
}

// UDP flows keep the client's address as TCP connections do: a pod of this
// node through a ClusterIP (IPv4 and IPv6, its port too), the node itself,
// an external client of an externalTrafficPolicy: Local Service; an
// external client of an externalTrafficPolicy: Cluster Service shows the
// node's. A flow that ends gives its conntrack entry back: the
// client's next flow from the same port keeps that port.
func TestUDPBackendSeesTheClient(t *testing.T) {
	l, d := sourceLab(t, "--udp-timeout", "1s")
	waitFor(t, "web's UDP port served", func() bool { return l.UDP("client", "10.96.0.10", "53", "peer?") != "" })

	sees := func(ns, host, port, want string) {
		t.Helper()
		for range 2 { // both endpoints, by round robin
			reply := l.udpExchange(ns, host, port, "peer?", "-w", "1")
			if got := peerOf(reply); !seenOK(got, want) {
				t.Fatalf("%s → %s:%s over UDP: the backend saw %q (%q), want %s", ns, host, port, got, reply, want)
			}
		}
	}
	sees("client", "10.96.0.10", "53", "10.251.19.20")
	sees("client", "fd00:96::10", "53", "fd00:251::20")
	sees("node", "10.96.0.10", "53", "192.168.50.1")
	sees("ext", "192.168.50.1", "31341", "10.251.19.1") // eTP Cluster: masqueraded
	sees("ext", "203.0.113.10", "53", "192.168.50.2")   // eTP Local: the client
	sees("ext", "192.168.50.1", "31342", "192.168.50.2")

	// One fixed source port: the port too. Once the flow has idled out
	// (its end logged), the next flow from that port gets it again: the
	// first one's conntrack entry went with it (three rounds: round robin
	// sends the third to the first one's endpoint, whose reply tuple that
	// entry would still hold).
	ended := regexp.MustCompile(`msg="UDP flow closed" backendSees=10\.251\.19\.20 [^\n]*client="10\.251\.19\.20:5353"`)
	if basicKernel {
		return // no source NAT: the backend sees the node, whatever port the client keeps (above)
	}
	for round := range 3 {
		before := len(ended.FindAllString(d.Output(), -1))
		if reply := l.UDPFrom(5353, "10.96.0.10", "53", "peer?"); !strings.Contains(reply, "(client 10.251.19.20:5353)") {
			t.Fatalf("round %d from port 5353: the backend answered %q, want it to see 10.251.19.20:5353", round, reply)
		}
		waitFor(t, "the flow from port 5353 ended and logged, the backend seeing the client", func() bool {
			return len(ended.FindAllString(d.Output(), -1)) > before
		})
	}
	metrics := l.MustExec("node", "curl", "-s", "http://127.0.0.1:10249/metrics")
	if !strings.Contains(metrics, `kube_userspace_proxy_backend_source_total{source="client"}`) {
		t.Fatalf("/metrics lacks the client source count")
	}
}

// An endpoint on another node of a routed cluster (lab_far): its replies
// to a pod of this node come back by that node's route through this one,
// where the conntrack entry turns them back to the daemon's socket. The
// pod keeps its address (IPv4 and IPv6), the node its own; an external
// client of an externalTrafficPolicy: Cluster Service shows the node's
// (kube-proxy's masquerade: the endpoint would answer it by its own
// node's route). Nothing of it stays in the node: no mark, no ip rule, no
// route, while the daemon runs and after --cleanup.
func TestBackendBehindAnotherNode(t *testing.T) {
	l := NewLab(t)
	if out, err := l.script("lab_far"); err != nil {
		t.Fatalf("lab_far: %v\n%s", err, out)
	}
	l.Start("pod3", filepath.Join(binDir, "backend"), "--name", "pod3", "--tcp", ":8080", "--udp", "")
	for _, url := range []string{"http://10.252.0.5:8080/", "http://[fd00:252::5]:8080/"} {
		waitFor(t, "pod3 at "+url, func() bool { return l.Curl("node", url) != "" })
	}
	// The node's rules and routes, but for the link-local ones the kernel
	// adds by itself once an interface's IPv6 address autoconfiguration
	// is done, which may be while the test runs.
	routing := func() string {
		var out strings.Builder
		for _, args := range [][]string{{"ip", "rule"}, {"ip", "-6", "rule"}, {"ip", "route", "show", "table", "all"},
			{"ip", "-6", "route", "show", "table", "all"}} {
			for _, line := range strings.Split(l.MustExec("node", args...), "\n") {
				if strings.Contains(line, "fe80::") && strings.Contains(line, "proto kernel") {
					continue
				}
				out.WriteString(line + "\n")
			}
		}
		return out.String()
	}
	before := routing()

	m := filepath.Join(t.TempDir(), "m.yaml")
	far := strings.NewReplacer("10.251.19.12], nodeName: node", "10.252.0.5], nodeName: far", "- {addresses: [10.251.19.8], nodeName: node}\n", "",
		`"fd00:251::12"], nodeName: node`, `"fd00:252::5"], nodeName: far`, "- {addresses: [\"fd00:251::8\"], nodeName: node}\n", "")
	writeManifest(t, m, service("far", "NodePort", "10.96.0.13", "  clusterIPs: [10.96.0.13, \"fd00:96::13\"]\n  ipFamilies: [IPv4, IPv6]\n",
		`{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 31343}`)+far.Replace(slices("far", `{name: http, port: 8080, protocol: TCP}`, true)))
	d := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node",
		"--cluster-cidr", "10.251.19.0/24,fd00:251::/64")
	defer func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", tail(d.Output(), 4000))
		}
	}()
	waitFor(t, "far served", func() bool { return l.Curl("client", "http://10.96.0.13/") != "" })

	seesOnly(t, l, "client", "http://10.96.0.13/", "10.251.19.20", 20)
	seesOnly(t, l, "client", "http://[fd00:96::13]/", "fd00:251::20", 20)
	seesOnly(t, l, "node", "http://10.96.0.13/", "192.168.50.1", 4)
	seesOnly(t, l, "ext", "http://192.168.50.1:31343/", "192.168.60.1", 4) // eTP Cluster: masqueraded

	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true, DialContext: cluster.DialContextIn(l.NS("client"))}}
	var wg sync.WaitGroup
	errs := make(chan error, 200)
	for range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := c.Get("http://10.96.0.13/")
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			if err == nil && !seenOK(peerOf(string(body)), "10.251.19.20") {
				err = fmt.Errorf("the backend saw %q", body)
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("one of 200 at once to the far endpoint: %v", err)
		}
	}

	if now := routing(); now != before {
		t.Errorf("the daemon changed the node's routing while serving:\nbefore:\n%s\nnow:\n%s", before, now)
	}
	for _, save := range []string{"iptables-save", "ip6tables-save"} {
		if rules := l.MustExec("node", save); strings.Contains(strings.ToLower(rules), "mark") {
			t.Errorf("%s shows a mark:\n%s", save, grepLines(strings.ToLower(rules), "mark"))
		}
	}
	_ = d.Cmd.Process.Signal(syscall.SIGTERM)
	_ = d.Cmd.Wait()
	l.MustExec("node", filepath.Join(binDir, "kube-userspace-proxy"), "--cleanup")
	if now := routing(); now != before {
		t.Errorf("--cleanup left the node's routing changed:\nbefore:\n%s\nnow:\n%s", before, now)
	}
	for _, save := range []string{"iptables-save", "ip6tables-save"} {
		if rules := l.MustExec("node", save); strings.Contains(rules, "-A ") {
			t.Errorf("--cleanup left rules in %s:\n%s", save, rules)
		}
	}
}

// Where the replies could not come back through conntrack (a pod calling
// a pod on this node's bridge without br_netfilter), the backend sees the
// node's address and the connection works; --backend-source-address node
// turns it off everywhere.
func TestBackendSourceFallsBack(t *testing.T) {
	l := NewLab(t)
	l.Backends()
	m := filepath.Join(t.TempDir(), "m.yaml")
	onlyPod1 := func(s string) string {
		s = strings.ReplaceAll(s, "- {addresses: [10.251.19.8], nodeName: node}\n", "")
		return strings.ReplaceAll(s, "- {addresses: [\"fd00:251::8\"], nodeName: node}\n", "")
	}
	writeManifest(t, m, service("web", "NodePort", "10.96.0.10", "  externalIPs: [203.0.113.10]\n  externalTrafficPolicy: Local\n", webPorts)+
		onlyPod1(slices("web", webSlicePorts, false)))
	if _, err := l.Exec("node", "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0"); err != nil {
		t.Fatalf("net.bridge.bridge-nf-call-iptables is not a sysctl of this namespace (br_netfilter not loaded?): %v", err)
	}
	d := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node",
		"--cluster-cidr", "10.251.19.0/24,fd00:251::/64")
	defer func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", tail(d.Output(), 4000))
		}
	}()
	waitFor(t, "web served", func() bool { return l.Curl("client", "http://10.96.0.10/") != "" })
	switch started := grepLines(d.Output(), "msg=Started "); {
	case basicKernel && !strings.Contains(started, "no conntrack-netlink: "):
		t.Fatalf("the start line does not name the missing conntrack netlink:\n%s", started)
	case !basicKernel && !strings.Contains(started, "no br-netfilter: IPv4 pods calling a pod on this node's bridge show it the node's address: net.bridge.bridge-nf-call-iptables is not 1"):
		t.Fatalf("the start line does not name the bridged replies:\n%s", started)
	}
	seesOnly(t, l, "client", "http://10.96.0.10/", "10.251.19.1", 20)
	// An external client's reply is routed, not bridged: its own address.
	seesOnly(t, l, "ext", "http://203.0.113.10/", "192.168.50.2", 4)
	metrics := l.MustExec("node", "curl", "-s", "http://127.0.0.1:10249/metrics")
	var fallbacks int
	for _, line := range strings.Split(metrics, "\n") {
		if v, ok := strings.CutPrefix(line, `kube_userspace_proxy_backend_source_total{source="fallback"} `); ok {
			fallbacks, _ = strconv.Atoi(v)
		}
	}
	if fallbacks < 20 {
		t.Fatalf("/metrics counts %d fallbacks, want at least the 20 made:\n%s", fallbacks, grepLines(metrics, "backend_source"))
	}
	_ = d.Cmd.Process.Signal(syscall.SIGTERM)
	_ = d.Cmd.Wait()

	d = l.Daemon("--manifests", m, "--hostname-override", "node", "--cluster-cidr", "10.251.19.0/24", "--backend-source-address", "node")
	waitFor(t, "web served again", func() bool { return l.Curl("ext", "http://203.0.113.10/") != "" })
	seesOnly(t, l, "ext", "http://203.0.113.10/", "10.251.19.1", 4)
}

// grepLines is the lines of s that contain sub.
func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// The interface modes of --detect-local-mode tell a pod of this node by
// the interface the node routes it by: the pods' bridge, or an interface
// of the name prefix. Such a pod keeps its address through a ClusterIP;
// one the mode does not name shows the node's.
func TestBackendSourceByInterface(t *testing.T) {
	l := NewLab(t)
	l.Backends()
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, service("web", "ClusterIP", "10.96.0.10", "", `{name: http, port: 80, targetPort: 8080, protocol: TCP}`)+
		slices("web", `{name: http, port: 8080, protocol: TCP}`, false))
	for _, tc := range []struct {
		args []string
		sees string
	}{
		{[]string{"--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "br0"}, "10.251.19.20"},
		{[]string{"--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "br"}, "10.251.19.20"},
		{[]string{"--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "cni0"}, "10.251.19.1"},
		{[]string{"--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "veth"}, "10.251.19.1"},
	} {
		d := l.Daemon(append([]string{"--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node"}, tc.args...)...)
		waitFor(t, "web served", func() bool { return l.Curl("client", "http://10.96.0.10/") != "" })
		for i := 0; i < 6; i++ {
			if got := peerOf(l.Curl("client", "http://10.96.0.10/")); !seenOK(got, tc.sees) {
				t.Fatalf("%v: the backend saw %q, want %s\n%s", tc.args, got, tc.sees, tail(d.Output(), 3000))
			}
		}
		_ = d.Cmd.Process.Signal(syscall.SIGTERM)
		_ = d.Cmd.Wait()
	}
}

// A client that closes first leaves each backend connection's port in
// TIME_WAIT for a minute. The source NAT's dials bind their ports from the
// proxy port range, never from the node's own: a high rate of such
// connections keeps the client's address and never takes the ports the
// node's other connections need (which a port the kernel picks for bind
// would: the kernel's choice for every other connect skips it while its
// TIME_WAIT lasts).
func TestBackendSourceKeepsTheNodesPorts(t *testing.T) {
	// 200 ports of the node's own, without reuse of TIME_WAIT: the old
	// way ran out of them after 200 connections.
	l, _ := fewPortsLab(t, "--proxy-port-range", "20000-20999", "--cluster-cidr", "10.251.19.0/24,fd00:251::/64")

	// 1 500 connections: more than the node's 200 ports, fewer than the
	// 2 000 that 1 000 ports to two endpoints give within a TIME_WAIT.
	// Without conntrack netlink (the basic kernel) there is no source NAT:
	// the dials take the node's own ports, as the classic proxier's did,
	// so only what the node's 200 ports carry (docs/iptables.md).
	n := 1500
	if basicKernel {
		n = 150
	}
	for i := range n {
		body, err := getClosingFirst(l.NS("client"), "10.96.0.22:80")
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		if got := peerOf(body); !seenOK(got, "10.251.19.20") {
			t.Fatalf("connection %d: the backend saw %q (%q), want the client 10.251.19.20", i, got, body)
		}
	}
	if basicKernel {
		return
	}
	// The node's own connections still find a port (the scrape connects
	// from the node).
	fams := scrape(t, l)
	if v := metricSum(fams, "kube_userspace_proxy_backend_source_total", map[string]string{"source": "fallback"}); v > 0 {
		t.Errorf("%v connections fell back to the node's address", v)
	}
	if v := metricSum(fams, "kube_userspace_proxy_dial_failures_total", nil); v > 0 {
		t.Errorf("%v dials failed", v)
	}
	out := l.MustExec("node", "ss", "-Htan", "state", "time-wait")
	inRange := 0
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) < 3 {
			continue
		}
		local, err := netip.ParseAddrPort(f[2])
		if err == nil && local.Port() >= 20000 && local.Port() <= 20999 {
			inRange++
		} else if err == nil && local.Port() >= 61000 && local.Port() <= 61199 && strings.Contains(f[3], ":8080") {
			t.Fatalf("a backend connection in TIME_WAIT on the node's own port: %s", line)
		}
	}
	if inRange < 1000 {
		t.Errorf("%d backend connections in TIME_WAIT on the proxy port range, want 1 500 less those reused: %s", inRange, tail(out, 600))
	}
}

// Without local-traffic detection the daemon cannot tell this node's pods
// from other routed clients, whose backends' replies might not come back
// through this node: their connections show the node's address (where
// kube-proxy's no-op detector would leave the pod's), and the start line
// says so and how to change it. The node itself and external clients of
// an externalTrafficPolicy: Local Service keep theirs.
func TestBackendSourceWithoutDetection(t *testing.T) {
	l := NewLab(t)
	l.Backends()
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, sourceManifest())
	d := l.Daemon("--manifests", m, "--min-sync-period", "100ms", "--hostname-override", "node")
	waitFor(t, "web served", func() bool { return l.Curl("client", "http://10.96.0.10/") != "" })
	if line := grepLines(
		d.Output(),
		"Local-traffic detection finds no pod",
	); !strings.Contains(line, "backends see this node's address on the connections of its pods") ||
		!strings.Contains(line, "--cluster-cidr") ||
		!strings.Contains(line, "level=warning") {
		t.Fatalf("the start log does not say what no detection costs:\n%s", tail(d.Output(), 3000))
	}
	seesOnly(t, l, "client", "http://10.96.0.10/", "10.251.19.1", 8)
	seesOnly(t, l, "client", "http://[fd00:96::10]/", "fd00:251::1", 4)
	seesOnly(t, l, "node", "http://10.96.0.10/", "192.168.50.1", 4)
	seesOnly(t, l, "ext", "http://203.0.113.10/", "192.168.50.2", 4) // eTP Local
}
