package cluster

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/mod/modfile"
)

// The control plane (test/controlplane, built by BinDir for the end-to-end
// tests and the cluster benches) and the conformance lab's Kubernetes
// (test/conformance/build/k8s) compile mostly the same packages. Go's build
// cache reuses a compiled package only when every module below it is the same
// version, so one differing golang.org/x/net made a fresh machine compile
// Kubernetes twice. Whatever both modules require must agree.
func TestControlPlaneAndConformanceModulesAgree(t *testing.T) {
	cp := readGoMod(t, filepath.Join("..", "controlplane", "go.mod"))
	k8s := readGoMod(t, filepath.Join("..", "conformance", "build", "k8s", "go.mod"))
	shared := 0
	for path, v := range cp {
		w, ok := k8s[path]
		if !ok {
			continue
		}
		shared++
		if v != w {
			t.Errorf("%s: test/controlplane requires %s, test/conformance/build/k8s %s: align them (go get %s@%s in one)", path, v, w, path, w)
		}
	}
	if shared < 50 {
		t.Fatalf("only %d modules in both go.mod files: the parser no longer reads them", shared)
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
