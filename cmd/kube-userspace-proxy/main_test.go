package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/internal/daemon"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

// TestMain lets tests run the real binary: the test executable re-runs
// itself as the daemon when KUP_RUN_MAIN is set.
func TestMain(m *testing.M) {
	if os.Getenv("KUP_RUN_MAIN") == "1" {
		if n, err := strconv.ParseUint(os.Getenv("KUP_NOFILE"), 10, 64); err == nil {
			// Lower the hard limit too, so that the daemon cannot raise it.
			lim := syscall.Rlimit{Cur: n, Max: n}
			if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
				panic(err)
			}
		}
		os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

func daemonCmd(args ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), "KUP_RUN_MAIN=1")
	return cmd
}

func TestBadFlagsExit2(t *testing.T) {
	badConfig := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(badConfig, []byte("kind: KubeProxyConfiguration\nmdoe: ipvs\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"--bogus"},
		{},
		{"--manifests", "x.yaml", "--bind-address", "not-an-ip"},
		{"--manifests", "x.yaml", "--proxy-port-range", "9-1"},
		{"--manifests", "x.yaml", "--udp-timeout", "-1s"},
		{"--manifests", "x.yaml", "--log-format", "xml"},
		{"--manifests", "x.yaml", "--log-level", "loud"},
		{"--manifests", "x.yaml", "--scheduling-policy", "fifo"},
		{"--manifests", "x.yaml", "stray"},
		{"--manifests", "x.yaml", "--outlier-consecutive-failures", "-1"},
		{"--manifests", "x.yaml", "--bind-address", "192.0.2.77"}, // not an address of this node
		{"--manifests", "x.yaml", "--outlier-base-ejection-time", "0s"},
		{"--manifests", "x.yaml", "--outlier-max-ejection-time", "1s"}, // below the base (30s)
		{"--kubeconfig", "/nonexistent"},                               // cannot be loaded
		{"--manifests", "x.yaml", "--master", "https://127.0.0.1:1"},
		{"--config", badConfig}, // a field kube-proxy's configuration does not have
	} {
		var stderr bytes.Buffer
		if code := run(args, &bytes.Buffer{}, &stderr); code != daemon.ExitUsage {
			t.Errorf("%v: exit %d, want %d (stderr %q)", args, code, daemon.ExitUsage, stderr.String())
		}
		if stderr.Len() == 0 {
			t.Errorf("%v: no message", args)
		}
	}
	if code := run([]string{"--help"}, &bytes.Buffer{}, &bytes.Buffer{}); code != 0 {
		t.Errorf("--help: exit %d", code)
	}
}

func TestInvalidManifestsAtStartExit1(t *testing.T) {
	f := filepath.Join(t.TempDir(), "bad.yaml")
	os.WriteFile(f, []byte("apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.0.0.1, ports: [{port: 80}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: b}\nspec: {clusterIP: nope, ports: [{port: 80}]}\n"), 0o644)
	var stderr bytes.Buffer
	if code := run([]string{"--manifests", f}, &bytes.Buffer{}, &stderr); code != daemon.ExitFailure {
		t.Fatalf("exit %d, want %d", code, daemon.ExitFailure)
	}
	for _, want := range []string{f, "document 2", "Service default/b", `spec.clusterIP: \"nope\" is not an IP address`} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("message %q lacks %q", stderr.String(), want)
		}
	}
}

