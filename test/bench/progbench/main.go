// Command progbench measures rule and listener programming: how long the
// daemon takes from an empty manifests directory to serving N service ports
// (ClusterIP Services, and NodePort Services: ClusterIP + NodePort), and how long one Service added or removed at
// N takes, as wall time until a connection through the ClusterIP succeeds
// (or fails, for a removal).
//
// It needs root. It creates its own network namespace, re-runs itself inside
// it, and deletes it at the end (also when interrupted).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

type result struct {
	Type       string  `json:"type"`
	Ports      int     `json:"ports"`
	EmptyToAll float64 `json:"emptyToServingSeconds"`
	AddOne     float64 `json:"addOneSeconds"`
	RemoveOne  float64 `json:"removeOneSeconds"`
}

func main() {
	sizes := flag.String("n", "1000,10000", "comma-separated service port counts")
	daemon := flag.String("daemon", "bin/kube-userspace-proxy", "the daemon binary")
	runs := flag.Int("runs", 3, "runs per size; the median is reported")
	types := flag.String("types", "ClusterIP,NodePort", "comma-separated Service types to measure: ClusterIP (a listener on a port the daemon picks), NodePort (the listener on the NodePort, plus NodePort rules)")
	inner := flag.Bool("inner", false, "internal: already inside the namespace")
	jsonOut := flag.String("json", "", "also write the results as JSON to this file")
	flag.StringVar(&logLevel, "log-level", "info", "the daemon's --log-level (its log goes to $TMPDIR/progbench-N.log)")
	flag.Parse()
	if !*inner {
		os.Exit(outer())
	}
	var results []result
	var spreads []spread
	for _, typ := range strings.Split(*types, ",") {
		typ = strings.TrimSpace(typ)
		if typ != "ClusterIP" && typ != "NodePort" {
			fatal(fmt.Errorf("-types: %q is neither ClusterIP nor NodePort", typ))
		}
		for _, f := range strings.Split(*sizes, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil {
				fatal(err)
			}
			var all []result
			for r := 0; r < *runs; r++ {
				res, err := measure(*daemon, typ, n)
				if err != nil {
					fatal(err)
				}
				fmt.Fprintf(os.Stderr, "%s n=%d run %d: empty→serving %.3fs, add one %.1fms, remove one %.1fms\n",
					typ, n, r+1, res.EmptyToAll, res.AddOne*1000, res.RemoveOne*1000)
				all = append(all, res)
			}
			results = append(results, median(all))
			spreads = append(spreads, spread(all))
		}
	}
	fmt.Printf("| Services | service ports | empty → serving | one Service added | one Service removed |\n|---|---:|---:|---:|---:|\n")
	for i, r := range results {
		sp := spreads[i]
		fmt.Printf("| %s | %d | %.3f s%s | %.1f ms%s | %.1f ms%s |\n", r.Type, r.Ports,
			r.EmptyToAll, sp.show(func(r result) float64 { return r.EmptyToAll }, "%.2f"),
			r.AddOne*1000, sp.show(func(r result) float64 { return r.AddOne * 1000 }, "%.0f"),
			r.RemoveOne*1000, sp.show(func(r result) float64 { return r.RemoveOne * 1000 }, "%.0f"))
	}
	// The targets, met or missed by how much (median at 10 000 service ports).
	for _, r := range results {
		if r.Ports != 10000 {
			continue
		}
		fmt.Printf("\n%s at 10 000: empty → serving %s (target ≤ 1.5 s); one Service added %s (target ≤ 50 ms).\n", r.Type,
			against(r.EmptyToAll, 1.5, "%.2f s"), against(r.AddOne*1000, 50, "%.0f ms"))
	}
	if *jsonOut != "" {
		data, _ := json.MarshalIndent(results, "", "  ")
		if err := os.WriteFile(*jsonOut, data, 0o644); err != nil {
			fatal(err)
		}
	}
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "progbench:", err)
	os.Exit(1)
}

// outer creates the namespace, runs itself inside and removes it.
func outer() int {
	ns := fmt.Sprintf("kupbench-%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "progbench: ip netns add (needs root): %v %s\n", err, out)
		return 1
	}
	defer exec.Command("ip", "netns", "del", ns).Run()
	for _, args := range [][]string{
		{"ip", "link", "set", "lo", "up"},
		// A veth pair inside the namespace gives the node an address and a
		// default route (service addresses must be routable before OUTPUT
		// rewrites them); no traffic leaves the namespace.
		{"ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth1"},
		{"ip", "addr", "add", "10.250.0.1/24", "dev", "eth0"},
		{"ip", "link", "set", "eth0", "up"},
		{"ip", "link", "set", "eth1", "up"},
		{"ip", "route", "add", "default", "via", "10.250.0.2"},
		// Service addresses are local: before its rule exists a ClusterIP
		// refuses at once instead of timing out, so polling is precise.
		{"ip", "route", "add", "local", "10.96.0.0/16", "dev", "lo"},
	} {
		if out, err := exec.Command("ip", append([]string{"netns", "exec", ns}, args...)...).CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "progbench: %v: %v %s\n", args, err, out)
			return 1
		}
	}
	self, _ := os.Executable()
	cmd := exec.Command("ip", append([]string{"netns", "exec", ns, self, "-inner"}, os.Args[1:]...)...)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "progbench:", err)
		return 1
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			return 1
		}
		return 0
	case <-sig:
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
		return 130
	}
}

