package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"
)

// difference is one observation on which the two proxies disagree.
type difference struct {
	shape shape
	phase int // 0: as created; 1: after the edit
	key   string
	field string // outcome, endpoints, sticky, sources, health@nodeN
	ours  string
	ref   string
	known string // the reason differential-known.txt gives, or ""
	// failures are the failed tries behind it (ours first), for the report.
	failures []string
	shrunk   *shape
}

// line is the difference as known differences match it: what was seen and
// where, never which seed or case. After an edit the shape is described as
// edited: the policies and endpoints the clients met.
func (df difference) line() string {
	phase, seen := "created", df.shape
	if df.phase == 1 {
		phase, seen = "after "+df.shape.Edit.Kind, df.shape.edited()
	}
	return fmt.Sprintf("%s: ours=%s kube-proxy=%s | %s | %s | %s", df.field, df.ours, df.ref, df.key, phase, seen.describe())
}

// knownDiff is a difference kept on purpose: a pattern over line() and why.
type knownDiff struct {
	pattern string
	reason  string
	re      *regexp.Regexp
}

func readKnownDiffs(path string) ([]knownDiff, error) {
	return readPatterns(path, func(p, r string, re *regexp.Regexp) knownDiff { return knownDiff{p, r, re} })
}

func (d *differ) explain(df difference) string {
	for _, k := range d.known {
		if k.re.MatchString(df.line()) {
			return k.reason
		}
	}
	return ""
}

// compareAll compares every shape's observations.
func (d *differ) compareAll(shapes []shape, ours, ref map[int]*shapeRun) []difference {
	var out []difference
	for _, s := range shapes {
		out = append(out, d.compareShape(s, ours[s.Case], ref[s.Case])...)
	}
	return out
}

func (d *differ) compareShape(s shape, a, b *shapeRun) []difference {
	if a == nil || b == nil {
		return nil
	}
	var out []difference
	add := func(phase int, key, field, ours, ref string) {
		df := difference{shape: s, phase: phase, key: key, field: field, ours: ours, ref: ref}
		df.known = d.explain(df)
		out = append(out, df)
	}
	for phase := 0; phase < 2; phase++ {
		for _, o := range a.phases[phase] {
			r := find(b.phases[phase], o.key())
			if r == nil {
				add(phase, o.key(), "observed", "yes", "no")
				continue
			}
			for _, f := range compareObs(s, o, *r) {
				add(phase, o.key(), f[0], f[1], f[2])
				out[len(out)-1].failures = append(slices.Clone(o.Failures), r.Failures...)
			}
		}
		for i := range a.health[phase] {
			if i < len(b.health[phase]) && a.health[phase][i] != b.health[phase][i] {
				add(phase, fmt.Sprintf("outside → health-check@node%d", i+1), "health", a.health[phase][i], b.health[phase][i])
			}
		}
	}
	return out
}

// compareObs lists the fields on which two observations of one client at
// one target disagree, as {field, ours, kube-proxy}.
func compareObs(s shape, o, r observation) [][3]string {
	var out [][3]string
	if o.Outcome != r.Outcome {
		out = append(out, [3]string{"outcome", o.Outcome, r.Outcome})
		return out // what answered cannot be compared when one did not connect
	}
	if s.Affinity != 0 {
		if o.Sticky != r.Sticky {
			out = append(out, [3]string{"sticky", fmt.Sprint(o.Sticky), fmt.Sprint(r.Sticky)})
		}
	} else if strings.Join(o.Endpoints, ",") != strings.Join(r.Endpoints, ",") {
		out = append(out, [3]string{"endpoints", "[" + strings.Join(o.Endpoints, ",") + "]", "[" + strings.Join(r.Endpoints, ",") + "]"})
	}
	if strings.Join(o.Sources, ",") != strings.Join(r.Sources, ",") {
		out = append(out, [3]string{"sources", "[" + strings.Join(o.Sources, ",") + "]", "[" + strings.Join(r.Sources, ",") + "]"})
	}
	return out
}

func unexplainedOf(diffs []difference) []difference {
	var out []difference
	for _, df := range diffs {
		if df.known == "" {
			out = append(out, df)
		}
	}
	return out
}

// Shrinking's bounds: one shape for each kind of difference (its field and
// what each proxy did), at most shrinkShapes of them, rounds started
// within shrinkBudget; the other shapes are reported as drawn.
const (
	shrinkShapes = 6
	shrinkBudget = 15 * time.Minute
)

