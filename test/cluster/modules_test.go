package cluster

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/mod/modfile"
)

// The control plane (test/controlplane, built by BinDir for the end-to-end
// tests and the cluster benches), the conformance lab's Kubernetes
// (test/conformance/build/k8s) and this repository's own module compile
// mostly the same packages (client-go, api, apimachinery, prometheus, x/net,
// protobuf …). Go's build cache reuses a compiled package only when every
// module below it is the same version (and the build flags are the same:
// cluster.GoCommand), so one differing golang.org/x/net made a fresh machine
// compile Kubernetes twice, and one differing x/sys compiled client-go once
// for the daemon and once more for the control plane. Whatever two of them
// require must agree.
func TestModulesThatShareACacheAgree(t *testing.T) {
	mods := []struct{ name, path string }{
		{"this module", filepath.Join("..", "..", "go.mod")},
		{"test/controlplane", filepath.Join("..", "controlplane", "go.mod")},
		{"test/conformance/build/k8s", filepath.Join("..", "conformance", "build", "k8s", "go.mod")},
	}
	versions := make([]map[string]string, len(mods))
	for i, m := range mods {
		versions[i] = readGoMod(t, m.path)
	}
	for i := range mods {
		for j := i + 1; j < len(mods); j++ {
			shared := 0
			for path, v := range versions[i] {
				w, ok := versions[j][path]
				if !ok {
					continue
				}
				shared++
				if v != w {
					t.Errorf("%s: %s requires %s, %s %s: align them (go get %s@<the newer> in the other)",
						path, mods[i].name, v, mods[j].name, w, path)
				}
			}
			if shared < 30 {
				t.Errorf("only %d modules in both %s and %s: the parser no longer reads them", shared, mods[i].name, mods[j].name)
			}
		}
	}
}

// readGoMod returns each required module's effective version: the
// requirement's, or its replacement's (path and version) where a replace
// names one.
func readGoMod(t *testing.T, name string) map[string]string {
	t.Helper()
	data, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	f, err := modfile.ParseLax(name, data, nil)
	if err != nil {
		t.Fatal(err)
	}
	versions := map[string]string{}
	for _, r := range f.Require {
		versions[r.Mod.Path] = r.Mod.Version
	}
	for _, r := range f.Replace {
		if _, ok := versions[r.Old.Path]; ok {
			versions[r.Old.Path] = r.New.Path + " " + r.New.Version
		}
	}
	return versions
}
