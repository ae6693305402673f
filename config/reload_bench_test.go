package config

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// BenchmarkReloadOneFileOf10k: the cost of a reload when one small file
// changes beside a file of 10 000 Services with their slices (settled: its
// stamp spares reading it).
func BenchmarkReloadOneFileOf10k(b *testing.B) {
	dir := b.TempDir()
	var bulk strings.Builder
	for i := 0; i < 10000; i++ {
		fmt.Fprintf(&bulk, `---
apiVersion: v1
kind: Service
metadata: {name: s%[1]d, namespace: bench}
spec: {type: NodePort, clusterIP: 10.96.%[2]d.%[3]d, ports: [{port: 80, nodePort: %[4]d}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: s%[1]d, namespace: bench, labels: {kubernetes.io/service-name: s%[1]d}}
addressType: IPv4
ports: [{port: 9000}]
endpoints: [{addresses: [127.0.0.1]}]
`, i, i/250, i%250+1, 10000+i%20000)
	}
	if err := os.WriteFile(filepath.Join(dir, "bulk.yaml"), []byte(bulk.String()), 0o644); err != nil {
		b.Fatal(err)
	}
	c := newManifestCache()
	if _, _, err := c.load(dir, "n"); err != nil {
		b.Fatal(err)
	}
	// Read it once more after the racy window, as a daemon does on the
	// first reload: from then on its stamp is trusted.
	time.Sleep(c.racy + 100*time.Millisecond)
	if _, _, err := c.load(dir, "n"); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		_ = os.WriteFile(filepath.Join(dir, "extra.yaml"), []byte(fmt.Sprintf("# %d\n", i)), 0o644)
		if _, _, err := c.load(dir, "n"); err != nil {
			b.Fatal(err)
		}
	}
}