// shrinkAll reduces shapes with an unexplained difference to the smallest
// shape that still has one: each round observes every candidate one step
// smaller with the proxy serving now and then with the other, and keeps
// the first candidate that still differs.
func (d *differ) shrinkAll(diffs []difference) {
	current := map[int]shape{} // the original case → its smallest shape so far
	kinds := map[string]bool{}
	for _, df := range unexplainedOf(diffs) {
		kind := df.field + " " + df.ours + " " + df.ref
		if _, ok := current[df.shape.Case]; ok || kinds[kind] || len(current) == shrinkShapes {
			continue
		}
		kinds[kind] = true
		current[df.shape.Case] = df.shape
	}
	deadline := time.Now().Add(shrinkBudget)
	for round := 0; round < 12 && len(current) > 0; round++ {
		if time.Now().After(deadline) {
			fmt.Printf("   shrinking stopped after %s: the shapes are reported as far as they shrank\n", shrinkBudget)
			break
		}
		var cands []shape
		owner := map[int]int{} // candidate case → shape case
		next := 100000 + round*10000
		for c, s := range current {
			for _, cand := range s.smaller() {
				cand.Case = next
				owner[next] = c
				next++
				cands = append(cands, cand)
			}
		}
		if len(cands) == 0 {
			break
		}
		fmt.Printf("   shrinking: round %d, %d candidates for %d shapes\n", round+1, len(cands), len(current))
		first := d.proxy
		runs := map[string]map[int]*shapeRun{}
		for _, p := range []string{first, other(first)} {
			if err := d.serveWith(p); err != nil {
				fmt.Printf("   shrinking stopped: %v\n", err)
				return
			}
			var prior map[int]*shapeRun
			if p == proxyKubeNftables {
				prior = runs[proxyOurs]
			}
			r, err := d.runShapes(cands, 16, prior)
			if err != nil {
				fmt.Printf("   shrinking stopped: %v\n", err)
				return
			}
			runs[p] = r
		}
		progressed := map[int]shape{}
		for _, cand := range cands {
			c := owner[cand.Case]
			if _, done := progressed[c]; done {
				continue
			}
			if len(unexplainedOf(d.compareShape(cand, runs[proxyOurs][cand.Case], runs[proxyKubeNftables][cand.Case]))) > 0 {
				progressed[c] = cand
			}
		}
		for c := range current {
			if s, ok := progressed[c]; ok {
				current[c] = s
			} else {
				d.setShrunk(diffs, c, current[c])
				delete(current, c)
			}
		}
	}
	for c, s := range current {
		d.setShrunk(diffs, c, s)
	}
}

func other(p string) string {
	if p == proxyOurs {
		return proxyKubeNftables
	}
	return proxyOurs
}

// setShrunk records s as the smallest shape found for case c's differences.
func (d *differ) setShrunk(diffs []difference, c int, s shape) {
	for i := range diffs {
		if diffs[i].shape.Case == c {
			sc := s
			diffs[i].shrunk = &sc
		}
	}
}

// report prints each unexplained difference as a reproduction: the
// objects, the client, what each proxy did, and the command that reruns it.
func (d *differ) report(diffs []difference) {
	byCase := map[int][]difference{}
	var order []int
	for _, df := range unexplainedOf(diffs) {
		if _, ok := byCase[df.shape.Case]; !ok {
			order = append(order, df.shape.Case)
		}
		byCase[df.shape.Case] = append(byCase[df.shape.Case], df)
	}
	for _, c := range order {
		dfs := byCase[c]
		s := dfs[0].shape
		fmt.Printf("\n--- difference: seed %d case %d (rerun: make differential SEED=%d CASE=%d)\n", s.Seed, s.Case, s.Seed, s.Case)
		for _, df := range dfs {
			fmt.Printf("    %s\n", df.line())
			for _, f := range df.failures {
				fmt.Printf("        %s\n", f)
			}
		}
		show := s
		if dfs[0].shrunk != nil {
			show = *dfs[0].shrunk
			fmt.Printf("    smallest shape that still differs: %s\n", show.describe())
		}
		if show.Edit != nil {
			fmt.Printf("    then edited: %s\n", show.Edit.Kind)
		}
		fmt.Print(indent(show.yaml(d.view.podIPs), "    "))
	}
}

func indent(s, by string) string {
	var b strings.Builder
	for _, line := range strings.SplitAfter(s, "\n") {
		if line != "" {
			b.WriteString(by + line)
		}
	}
	return b.String()
}

// runOut runs a command and returns its output.
func runOut(name string, args ...string) (string, error) {
	out, err := exec.Command(name, args...).Output()
	return string(out), err
}

// writeDifferentialDocs rewrites the differential's table in
// docs/conformance.md between its markers.
func writeDifferentialDocs(repo string, s diffSummary) error {
	path := filepath.Join(repo, "docs", "conformance.md")
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	const begin, end = "<!-- differential:begin -->", "<!-- differential:end -->"
	doc := string(data)
	i, j := strings.Index(doc, begin), strings.Index(doc, end)
	if i < 0 || j < i {
		return fmt.Errorf("%s has no %s … %s markers", path, begin, end)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s\nLast run: %s, `%s`, %.0f minutes on this 2-core machine.\n\n", begin, s.Date, s.Command, s.Minutes)
	fmt.Fprintf(&b, "| shapes | by type | clients | observations per proxy | differences | explained by differential-known.txt |\n|---|---|---|---|---|---|\n")
	fmt.Fprintf(&b, "| %d | %s | %d | %d | %d | %d |\n", s.Shapes, kindsLine(s.ByKind), s.Clients, s.Observations, s.Differences, s.Explained)
	if len(s.Found) > 0 {
		b.WriteString("\nKnown differences met in this run:\n\n")
		for _, f := range s.Found {
			fmt.Fprintf(&b, "- %s\n", f)
		}
	}
	b.WriteString(end)
	return os.WriteFile(path, []byte(doc[:i]+b.String()+doc[j+len(end):]), 0o644)
}

func kindsLine(m map[string]int) string {
	var parts []string
	for _, k := range sortedKeys(m) {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}
