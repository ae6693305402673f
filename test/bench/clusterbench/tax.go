package main

// The node tax at scale, as make bench-tax measures it: what a proxy's
// rules for every Service cost the node's own traffic that is no Service's
// (loopback TCP throughput, ping-pong latency, new connections/s to a
// local port), and new connections/s through a ClusterIP. Each figure in
// the proxy's node is read against the same figure in a bare namespace
// without any rules, interleaved run by run; servers and the proxy run on
// the first CPU, clients on the last.

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// taxTarget is the Service the ClusterIP figure goes through: its one
// endpoint is backend A.
const taxTarget, taxTargetIP = "tax-target", "10.96.199.1"

// startTaxServers starts the node's own servers on loopback: iperf3,
// sockperf and an HTTP server that is no Service's endpoint.
func (n *node) startTaxServers() error {
	if !n.b.o.tax {
		return nil
	}
	for _, args := range [][]string{
		{"iperf3", "-s", "-B", "127.0.0.1", "-p", "5201"},
		{"sockperf", "server", "-i", "127.0.0.1", "-p", "11111", "--tcp"},
		{filepath.Join(n.b.o.bin, "backend"), "--name", "local", "--tcp", "127.0.0.1:8090", "--udp", ""},
	} {
		if _, err := n.start(nil, pinned(serverCPU, args)...); err != nil {
			return err
		}
	}
	for _, port := range []string{"5201", "11111", "8090"} {
		if err := n.b.until(n.b.ctx, 10*time.Second, func() bool { return n.accepts("127.0.0.1:" + port) }); err != nil {
			return fmt.Errorf("node %s: server on 127.0.0.1:%s not up: %w", n.ns, port, err)
		}
	}
	return nil
}

// taxFigure is one figure of the node tax: how it is read in a namespace,
// and whether more is better.
type taxFigure struct {
	label  string
	unit   string
	higher bool
	read   func(n *node) (float64, error)
}

var taxFigures = []taxFigure{
	{"loopback TCP throughput (iperf3)", "Gbit/s", true, func(n *node) (float64, error) {
		out, err := n.run(pinned(clientCPU, []string{"iperf3", "-c", "127.0.0.1", "-p", "5201", "-t", strconv.Itoa(n.b.o.taxDur), "-J"})...)
		if err != nil {
			return 0, err
		}
		var r struct {
			End struct {
				SumReceived struct {
					BitsPerSecond float64 `json:"bits_per_second"`
				} `json:"sum_received"`
			} `json:"end"`
		}
		if err := json.Unmarshal([]byte(out), &r); err != nil {
			return 0, fmt.Errorf("iperf3's answer: %w", err)
		}
		return r.End.SumReceived.BitsPerSecond / 1e9, nil
	}},
	{"loopback TCP ping-pong, median (sockperf)", "µs", false, func(n *node) (float64, error) {
		out, err := n.run(pinned(clientCPU, []string{"sockperf", "ping-pong", "-i", "127.0.0.1", "-p", "11111", "--tcp", "-t", strconv.Itoa(n.b.o.taxDur)})...)
		if err != nil {
			return 0, err
		}
		for _, l := range strings.Split(out, "\n") {
			if strings.Contains(l, "percentile 50.000") {
				f := strings.Fields(l)
				return strconv.ParseFloat(f[len(f)-1], 64)
			}
		}
		return 0, fmt.Errorf("no median in sockperf's answer: %s", out)
	}},
	{"new connections/s to a local port that is no Service's", "/s", true, func(n *node) (float64, error) {
		return n.cps("127.0.0.1:8090")
	}},
}

// cps is loadgen's new connections/s to addr, from the clients' CPU.
func (n *node) cps(addr string) (float64, error) {
	perSecond, _, err := n.cpsCount(addr)
	return perSecond, err
}

