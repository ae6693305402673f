package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

func resultsPath(conf, proxy string, short bool) string {
	name := proxy + ".json"
	if short {
		// The subset never replaces a full run's record.
		name = proxy + ".short.json"
		return filepath.Join(os.TempDir(), "kup-conformance-"+name)
	}
	return filepath.Join(conf, "results", name)
}

// saveResults records a run. A run of part of the suite (-focus) updates
// the specs it ran in the record of the last full run.
func saveResults(conf string, rr runResults, short, partial bool) error {
	p := resultsPath(conf, rr.Proxy, short)
	if partial && !short {
		old, err := loadResults(conf, rr.Proxy, false)
		if err != nil {
			return err
		}
		if old != nil {
			ran := map[string]result{}
			for _, s := range rr.Specs {
				ran[s.Name] = s
			}
			for i, s := range old.Specs {
				if n, ok := ran[s.Name]; ok {
					old.Specs[i] = n
					delete(ran, s.Name)
				}
			}
			for _, s := range ran {
				old.Specs = append(old.Specs, s)
			}
			sort.Slice(old.Specs, func(i, j int) bool { return old.Specs[i].Name < old.Specs[j].Name })
			old.Date = rr.Date
			rr = *old
		}
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	data, err := json.MarshalIndent(rr, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(p, append(data, '\n'), 0o644)
}

func loadResults(conf, proxy string, short bool) (*runResults, error) {
	data, err := os.ReadFile(resultsPath(conf, proxy, short))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var rr runResults
	if err := json.Unmarshal(data, &rr); err != nil {
		return nil, fmt.Errorf("%s: %w", resultsPath(conf, proxy, short), err)
	}
	return &rr, nil
}

func printSummary(rr runResults) {
	count := map[string]int{}
	for _, s := range rr.Specs {
		count[s.State]++
	}
	fmt.Printf("   %s: %d passed, %d failed, %d skipped\n", rr.Proxy, count["passed"], count["failed"], count["skipped"])
	for _, s := range rr.Specs {
		if s.State == "failed" {
			fmt.Printf("     FAILED %s\n            %s\n", s.Name, s.Reason)
		}
	}
}

// verdicts compares our results with kube-proxy's, writes the table into
// docs/conformance.md (full runs only) and says whether every spec that
// kube-proxy passes here and we fail is a known difference.
func verdicts(repo, conf string, knowns []known, short bool) (bool, error) {
	ours, err := loadResults(conf, proxyOurs, short)
	if err != nil {
		return false, err
	}
	var refs []*runResults
	for _, p := range []string{proxyKubeNftables, proxyKubeIptables} {
		r, err := loadResults(conf, p, false)
		if err != nil {
			return false, err
		}
		refs = append(refs, r)
	}
	if !short {
		full, err := loadResults(conf, proxyOurs, false)
		if err != nil {
			return false, err
		}
		if err := writeTable(repo, full, refs, knowns); err != nil {
			return false, err
		}
	}
	if ours == nil {
		return true, nil
	}
	ok := true
	for _, s := range ours.Specs {
		if s.State != "failed" {
			continue
		}
		refPassed := false
		for _, r := range refs {
			if r != nil && stateOf(r, s.Name) == "passed" {
				refPassed = true
			}
		}
		k, isKnown := knownCause(s.Name, knowns)
		switch {
		case isKnown:
			fmt.Printf("known difference: %s\n  (%s)\n", s.Name, k)
		case refPassed:
			fmt.Printf("REGRESSION: kube-proxy passes, we fail: %s\n  %s\n", s.Name, s.Reason)
			ok = false
		case short:
			// The subset holds only specs that pass here: any failure counts.
			fmt.Printf("FAILED in the subset: %s\n  %s\n", s.Name, s.Reason)
			ok = false
		default:
			fmt.Printf("failed for us and not passed by kube-proxy here: %s\n", s.Name)
		}
	}
	return ok, nil
}

func stateOf(rr *runResults, name string) string {
	for _, s := range rr.Specs {
		if s.Name == name {
			return s.State
		}
	}
	return ""
}

func knownCause(name string, knowns []known) (string, bool) {
	for _, k := range knowns {
		if k.re.MatchString(name) {
			return k.cause, true
		}
	}
	return "", false
}

const (
	tableBegin = "<!-- conformance:begin -->"
	tableEnd   = "<!-- conformance:end -->"
)

// writeTable puts one row per spec into docs/conformance.md between the
// markers: kube-proxy's two modes beside ours, and for each spec that
// kube-proxy passes and we fail, its cause.
func writeTable(repo string, ours *runResults, refs []*runResults, knowns []known) error {
	runs := append([]*runResults{}, refs...)
	runs = append(runs, ours)
	names := map[string]bool{}
	for _, r := range runs {
		if r == nil {
			continue
		}
		for _, s := range r.Specs {
			names[s.Name] = true
		}
	}
	sorted := make([]string, 0, len(names))
	for n := range names {
		sorted = append(sorted, n)
	}
	sort.Strings(sorted)
	var b strings.Builder
	fmt.Fprintf(&b, "%s\n", tableBegin)
	for _, r := range runs {
		if r != nil {
			c := map[string]int{}
			for _, s := range r.Specs {
				c[s.State]++
			}
			fmt.Fprintf(&b, "- **%s**: %d passed, %d failed, %d skipped (`%s`, %s, %d nodes)\n",
				r.Proxy, c["passed"], c["failed"], c["skipped"], r.Command, r.Date, r.Nodes)
		}
	}
	b.WriteString("\n| Spec | kube-proxy nftables | kube-proxy iptables | kube-userspace-proxy | Why we differ |\n|---|---|---|---|---|\n")
	for _, n := range sorted {
		cells := make([]string, len(runs))
		for i, r := range runs {
			cells[i] = "—"
			if r != nil {
				if st := stateOf(r, n); st != "" {
					cells[i] = st
				}
			}
		}
		why := ""
		if cells[2] == "failed" {
			if k, ok := knownCause(n, knowns); ok {
				why = k
			} else if cells[0] == "passed" || cells[1] == "passed" {
				why = "**not known: a regression**"
			}
		}
		if cells[2] == "skipped" && ours != nil {
			for _, s := range ours.Specs {
				if s.Name == n {
					why = s.Reason
				}
			}
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s |\n", strings.ReplaceAll(n, "|", "\\|"), cells[0], cells[1], cells[2], strings.ReplaceAll(why, "|", "\\|"))
	}
	fmt.Fprintf(&b, "%s", tableEnd)
	page := filepath.Join(repo, "docs", "conformance.md")
	old, err := os.ReadFile(page)
	if err != nil {
		return err
	}
	i, j := bytes.Index(old, []byte(tableBegin)), bytes.Index(old, []byte(tableEnd))
	if i < 0 || j < i {
		return fmt.Errorf("%s lacks the %s … %s markers", page, tableBegin, tableEnd)
	}
	out := append(append(append([]byte{}, old[:i]...), b.String()...), old[j+len(tableEnd):]...)
	return os.WriteFile(page, out, 0o644)
}
