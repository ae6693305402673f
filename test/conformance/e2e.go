package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"
)

// result is one spec of one run.
type result struct {
	Name    string  `json:"name"`
	State   string  `json:"state"` // passed, failed, skipped, not run
	Reason  string  `json:"reason,omitempty"`
	Seconds float64 `json:"seconds"`
}

// runResults is what one proxy scored, kept in test/conformance/results
// so the table can be rebuilt when only one proxy is run again.
type runResults struct {
	Proxy   string   `json:"proxy"`
	Date    string   `json:"date"`
	Command string   `json:"command"`
	Nodes   int      `json:"nodes"`
	Focus   string   `json:"focus"`
	Specs   []result `json:"specs"`
}

// ginkgoReport is the part of Ginkgo's JSON report read here.
type ginkgoReport []struct {
	SpecReports []specReport
}

// specReport is one spec's entry in a ginkgoReport.
type specReport struct {
	ContainerHierarchyTexts []string
	LeafNodeText            string
	LeafNodeType            string
	State                   string
	RunTime                 int64
	Failure                 struct{ Message string }
}

// name is the spec's full name, as a focus matches it.
func (s specReport) name() string {
	return strings.TrimSpace(strings.Join(append(append([]string{}, s.ContainerHierarchyTexts...), s.LeafNodeText), " "))
}

// runE2E runs the upstream e2e binary in kupc-net under the Ginkgo CLI
// with procs parallel processes (the [Serial] specs run alone at the end,
// as upstream's jobs run them) and reads its report. An interrupt reaches
// Ginkgo as SIGINT, so the specs run so far are still reported.
func runE2E(ctx context.Context, l *lab, cp *controlPlane, focus string, skips []skip, procs int, log io.Writer) ([]result, error) {
	const report = "e2e-report.json"
	var pats []string
	for _, s := range skips {
		pats = append(pats, s.pattern)
	}
	skipRE := strings.Join(pats, "|")
	if skipRE == "" {
		skipRE = "^$"
	}
	args := []string{"--net=/run/netns/" + netNS, "--", filepath.Join(cp.b.k8s, "ginkgo"),
		fmt.Sprintf("--procs=%d", procs), "--focus", focus, "--skip", skipRE,
		"--json-report", report, "--output-dir", l.dir, "--timeout", "4h", "--no-color", "-v",
		filepath.Join(cp.b.k8s, "e2e.test"), "--",
		"--kubeconfig", cp.kubeconfig, "--kubectl-path", filepath.Join(cp.b.k8s, "kubectl"),
		"--provider", "skeleton", "--allowed-not-ready-nodes", "0", "--dump-logs-on-failure=false",
		fmt.Sprintf("--num-nodes=%d", l.nodes),
	}
	cmd := exec.CommandContext(ctx, "nsenter", args...)
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 2 * time.Minute
	logf, err := os.Create(filepath.Join(l.dir, "logs", "e2e.log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd.Stdout, cmd.Stderr = io.MultiWriter(logf, progress{log, new(bool)}), logf
	cmd.Dir = l.dir
	start := time.Now()
	runErr := cmd.Run()
	fmt.Fprintf(log, "e2e finished in %s (%v); log: %s\n", time.Since(start).Round(time.Second), runErr, logf.Name())
	data, err := os.ReadFile(filepath.Join(l.dir, report))
	if err != nil {
		return nil, fmt.Errorf("e2e wrote no report (%v): %w", runErr, err)
	}
	focusRE, err := regexp.Compile(focus)
	if err != nil {
		return nil, fmt.Errorf("focus: %w", err)
	}
	return parseReport(data, focusRE, skips)
}

// progress passes on only the e2e binary's verdicts, each with the line
// after it (the spec's name).
type progress struct {
	w    io.Writer
	name *bool // the next line names the spec of the verdict just passed on
}

var verdict = regexp.MustCompile(`^(• \[(FAILED|PANICKED)\]|S \[SKIPPED\]|• \[[0-9.]+ seconds\]|Ran \d+ of|FAIL|PASS)`)

func (p progress) Write(b []byte) (int, error) {
	for _, line := range strings.Split(string(b), "\n") {
		switch {
		case verdict.MatchString(line):
			fmt.Fprintln(p.w, "  e2e:", line)
			*p.name = true
		case *p.name && strings.TrimSpace(line) != "":
			fmt.Fprintln(p.w, "       ", strings.TrimSpace(line))
			*p.name = false
		}
	}
	return len(b), nil
}

// parseReport keeps the specs of the focus: those that ran, and those our
// skip list kept from running (with its reason).
func parseReport(data []byte, focus *regexp.Regexp, skips []skip) ([]result, error) {
	var rep ginkgoReport
	if err := json.Unmarshal(data, &rep); err != nil {
		return nil, fmt.Errorf("e2e report: %w", err)
	}
	var out []result
	for _, suite := range rep {
		for _, s := range suite.SpecReports {
			name := s.name()
			r := result{Name: name, State: s.State, Seconds: float64(s.RunTime) / 1e9}
			switch {
			case s.LeafNodeType != "It":
				if s.State == "passed" || s.State == "skipped" {
					continue // suite setup and reporting nodes count only when they fail
				}
				r.Name = s.LeafNodeType + " " + name
			case s.State == "skipped" && s.Failure.Message == "":
				sk, ok := matchSkip(name, skips)
				if !ok || !focus.MatchString(name) {
					continue // outside the focus
				}
				r.Reason = "not run here: " + sk.reason
			}
			if s.Failure.Message != "" && r.Reason == "" {
				r.Reason = firstLine(s.Failure.Message)
			}
			if strings.HasPrefix(r.State, "panicked") || strings.HasPrefix(r.State, "timedout") || r.State == "interrupted" || r.State == "aborted" {
				r.State = "failed"
			}
			out = append(out, r)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	if len(s) > 160 {
		s = s[:157] + "..."
	}
	return s
}

// skip is a spec that cannot run in this lab, and why.
type skip struct {
	pattern string
	reason  string
	re      *regexp.Regexp
}

func matchSkip(name string, skips []skip) (skip, bool) {
	for _, s := range skips {
		if s.re.MatchString(name) {
			return s, true
		}
	}
	return skip{}, false
}

// readSkips reads "regexp<TAB>reason" lines (# comments).
func readSkips(path string) ([]skip, error) {
	return readPatterns(path, func(p, r string, re *regexp.Regexp) skip { return skip{p, r, re} })
}

// known is a spec that kube-proxy passes and we fail, on purpose or
// until an issue fixes it.
type known struct {
	pattern string
	cause   string
	re      *regexp.Regexp
}

func readKnown(path string) ([]known, error) {
	return readPatterns(path, func(p, r string, re *regexp.Regexp) known { return known{p, r, re} })
}

func readPatterns[T any](path string, mk func(pattern, reason string, re *regexp.Regexp) T) ([]T, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var out []T
	for n, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		pat, reason, ok := strings.Cut(line, "\t")
		if !ok || strings.TrimSpace(reason) == "" {
			return nil, fmt.Errorf("%s:%d: want \"regexp<TAB>reason\"", path, n+1)
		}
		re, err := regexp.Compile(pat)
		if err != nil {
			return nil, fmt.Errorf("%s:%d: %w", path, n+1, err)
		}
		out = append(out, mk(pat, strings.TrimSpace(reason), re))
	}
	return out, nil
}
