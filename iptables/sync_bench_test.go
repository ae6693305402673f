package iptables

import (
	"io"
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
	if _, _, err := f.sync(fes[:10000], all4, false, nil, log); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		n := 10000 + i%2 // add, then remove, the last one
		if _, _, err := f.sync(fes[:n], all4, false, nil, log); err != nil {
			b.Fatal(err)
		}
	}
}
