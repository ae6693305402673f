package iptables

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sirupsen/logrus"
)

// BenchmarkPartialSyncAt10k: the syncer's own cost of one added service port
// beside 10k (iptables-restore replaced by true(1)).
func BenchmarkPartialSyncAt10k(b *testing.B) {
	log := logrus.New()
	log.SetOutput(io.Discard)
	fes := manyFrontends(10001)
	f := &family{fam: 4, restore: "true", features: allFeatures, jumpsOK: true}
	f.installed = &Ruleset{Nat: map[string][]string{}, Filter: map[string][]string{}}
	if _, _, err := f.sync(context.Background(), fes[:10000], all4, false, nil, log); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		n := 10000 + i%2 // add, then remove, the last one
		if _, _, err := f.sync(context.Background(), fes[:n], all4, false, nil, log); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkCheckAt10k: the syncer's own cost of one periodic check of 10k
// service ports' rules (iptables-save replaced by cat(1) of what it would
// print).
func BenchmarkCheckAt10k(b *testing.B) {
	log := logrus.New()
	log.SetOutput(io.Discard)
	f := &family{fam: 4, restore: "true", features: allFeatures, jumpsOK: true}
	f.installed = &Ruleset{Nat: map[string][]string{}, Filter: map[string][]string{}}
	if _, _, err := f.sync(context.Background(), manyFrontends(10000), all4, false, nil, log); err != nil {
		b.Fatal(err)
	}
	want := f.installed
	var save strings.Builder
	for _, table := range []string{"nat", "filter"} {
		fmt.Fprintf(&save, "*%s\n:PREROUTING ACCEPT [0:0]\n", table)
		for chain := range want.table(table) {
			fmt.Fprintf(&save, ":%s - [0:0]\n", chain)
		}
		for _, j := range jumps(f.features) {
			if j.table == table {
				fmt.Fprintf(&save, "-A %s\n", j.text())
			}
		}
		for chain, rules := range want.table(table) {
			for _, r := range rules {
				fmt.Fprintf(&save, "-A %s %s\n", chain, r)
			}
		}
		save.WriteString("COMMIT\n")
	}
	dir := b.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "save.txt"), []byte(save.String()), 0o644); err != nil {
		b.Fatal(err)
	}
	f.save = filepath.Join(dir, "save")
	script := "#!/bin/sh\ncase \"$*\" in\n" +
		"*nat*) sed -n '/^\\*nat/,/^COMMIT/p' " + dir + "/save.txt;;\n" +
		"*) sed -n '/^\\*filter/,/^COMMIT/p' " + dir + "/save.txt;;\nesac\n"
	if err := os.WriteFile(f.save, []byte(script), 0o755); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		live, jumpsOK, err := f.live(context.Background(), true)
		if err != nil {
			b.Fatal(err)
		}
		if !jumpsOK || !live.Same(want) {
			b.Fatal("the live rules differ from those written")
		}
	}
}
