package cluster

import (
	"bufio"
	"os"
	"path/filepath"
	"strings"
	"testing"
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
// requirement's, or its replacement's where a replace names one.
func readGoMod(t *testing.T, name string) map[string]string {
	t.Helper()
	f, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	required, replaced := map[string]string{}, map[string]string{}
	block := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if i := strings.Index(line, "//"); i >= 0 {
			line = strings.TrimSpace(line[:i])
		}
		switch {
		case line == ")":
			block = ""
			continue
		case line == "require (" || line == "replace (":
			block = strings.Fields(line)[0]
			continue
		case strings.HasPrefix(line, "require ") || strings.HasPrefix(line, "replace "):
			kw := strings.Fields(line)[0]
			readGoModLine(kw, strings.TrimSpace(strings.TrimPrefix(line, kw)), required, replaced)
			continue
		}
		if block != "" && line != "" {
			readGoModLine(block, line, required, replaced)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	for path, v := range replaced {
		if _, ok := required[path]; ok {
			required[path] = v
		}
	}
	return required
}

func readGoModLine(kw, line string, required, replaced map[string]string) {
	f := strings.Fields(line)
	switch kw {
	case "require":
		if len(f) == 2 {
			required[f[0]] = f[1]
		}
	case "replace": // old [v] => new [v]
		for i, w := range f {
			if w == "=>" && i+1 < len(f) {
				rest := f[i+1:]
				replaced[f[0]] = strings.Join(rest, " ")
			}
		}
	}
}