func TestSIGTERMStopsCleanly(t *testing.T) {
	backend, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer backend.Close()
	f := filepath.Join(t.TempDir(), "m.yaml")
	os.WriteFile(f, []byte(fmt.Sprintf("apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.0.0.1, ports: [{port: 80}]}\n---\n"+
		"apiVersion: v1\nkind: Endpoints\nmetadata: {name: a}\nsubsets: [{addresses: [{ip: 127.0.0.1}], ports: [{port: %d}]}]\n", backend.Addr().(*net.TCPAddr).Port)), 0o644)
	// --iptables=false: this test runs in the root namespace, whose rules
	// and settings are not ours (the reserved ports included: checked below).
	const reservedFile = "/proc/sys/net/ipv4/ip_local_reserved_ports"
	reservedBefore, _ := os.ReadFile(reservedFile)
	cmd := daemonCmd(
		"--manifests",
		f,
		"--bind-address",
		"127.0.0.1",
		"--iptables=false",
		"--shutdown-grace",
		"200ms",
		"--healthz-bind-address",
		"127.0.0.1:0",
		"--metrics-bind-address",
		"127.0.0.1:0",
	)
	var stderr testutil.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	var port string
	deadline := time.Now().Add(10 * time.Second)
	for port == "" {
		if time.Now().After(deadline) {
			t.Fatalf("daemon never listened: %s", stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
		if _, rest, ok := strings.Cut(stderr.String(), "msg=Listening"); ok {
			if _, p, ok := strings.Cut(rest, "listen="); ok {
				port = strings.Fields(p)[0]
			}
		}
	}
	c, err := net.Dial("tcp", "127.0.0.1:"+port)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("exit after SIGTERM: %v\n%s", err, stderr.String())
	}
	if _, err := net.Dial("tcp", "127.0.0.1:"+port); err == nil {
		t.Fatal("listener still open after exit")
	}
	if after, _ := os.ReadFile(reservedFile); string(after) != string(reservedBefore) {
		t.Fatalf("--iptables=false changed %s: %q → %q", reservedFile, reservedBefore, after)
	}
}

// Running out of descriptors must make the daemon back off and recover, not
// panic (the classic proxier's choice) or spin. The daemon runs with 48
// descriptors; the test holds connections until the daemon is at its limit:
// its descriptor budget resets the next connections at accept (or, should
// the budget not keep it off, accept fails with EMFILE and backs off).
func TestRecoversFromFileLimit(t *testing.T) {
	backend, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer backend.Close()
	// The backend greets, then holds the connection until the client's FIN
	// arrives, as servers do. (One that never closed would keep every pair
	// whose client left before the greeting reached it: the client's reset
	// then lands on a socket the proxy no longer reads.)
	var mu sync.Mutex
	held := map[net.Conn]bool{}
	go func() {
		for {
			c, err := backend.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held[c] = true
			mu.Unlock()
			go func() {
				c.Write([]byte("ok"))
				io.Copy(io.Discard, c)
				c.Close()
				mu.Lock()
				delete(held, c)
				mu.Unlock()
			}()
		}
	}()
	defer func() {
		mu.Lock()
		for c := range held {
			c.Close()
		}
		mu.Unlock()
	}()
	f := filepath.Join(t.TempDir(), "m.yaml")
	os.WriteFile(f, []byte(fmt.Sprintf("apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.0.0.1, ports: [{port: 80}]}\n---\n"+
		"apiVersion: v1\nkind: Endpoints\nmetadata: {name: a}\nsubsets: [{addresses: [{ip: 127.0.0.1}], ports: [{port: %d}]}]\n", backend.Addr().(*net.TCPAddr).Port)), 0o644)
	cmd := daemonCmd(
		"--manifests",
		f,
		"--bind-address",
		"127.0.0.1",
		"--iptables=false",
		"--shutdown-grace",
		"200ms",
		"--log-level",
		"debug",
		"--healthz-bind-address",
		"127.0.0.1:0",
		"--metrics-bind-address",
		"127.0.0.1:0",
	)
	cmd.Env = append(cmd.Env, "KUP_NOFILE=48")
	var stderr testutil.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Signal(syscall.SIGTERM); cmd.Wait() }()
	port := waitListening(t, &stderr)
	addr := "127.0.0.1:" + port

	var clients []net.Conn
	defer func() {
		for _, c := range clients {
			c.Close()
		}
	}()
	deadline := time.Now().Add(20 * time.Second)
	atLimit := func() bool {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			return false
		}
		clients = append(clients, c)
		c.SetReadDeadline(time.Now().Add(2 * time.Second))
		buf := make([]byte, 2)
		_, err = io.ReadFull(c, buf)
		return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, io.EOF)
	}
	for !atLimit() && !strings.Contains(stderr.String(), "too many open files") {
		if time.Now().After(deadline) {
			t.Fatalf("the daemon never reached its descriptor limit:\n%s", stderr.String())
		}
	}
	for _, c := range clients {
		c.Close()
	}
	clients = nil
	// Recovered: new connections are proxied again.
	deadline = time.Now().Add(20 * time.Second)
	for {
		if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			c.SetDeadline(time.Now().Add(2 * time.Second))
			buf := make([]byte, 2)
			n, _ := c.Read(buf)
			c.Close()
			if string(buf[:n]) == "ok" {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no recovery:\n%s", stderr.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if cmd.ProcessState != nil {
		t.Fatalf("the daemon exited:\n%s", stderr.String())
	}
}

// waitListening waits for the daemon's first listener and returns its port.
func waitListening(t *testing.T, stderr *testutil.Buffer) string {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, rest, ok := strings.Cut(stderr.String(), "msg=Listening"); ok {
			if _, p, ok := strings.Cut(rest, "listen="); ok {
				return strings.Fields(p)[0]
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("daemon never listened: %s", stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// --scheduling-policy batch puts every thread of the daemon under SCHED_BATCH.
func TestSchedulingPolicyBatch(t *testing.T) {
	f := filepath.Join(t.TempDir(), "m.yaml")
	os.WriteFile(f, []byte("apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.0.0.1, ports: [{port: 80}]}\n"), 0o644)
	// --iptables=false: this test runs in the root namespace, whose rules are not ours.
	cmd := daemonCmd("--manifests", f, "--bind-address", "127.0.0.1", "--iptables=false", "--scheduling-policy", "batch",
		"--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0")
	var stderr testutil.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(stderr.String(), "msg=Listening") {
		if time.Now().After(deadline) {
			t.Fatalf("daemon never listened: %s", stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !strings.Contains(stderr.String(), "Scheduling policy batch") {
		t.Fatalf("no log line about the policy: %s", stderr.String())
	}
	dir := fmt.Sprintf("/proc/%d/task", cmd.Process.Pid)
	tasks, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		stat, err := os.ReadFile(filepath.Join(dir, task.Name(), "stat"))
		if err != nil {
			continue // exited
		}
		// Field 41 is the policy; fields are counted after the ")" that ends the name.
		_, rest, _ := strings.Cut(string(stat), ") ")
		fields := strings.Fields(rest)
		if policy := fields[41-3]; policy != "3" {
			t.Errorf("thread %s has policy %s, want 3 (SCHED_BATCH)", task.Name(), policy)
		}
	}
}
