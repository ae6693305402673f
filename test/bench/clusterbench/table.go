package main

import (
	"fmt"
	"slices"
	"strings"
)

// table is the docs' bench-cluster table: one column per proxy, each
// with the run that measured it, so that a run of one proxy
// (PROXIES=...) replaces its column and keeps the others.
type table struct {
	corner string
	cols   []string          // proxies, in the order first written
	runs   map[string]string // proxy → the command and date of its run
	rows   []string
	cells  map[string]map[string]string // row → proxy → value
}

const tableIntro = "`make bench-cluster`: one proxy at a time, each in a network namespace of its own, from the same API server; the run of each column is named under the table.\n\n"

// set replaces proxy's column with value(row) for rows (and nothing else).
func (t *table) set(proxy, run string, rows []string, value func(string) string) {
	if t.runs == nil {
		t.runs, t.cells = map[string]string{}, map[string]map[string]string{}
	}
	if !slices.Contains(t.cols, proxy) {
		t.cols = append(t.cols, proxy)
	}
	t.runs[proxy] = run
	for _, r := range t.rows {
		delete(t.cells[r], proxy)
	}
	for _, r := range rows {
		if t.cells[r] == nil {
			t.rows = append(t.rows, r)
			t.cells[r] = map[string]string{}
		}
		if v := value(r); v != "" {
			t.cells[r][proxy] = v
		}
	}
}

func (t *table) String() string {
	var s strings.Builder
	s.WriteString(tableIntro)
	fmt.Fprintf(&s, "| %s |", t.corner)
	for _, c := range t.cols {
		fmt.Fprintf(&s, " %s |", c)
	}
	s.WriteString("\n|---|" + strings.Repeat("---:|", len(t.cols)) + "\n")
	for _, r := range t.rows {
		fmt.Fprintf(&s, "| %s |", r)
		for _, c := range t.cols {
			v := t.cells[r][c]
			if v == "" {
				v = "—"
			}
			fmt.Fprintf(&s, " %s |", v)
		}
		s.WriteString("\n")
	}
	s.WriteString("\n")
	for _, c := range t.cols {
		fmt.Fprintf(&s, "- %s: %s\n", c, t.runs[c])
	}
	return s.String()
}

// parseTable reads what String wrote; anything else reads as no table.
func parseTable(block string) table {
	var t table
	var header []string
	for _, line := range strings.Split(block, "\n") {
		switch {
		case strings.HasPrefix(line, "|---"):
		case strings.HasPrefix(line, "| ") && strings.HasSuffix(line, " |"):
			cells := strings.Split(strings.TrimSuffix(strings.TrimPrefix(line, "| "), " |"), " | ")
			if header == nil {
				header, t.corner = cells[1:], cells[0]
				t.runs, t.cells = map[string]string{}, map[string]map[string]string{}
				continue
			}
			if len(cells) != len(header)+1 {
				return table{}
			}
			t.rows = append(t.rows, cells[0])
			t.cells[cells[0]] = map[string]string{}
			for k, v := range cells[1:] {
				if v != "—" {
					t.cells[cells[0]][header[k]] = v
				}
			}
		case strings.HasPrefix(line, "- ") && header != nil:
			if c, run, ok := strings.Cut(strings.TrimPrefix(line, "- "), ": "); ok && slices.Contains(header, c) {
				t.runs[c] = run
			}
		}
	}
	for _, c := range header {
		if t.runs[c] == "" {
			t.runs[c] = "(run not recorded)"
		}
	}
	t.cols = header
	return t
}
