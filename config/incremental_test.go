package config

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A reload joins only the Services in changed files again; after any
// sequence of edits its State must equal a full load of the same files.
func TestIncrementalReloadMatchesFullLoad(t *testing.T) {
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(1, 2))
	object := func(svc int) string {
		name := fmt.Sprintf("s%d", svc)
		switch rng.IntN(4) {
		case 0:
			return fmt.Sprintf("apiVersion: v1\nkind: Service\nmetadata: {name: %s}\nspec: {clusterIP: 10.96.0.%d, ports: [{port: %d}]}\n",
				name, svc+1, 80+rng.IntN(2))
		case 1:
			return fmt.Sprintf("apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: %s-%d, labels: {kubernetes.io/service-name: %s}}\naddressType: IPv4\nports: [{port: 9000}]\nendpoints: [{addresses: [10.1.%d.%d]}]\n",
				name, rng.IntN(1000), name, svc, rng.IntN(3)+1)
		case 2:
			return fmt.Sprintf("apiVersion: v1\nkind: Endpoints\nmetadata: {name: %s}\nsubsets: [{addresses: [{ip: 10.2.%d.%d}], ports: [{port: 9000}]}]\n",
				name, svc, rng.IntN(3)+1)
		}
		return "# nothing\n"
	}
	incr := newManifestCache()
	compared, hinted := 0, 0
	var prev *State
	for step := 0; step < 400; step++ {
		file := filepath.Join(dir, fmt.Sprintf("f%d.yaml", rng.IntN(4)))
		if rng.IntN(6) == 0 {
			_ = os.Remove(file)
		} else {
			var docs []string
			for n := rng.IntN(4); n > 0; n-- {
				docs = append(docs, object(rng.IntN(6)))
			}
			if err := os.WriteFile(file, []byte(strings.Join(docs, "---\n")), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		got, _, gotErr := incr.load(dir, "node-a")
		want, _, wantErr := newManifestCache().load(dir, "node-a")
		if (gotErr == nil) != (wantErr == nil) {
			t.Fatalf("step %d: incremental error %v, full load error %v", step, gotErr, wantErr)
		}
		if wantErr != nil {
			continue
		}
		compared++
		// The hints name every port that differs from the last State.
		if prev != nil && got.Since != 0 {
			if got.Since != prev.Seq || got.Seq != prev.Seq+1 {
				t.Fatalf("step %d: seq %d since %d after seq %d", step, got.Seq, got.Since, prev.Seq)
			}
			hinted++
			named := map[ServicePortName]bool{}
			for _, n := range got.Changed {
				named[n] = true
			}
			for name, sp := range got.Ports {
				if o := prev.Ports[name]; o != sp && !named[name] {
					t.Fatalf("step %d: %s changed but is not named in Changed %v", step, name, got.Changed)
				}
			}
			for name := range prev.Ports {
				if got.Ports[name] == nil && !named[name] {
					t.Fatalf("step %d: %s is gone but not named in Changed %v", step, name, got.Changed)
				}
			}
		}
		prev = got
		if len(got.Ports) != len(want.Ports) {
			t.Fatalf("step %d: %d ports, full load has %d", step, len(got.Ports), len(want.Ports))
		}
		for name, sp := range want.Ports {
			if g := got.Ports[name]; g == nil || !g.Equal(sp) {
				t.Fatalf("step %d: %s is %+v, full load has %+v", step, name, g, sp)
			}
		}
	}
	if hinted < 50 {
		t.Fatalf("only %d reloads said what changed", hinted)
	}
	if compared < 100 {
		t.Fatalf("only %d of 400 steps loaded without error: the generator makes too many bad sets", compared)
	}
}

// A file whose stamp is unchanged since a read made well after its last
// change is not read again; any edit is still seen.
func TestSettledFileIsNotReadAgain(t *testing.T) {
	dir := t.TempDir()
	bulk, small := filepath.Join(dir, "bulk.yaml"), filepath.Join(dir, "small.yaml")
	svcYAML := func(name string, port int) string {
		return fmt.Sprintf("apiVersion: v1\nkind: Service\nmetadata: {name: %s}\nspec: {clusterIP: 10.96.0.1, ports: [{port: %d}]}\n", name, port)
	}
	write := func(path, content string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(bulk, svcYAML("bulk", 80))
	write(small, svcYAML("small", 80))
	c := newManifestCache()
	reads := map[string]int{}
	c.read = func(p string) ([]byte, error) { reads[filepath.Base(p)]++; return os.ReadFile(p) }
	port := func(st *State, name string) int {
		for n, sp := range st.Ports {
			if n.Name == name {
				return sp.Port
			}
		}
		return 0
	}
	load := func() *State {
		t.Helper()
		st, _, err := c.load(dir, "node-a")
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	// Within the racy window every load reads the file again.
	c.racy = time.Hour
	load()
	load()
	if reads["bulk.yaml"] != 2 {
		t.Fatalf("a file read within the racy window was not read again: %d reads", reads["bulk.yaml"])
	}
	c.racy = 20 * time.Millisecond
	time.Sleep(3 * c.racy)
	load() // read now, well after its last change: settled
	n := reads["bulk.yaml"]
	write(small, svcYAML("small", 81)) // same size, in place
	st := load()
	if reads["bulk.yaml"] != n {
		t.Fatalf("a settled, unchanged file was read again: %d reads, want %d", reads["bulk.yaml"], n)
	}
	if port(st, "small") != 81 {
		t.Fatalf("the edit was not seen: port %d", port(st, "small"))
	}
	write(bulk, svcYAML("bulk", 81))
	if st := load(); port(st, "bulk") != 81 || reads["bulk.yaml"] != n+1 {
		t.Fatalf("an edit of the settled file: port %d after %d reads, want %d", port(st, "bulk"), reads["bulk.yaml"], n+1)
	}
}