func svcYAML(typ string, i int) string {
	spec := fmt.Sprintf("{clusterIP: %s, ports: [{port: 80}]}", clusterIP(i))
	if typ == "NodePort" {
		spec = fmt.Sprintf("{type: NodePort, clusterIP: %s, ports: [{port: 80, nodePort: %d}]}", clusterIP(i), 10000+i)
	}
	return fmt.Sprintf(`---
apiVersion: v1
kind: Service
metadata: {name: s%[1]d, namespace: bench}
spec: %[2]s
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: s%[1]d, namespace: bench, labels: {kubernetes.io/service-name: s%[1]d}}
addressType: IPv4
ports: [{port: 9000}]
endpoints: [{addresses: [127.0.0.1]}]
`, i, spec)
}

func clusterIP(i int) string { return fmt.Sprintf("10.96.%d.%d", i/250, i%250+1) }

func writeAtomic(path, content string) error {
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// reachable tries one connection through a ClusterIP.
func reachable(ip string) bool {
	c, err := net.DialTimeout("tcp4", ip+":80", time.Second)
	if err != nil {
		return false
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(time.Second))
	buf := make([]byte, 2)
	n, _ := c.Read(buf)
	return n == 2 && string(buf) == "ok"
}

func waitUntil(deadline time.Duration, cond func() bool) (time.Duration, error) {
	start := time.Now()
	for !cond() {
		if time.Since(start) > deadline {
			return 0, fmt.Errorf("not reached within %s", deadline)
		}
		time.Sleep(time.Millisecond)
	}
	return time.Since(start), nil
}

// logLevel of the daemon under test; debug logs every sync's timing.
var logLevel = "info"

func measure(daemon, typ string, n int) (result, error) {
	res := result{Type: typ, Ports: n}
	// The backend every endpoint points at.
	ln, err := net.Listen("tcp4", "127.0.0.1:9000")
	if err != nil {
		return res, err
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte("ok"))
			c.Close()
		}
	}()

	dir, err := os.MkdirTemp("", "progbench")
	if err != nil {
		return res, err
	}
	defer os.RemoveAll(dir)
	var bulk strings.Builder
	for i := 0; i < n; i++ {
		bulk.WriteString(svcYAML(typ, i))
	}
	if err := writeAtomic(filepath.Join(dir, "extra.yaml"), "# nothing yet\n"); err != nil {
		return res, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	logf, _ := os.Create(filepath.Join(dir, "..", fmt.Sprintf("progbench-%d.log", n)))
	defer logf.Close()
	cmd := exec.CommandContext(ctx, daemon, "--manifests", dir, "--min-sync-period", "0", "--log-level", logLevel)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return res, err
	}
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
		_ = exec.Command(daemon, "--cleanup").Run()
	}()
	time.Sleep(500 * time.Millisecond) // let it start on the empty directory

	start := time.Now()
	if err := writeAtomic(filepath.Join(dir, "bulk.yaml"), bulk.String()); err != nil {
		return res, err
	}
	// Serving: the last, the middle and the first service answer.
	for _, i := range []int{n - 1, n / 2, 0} {
		if _, err := waitUntil(120*time.Second, func() bool { return reachable(clusterIP(i)) }); err != nil {
			return res, fmt.Errorf("n=%d: service %d: %w", n, i, err)
		}
	}
	res.EmptyToAll = time.Since(start).Seconds()
	time.Sleep(1200 * time.Millisecond) // out of the burst window

	// One more Service, in its own file.
	start = time.Now()
	if err := writeAtomic(filepath.Join(dir, "extra.yaml"), svcYAML(typ, n)); err != nil {
		return res, err
	}
	if _, err := waitUntil(60*time.Second, func() bool { return reachable(clusterIP(n)) }); err != nil {
		return res, fmt.Errorf("added service: %w", err)
	}
	res.AddOne = time.Since(start).Seconds()
	time.Sleep(1200 * time.Millisecond)

	// And removed again.
	start = time.Now()
	if err := writeAtomic(filepath.Join(dir, "extra.yaml"), "# removed\n"); err != nil {
		return res, err
	}
	if _, err := waitUntil(60*time.Second, func() bool { return !reachable(clusterIP(n)) }); err != nil {
		return res, fmt.Errorf("removed service: %w", err)
	}
	res.RemoveOne = time.Since(start).Seconds()
	return res, nil
}

// spread is the runs of one figure set, for their min–max.
type spread []result

// show prints " (min–max)" of f over the runs, or nothing for one run.
func (s spread) show(f func(result) float64, format string) string {
	if len(s) < 2 {
		return ""
	}
	lo, hi := f(s[0]), f(s[0])
	for _, r := range s[1:] {
		lo, hi = min(lo, f(r)), max(hi, f(r))
	}
	return " (" + fmt.Sprintf(format, lo) + "–" + fmt.Sprintf(format, hi) + ")"
}

// against says whether v meets target (at most), or by how much it misses.
func against(v, target float64, format string) string {
	if v <= target {
		return fmt.Sprintf(format+": met", v)
	}
	return fmt.Sprintf(format+": missed by "+format, v, v-target)
}

func median(rs []result) result {
	pick := func(f func(result) float64) float64 {
		v := make([]float64, len(rs))
		for i, r := range rs {
			v[i] = f(r)
		}
		sort.Float64s(v)
		return v[len(v)/2]
	}
	return result{
		Type:       rs[0].Type,
		Ports:      rs[0].Ports,
		EmptyToAll: pick(func(r result) float64 { return r.EmptyToAll }),
		AddOne:     pick(func(r result) float64 { return r.AddOne }),
		RemoveOne:  pick(func(r result) float64 { return r.RemoveOne }),
	}
}
