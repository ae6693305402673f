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
	out, err := n.run(pinned(clientCPU, []string{filepath.Join(n.b.o.bin, "loadgen"), "-mode", "cps", "-addr", addr,
		"-d", fmt.Sprintf("%ds", n.b.o.taxDur), "-c", "32"})...)
	if err != nil {
		return 0, err
	}
	var r struct {
		PerSecond float64 `json:"perSecond"`
		Errors    int64   `json:"errors"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		return 0, fmt.Errorf("loadgen's answer: %w", err)
	}
	if r.PerSecond <= 0 {
		return 0, fmt.Errorf("loadgen to %s: no connection made (%d errors)", addr, r.Errors)
	}
	return r.PerSecond, nil
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
	var through []float64
	for range b.o.taxRuns {
		v, err := n.cps(taxTargetIP + ":80")
		if err != nil {
			return fmt.Errorf("new connections through a ClusterIP, %s: %w", n.proxy, err)
		}
		through = append(through, v)
	}
	b.record(fmt.Sprintf("node tax at %d Services: new connections/s through a ClusterIP", b.o.n), spread(through, ""))
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
