package main

import (
	"strings"
	"testing"
)

func TestTableKeepsTheColumnsARunDidNotMeasure(t *testing.T) {
	var first table
	first.corner = "3 Services × 1 endpoints"
	first.set("ours", "`run 1`", []string{"start", "add"}, func(r string) string { return map[string]string{"start": "1 s", "add": "2 ms"}[r] })
	first.set("kp", "`run 1`", []string{"start", "add"}, func(r string) string { return map[string]string{"start": "9 s"}[r] })

	again := parseTable(first.String())
	if again.String() != first.String() {
		t.Fatalf("the table does not read back as written:\n%s\n---\n%s", first.String(), again.String())
	}
	again.set(
		"kp",
		"`run 2`",
		[]string{"start", "add", "tax"},
		func(r string) string { return map[string]string{"start": "8 s", "add": "7 ms", "tax": "0.9×"}[r] },
	)
	got := again.String()
	for _, want := range []string{
		"| start | 1 s | 8 s |",
		"| add | 2 ms | 7 ms |",
		"| tax | — | 0.9× |",
		"- ours: `run 1`",
		"- kp: `run 2`",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("merged table lacks %q:\n%s", want, got)
		}
	}
}

func TestTableOfAnotherShapeIsNotMerged(t *testing.T) {
	if got := parseTable("| a | b |\n|---|---:|\n| x | 1 | 2 |\n"); got.corner != "" {
		t.Fatalf("a row wider than its header read as a table: %+v", got)
	}
}