// cpsCount is cps and how many connections it made.
func (n *node) cpsCount(addr string) (float64, int64, error) {
	out, err := n.run(pinned(clientCPU, []string{filepath.Join(n.b.o.bin, "loadgen"), "-mode", "cps", "-addr", addr,
		"-d", fmt.Sprintf("%ds", n.b.o.taxDur), "-c", "32"})...)
	if err != nil {
		return 0, 0, err
	}
	var r struct {
		PerSecond float64 `json:"perSecond"`
		Count     int64   `json:"count"`
		Errors    int64   `json:"errors"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		return 0, 0, fmt.Errorf("loadgen's answer: %w", err)
	}
	if r.PerSecond <= 0 || r.Count <= 0 {
		return 0, 0, fmt.Errorf("loadgen to %s: no connection made (%d errors)", addr, r.Errors)
	}
	return r.PerSecond, r.Count, nil
}

// machineCPU is the machine's CPU time so far (/proc/stat, every CPU), in
// seconds: busy (everything but idle, iowait and steal) and the softirq
// part of it.
func machineCPU() (busy, softirq float64, err error) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, err
	}
	line, _, _ := strings.Cut(string(data), "\n")
	f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal ...
	if len(f) < 9 || f[0] != "cpu" {
		return 0, 0, fmt.Errorf("/proc/stat's first line: %q", line)
	}
	var v [8]float64
	for i := range v {
		if v[i], err = strconv.ParseFloat(f[i+1], 64); err != nil {
			return 0, 0, fmt.Errorf("/proc/stat's first line: %q: %w", line, err)
		}
	}
	const hz = 100 // USER_HZ
	return (v[0] + v[1] + v[2] + v[5] + v[6]) / hz, v[6] / hz, nil
}

// measureTax records the node tax of n's proxy (pinned to the servers'
// CPU for it) against the bare namespace.
func (b *bench) measureTax(n *node, p *proc) error {
	if _, err := n.run("taskset", "-a", "-p", "-c", strconv.Itoa(serverCPU), strconv.Itoa(p.cmd.Process.Pid)); err != nil {
		return err
	}
	for _, f := range taxFigures {
		var bare, with []float64
		for range b.o.taxRuns {
			v, err := f.read(b.bare)
			if err != nil {
				return fmt.Errorf("%s, bare namespace: %w", f.label, err)
			}
			bare = append(bare, v)
			if v, err = f.read(n); err != nil {
				return fmt.Errorf("%s, %s: %w", f.label, n.proxy, err)
			}
			with = append(with, v)
		}
		base := median(bare)
		if base <= 0 {
			return fmt.Errorf("%s, bare namespace: %v", f.label, bare)
		}
		lo, hi := slices.Min(with)/base, slices.Max(with)/base
		b.record(fmt.Sprintf("node tax at %d Services: %s, with the rules ÷ without (the bare figure)", b.o.n, f.label),
			fmt.Sprintf("%.2f× (%.2f–%.2f×; %s %s)", median(with)/base, lo, hi, num(base), f.unit))
	}
	// The CPU a connection through the ClusterIP costs the machine, both
	// CPUs (client, backend, the kernel's NAT or our daemon): for kube-proxy
	// the work is the kernel's, softirq and the client's system time; for
	// ours the daemon's process time besides the kernel's.
	var through, machine, softirq, daemon []float64
	for range b.o.taxRuns {
		busy0, soft0, err := machineCPU()
		if err != nil {
			return err
		}
		proc0 := p.cpu()
		v, count, err := n.cpsCount(taxTargetIP + ":80")
		if err != nil {
			return fmt.Errorf("new connections through a ClusterIP, %s: %w", n.proxy, err)
		}
		busy1, soft1, err := machineCPU()
		if err != nil {
			return err
		}
		perConn := func(s float64) float64 { return s / float64(count) * 1e6 }
		through = append(through, v)
		machine = append(machine, perConn(busy1-busy0))
		softirq = append(softirq, perConn(soft1-soft0))
		daemon = append(daemon, perConn(p.cpu()-proc0))
	}
	b.record(fmt.Sprintf("node tax at %d Services: new connections/s through a ClusterIP", b.o.n), spread(through, ""))
	b.record(fmt.Sprintf("node tax at %d Services: CPU per connection through a ClusterIP, the whole machine (client, backend, kernel, proxy)", b.o.n), spread(machine, " µs"))
	b.record(fmt.Sprintf("node tax at %d Services: of which softirq (the kernel's packet work, kube-proxy's NAT)", b.o.n), spread(softirq, " µs"))
	b.record(fmt.Sprintf("node tax at %d Services: of which the proxy's process", b.o.n), spread(daemon, " µs"))
	return nil
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// spread is "median (min–max)".
func spread(v []float64, unit string) string {
	return fmt.Sprintf("%s (%s–%s)%s", num(median(v)), num(slices.Min(v)), num(slices.Max(v)), unit)
}

func num(v float64) string {
	switch {
	case v >= 1000:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	default:
		return fmt.Sprintf("%.2f", v)
	}
}
