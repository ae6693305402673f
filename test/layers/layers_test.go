// Package layers holds the house's import rule as a test: every package of
// the daemon sits on a floor and imports only packages on floors below its
// own, and only the kernel's owners speak to the kernel (docs/architecture.md,
// The map).
package layers

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

const module = "github.com/kube-userspace-proxy/kube-userspace-proxy"

// floors: a package imports packages of lower floors only (a higher
// number); two on one floor never import each other.
var floors = map[string]int{
	"cmd/kube-userspace-proxy":                  10,
	"cmd/kube-userspace-proxy/internal/daemon":  20,
	"cmd/kube-userspace-proxy/internal/options": 25,
	"proxy":               30,
	"proxy/dataplane":     40,
	"iptables":            40,
	"proxy/balance":       50,
	"proxy/proxyproto":    50,
	"proxy/ports":         50,
	"proxy/clientaddr":    50,
	"proxy/syncrunner":    50,
	"proxy/healthcheck":   50,
	"proxy/handover":      50,
	"proxy/internal/sock": 60,
	"proxy/kernel":        70,
	"config":              80,
}

// kernelOwners may import golang.org/x/sys/unix and unsafe, and use
// syscall as they need.
var kernelOwners = []string{"proxy/kernel", "proxy/internal/sock"}

// syscallElsewhere is what the rest may use of package syscall: the
// standard library's signal numbers, errno values and a file's stat, not a
// kernel interface of their own.
func syscallElsewhere(name string) bool {
	return strings.HasPrefix(name, "SIG") || strings.HasPrefix(name, "E") && strings.ToUpper(name) == name ||
		name == "Signal" || name == "Errno" || name == "Stat" || name == "Stat_t"
}

// pkg is one package of the daemon as its non-test files have it.
type pkg struct {
	path    string   // relative to the module
	imports []string // the module's packages it imports, relative
	kernel  []string // "file: what" for each use of the kernel outside the rules
}

// violations lists what breaks the rules in pkgs.
func violations(pkgs []pkg) []string {
	var out []string
	for _, p := range pkgs {
		floor, ok := floors[p.path]
		if !ok {
			out = append(out, fmt.Sprintf("%s: has no floor (add it to floors here and to docs/architecture.md)", p.path))
			continue
		}
		for _, imp := range p.imports {
			if f, ok := floors[imp]; ok && f <= floor {
				out = append(out, fmt.Sprintf("%s (floor %d) imports %s (floor %d): only lower floors may be imported", p.path, floor, imp, f))
			}
		}
		if !slices.Contains(kernelOwners, p.path) {
			for _, k := range p.kernel {
				out = append(out, fmt.Sprintf("%s: %s (only %s speak to the kernel)", p.path, k, strings.Join(kernelOwners, " and ")))
			}
		}
	}
	return out
}

// load parses the module's packages under dirs.
func load(t *testing.T, root string, dirs ...string) []pkg {
	t.Helper()
	byPath := map[string]*pkg{}
	fset := token.NewFileSet()
	for _, dir := range dirs {
		err := filepath.WalkDir(filepath.Join(root, dir), func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			f, err := parser.ParseFile(fset, path, nil, 0)
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(root, filepath.Dir(path))
			p := byPath[rel]
			if p == nil {
				p = &pkg{path: rel}
				byPath[rel] = p
			}
			name := filepath.Base(path)
			syscallName := ""
			for _, is := range f.Imports {
				imp, _ := strconv.Unquote(is.Path.Value)
				switch {
				case strings.HasPrefix(imp, module+"/"):
					if rel := strings.TrimPrefix(imp, module+"/"); !slices.Contains(p.imports, rel) {
						p.imports = append(p.imports, rel)
					}
				case imp == "golang.org/x/sys/unix" || imp == "unsafe":
					p.kernel = append(p.kernel, fmt.Sprintf("%s imports %s", name, imp))
				case imp == "syscall":
					syscallName = "syscall"
					if is.Name != nil {
						syscallName = is.Name.Name
					}
				}
			}
			if syscallName != "" {
				ast.Inspect(f, func(n ast.Node) bool {
					if sel, ok := n.(*ast.SelectorExpr); ok {
						if id, ok := sel.X.(*ast.Ident); ok && id.Name == syscallName && !syscallElsewhere(sel.Sel.Name) {
							p.kernel = append(p.kernel, fmt.Sprintf("%s uses syscall.%s", name, sel.Sel.Name))
						}
					}
					return true
				})
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	var out []pkg
	for _, p := range byPath {
		out = append(out, *p)
	}
	return out
}

// The daemon's packages keep the rules.
func TestImportRule(t *testing.T) {
	pkgs := load(t, "../..", "cmd", "proxy", "iptables", "config")
	if len(pkgs) < 10 {
		t.Fatalf("found %d packages: the walk missed the tree", len(pkgs))
	}
	for _, v := range violations(pkgs) {
		t.Error(v)
	}
	for path := range floors {
		if !slices.ContainsFunc(pkgs, func(p pkg) bool { return p.path == path }) {
			t.Errorf("floors names %s, which has no Go file: take it out (here and in docs/architecture.md)", path)
		}
	}
}

// The rules catch what they forbid: an import of a floor above or beside,
// a package without a floor, the kernel spoken to from outside its owners.
func TestImportRuleCatches(t *testing.T) {
	for _, tc := range []struct {
		name string
		pkg  pkg
		want string
	}{
		{"upward", pkg{path: "proxy/balance", imports: []string{"proxy/dataplane"}}, "only lower floors"},
		{"sideways", pkg{path: "proxy/ports", imports: []string{"proxy/balance"}}, "only lower floors"},
		{"no floor", pkg{path: "proxy/newthing"}, "has no floor"},
		{"kernel outside", pkg{path: "proxy/dataplane", kernel: []string{"x.go imports golang.org/x/sys/unix"}}, "speak to the kernel"},
	} {
		got := violations([]pkg{tc.pkg})
		if len(got) != 1 || !strings.Contains(got[0], tc.want) {
			t.Errorf("%s: %q, want one saying %q", tc.name, got, tc.want)
		}
	}
	if got := violations(
		[]pkg{{path: "proxy", imports: []string{"proxy/dataplane", "config"}}, {path: "proxy/kernel", kernel: []string{"k.go imports unsafe"}}},
	); len(
		got,
	) != 0 {
		t.Errorf("a downward import and the kernel's own use: %q", got)
	}
	for _, name := range []string{"SIGTERM", "EADDRINUSE", "Stat_t", "Errno"} {
		if !syscallElsewhere(name) {
			t.Errorf("syscall.%s refused outside the owners", name)
		}
	}
	for _, name := range []string{"Socket", "Wait4", "NetlinkRIB", "RawSyscall"} {
		if syscallElsewhere(name) {
			t.Errorf("syscall.%s allowed outside the owners", name)
		}
	}
}
