package iptables

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestRulesetSame(t *testing.T) {
	base := func() *Ruleset {
		return &Ruleset{
			Nat:    map[string][]string{"KUP-A": {"r1", "r2", "r3"}, "KUP-B": {}},
			Filter: map[string][]string{"KUP-F": {"f1"}},
		}
	}
	for _, tc := range []struct {
		name string
		edit func(*Ruleset)
		same bool
	}{
		{"identical", func(*Ruleset) {}, true},
		{"another order", func(rs *Ruleset) { rs.Nat["KUP-A"] = []string{"r3", "r1", "r2"} }, true},
		{"an empty chain read as nil", func(rs *Ruleset) { rs.Nat["KUP-B"] = nil }, true},
		{"a rule missing", func(rs *Ruleset) { rs.Nat["KUP-A"] = []string{"r1", "r2"} }, false},
		{"a rule changed", func(rs *Ruleset) { rs.Nat["KUP-A"] = []string{"r1", "r2", "rX"} }, false},
		{"a rule added", func(rs *Ruleset) { rs.Nat["KUP-A"] = append(rs.Nat["KUP-A"], "r4") }, false},
		{"a chain missing", func(rs *Ruleset) { delete(rs.Nat, "KUP-B") }, false},
		{"a chain added", func(rs *Ruleset) { rs.Filter["KUP-G"] = nil }, false},
		{"a chain renamed", func(rs *Ruleset) { rs.Filter["KUP-G"] = rs.Filter["KUP-F"]; delete(rs.Filter, "KUP-F") }, false},
		{"a rule in the other table", func(rs *Ruleset) { rs.Filter["KUP-F"] = []string{"r1"} }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			live := base()
			tc.edit(live)
			if got := live.Same(base()); got != tc.same {
				t.Errorf("live.Same(want) = %v, want %v", got, tc.same)
			}
			if got := base().Same(live); got != tc.same {
				t.Errorf("want.Same(live) = %v, want %v", got, tc.same)
			}
		})
	}
}

// TestCheckDumpRunsNiced: the periodic check's iptables-save runs at a low
// CPU priority, a rule write's own read at the normal one.
func TestCheckDumpRunsNiced(t *testing.T) {
	dir := t.TempDir()
	save := filepath.Join(dir, "save")
	// The priority is set just after the process starts: wait (up to 10 s)
	// for it when asked to, then print it.
	script := "#!/bin/sh\nif [ \"$WAIT_FOR_NICE\" = 1 ]; then i=0; while [ \"$(nice)\" = 0 ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i+1)); done; fi\necho \"# nice $(nice)\"\n"
	if err := os.WriteFile(save, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	f := &family{fam: 4, save: save}
	t.Setenv("WAIT_FOR_NICE", "1")
	out, err := f.dump("nat", true)
	if err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(out) != "# nice 10" {
		t.Errorf("background dump printed %q, want %q", out, "# nice 10")
	}
	t.Setenv("WAIT_FOR_NICE", "0")
	if out, err = f.dump("nat", false); err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(out) != "# nice 0" {
		t.Errorf("foreground dump printed %q, want %q", out, "# nice 0")
	}
}
