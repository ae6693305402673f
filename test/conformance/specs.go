package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
)

// The lab's e2e binary is upstream's suite with only the network specs
// compiled in (build/k8s/e2enet). upstreamSpecsFile lists the specs that
// upstream's whole binary selects for fullFocus; every run checks, before
// it builds a cluster, that the lab's binary selects exactly these, so a
// Kubernetes upgrade that moves a network spec to a package the lab's
// binary does not import fails loudly instead of testing less.
const upstreamSpecsFile = "upstream-specs.txt"

// listSpecs returns the names of the specs binary (a Kubernetes e2e test
// binary) would run for focus, from a Ginkgo dry run (no cluster needed).
func listSpecs(binary, focus string) ([]string, error) {
	dir, err := os.MkdirTemp("", "kup-specs-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	report := filepath.Join(dir, "report.json")
	cmd := exec.Command(binary, "--ginkgo.dry-run", "--ginkgo.focus", focus, "--ginkgo.json-report", report,
		"--ginkgo.no-color", "--provider", "skeleton")
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("listing the specs of %s: %w\n%s", binary, err, lastLines(string(out), 20))
	}
	data, err := os.ReadFile(report)
	if err != nil {
		return nil, err
	}
	var rep ginkgoReport
	if err := json.Unmarshal(data, &rep); err != nil {
		return nil, fmt.Errorf("the dry run's report: %w", err)
	}
	var names []string
	for _, suite := range rep {
		for _, s := range suite.SpecReports {
			if s.LeafNodeType != "It" || s.State != "passed" { // a dry run passes what it would run
				continue
			}
			names = append(names, s.name())
		}
	}
	sort.Strings(names)
	return names, nil
}

// checkSpecSet fails when the lab's e2e binary selects other specs for
// fullFocus than upstream's whole binary does (upstreamSpecsFile).
func checkSpecSet(conf, binary string) error {
	data, err := os.ReadFile(filepath.Join(conf, upstreamSpecsFile))
	if err != nil {
		return err
	}
	got, err := listSpecs(binary, fullFocus)
	if err != nil {
		return err
	}
	if diff := specSetDiff(readSpecList(string(data)), got); len(diff) > 0 {
		return fmt.Errorf("the lab's e2e binary (build/k8s/e2enet) and upstream's select different specs for the focus "+
			"(import the package that holds them in e2enet, or, after a Kubernetes upgrade, run make conformance-specs):\n  %s",
			strings.Join(diff, "\n  "))
	}
	return nil
}

// readSpecList returns the spec names of an upstreamSpecsFile's text.
func readSpecList(text string) []string {
	var names []string
	for _, line := range strings.Split(text, "\n") {
		if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "#") {
			names = append(names, line)
		}
	}
	return names
}

// specSetDiff says, sorted, which specs are only in want (upstream's) and
// which only in got (the lab's binary); nil when the sets are equal.
func specSetDiff(want, got []string) []string {
	in := map[string]int{}
	for _, n := range want {
		in[n] |= 1
	}
	for _, n := range got {
		in[n] |= 2
	}
	var diff []string
	for n, where := range in {
		switch where {
		case 1:
			diff = append(diff, "missing from the lab's binary: "+n)
		case 2:
			diff = append(diff, "only in the lab's binary: "+n)
		}
	}
	sort.Strings(diff)
	return diff
}

// writeUpstreamSpecs writes the specs upstream's whole e2e binary selects
// for fullFocus to upstreamSpecsFile. With binary "" it builds that binary
// first (not cached: only a Kubernetes upgrade needs it, ~15 minutes on two
// cores).
func writeUpstreamSpecs(repo, binary string) error {
	if binary == "" {
		dir, err := os.MkdirTemp("", "kup-upstream-e2e-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		binary = filepath.Join(dir, "e2e.test")
		fmt.Fprintln(os.Stderr, "building upstream's whole e2e binary (k8s.io/kubernetes/test/e2e)")
		mod := filepath.Join(repo, "test", "conformance", "build", "k8s")
		if err := goBuild(mod, "test", "-c", "-o", binary, "k8s.io/kubernetes/test/e2e"); err != nil {
			return err
		}
	}
	names, err := listSpecs(binary, fullFocus)
	if err != nil {
		return err
	}
	var b strings.Builder
	b.WriteString("# The specs upstream's whole e2e binary (k8s.io/kubernetes/test/e2e, the version in build/k8s/go.mod)\n")
	b.WriteString("# selects for the conformance lab's focus. Every run checks that the lab's own binary, built with only\n")
	b.WriteString("# the network specs (build/k8s/e2enet), selects these. Written by make conformance-specs; do not edit.\n")
	b.WriteString("# focus: " + fullFocus + "\n")
	for _, n := range names {
		b.WriteString(n + "\n")
	}
	path := filepath.Join(repo, "test", "conformance", upstreamSpecsFile)
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		return err
	}
	fmt.Printf("%d specs written to %s\n", len(names), path)
	return nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
