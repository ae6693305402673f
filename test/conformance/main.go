// Command conformance (make conformance) judges a Service proxy by
// Kubernetes' own e2e suite on a real cluster built on this machine: etcd,
// kube-apiserver, kube-controller-manager and kube-scheduler, three nodes
// each with containerd, runc, the CNI bridge and a kubelet, CoreDNS, and
// the proxy under test, every piece in network namespaces of its own.
// kube-userspace-proxy runs as the DaemonSet of docs/deploy; upstream
// kube-proxy (nftables and iptables modes) runs in its place as the
// reference. The results go to test/conformance/results and the table in
// docs/conformance.md; the exit status fails when kube-proxy passes a spec
// we fail that test/conformance/known-differences.txt does not list.
//
//	go run ./test/conformance [-proxies kube-userspace-proxy,kube-proxy-nftables] [-short] [-focus RE] [-keep]
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

// The suite's part that is about a Service proxy (test/e2e/network).
const fullFocus = `\[sig-network\] (Services|Conntrack|Networking|KubeProxy|EndpointSlice)`

// shortFocus is the few-minute subset make test runs: the specs that
// broke for a userspace proxy before (refusal, UDP flows, kube-proxy's
// URLs) and a Conformance spec per Service type.
const shortFocus = `\[sig-network\] Services should (be rejected when no endpoints exist|serve a basic endpoint from pods|be able to create a functioning NodePort service|serve multiport endpoints from pods)` +
	`|\[sig-network\] Conntrack should be able to preserve UDP traffic when server pod cycles for a ClusterIP service` +
	`|\[sig-network\] Networking should check kube-proxy urls`

const labDir = "/var/lib/kup-conformance"

// binaries are the cached builds a run uses.
type binaries struct {
	controlPlane, k8s, containerd, dns string
	ours                               string
}

func main() {
	proxies := flag.String("proxies", proxyOurs+","+proxyKubeNftables+","+proxyKubeIptables, "the proxies to judge, in order")
	short := flag.Bool("short", false, "run the few-minute subset (make test) and write no docs")
	focus := flag.String("focus", "", "a Ginkgo focus regexp instead of the suite's proxy part")
	nodes := flag.Int("nodes", 3, "kubelet nodes (three: the HealthCheckNodePort spec needs as many, the multi-node ones two)")
	procs := flag.Int("procs", 3, "parallel e2e processes (Ginkgo -p; [Serial] specs run alone)")
	keep := flag.Bool("keep", false, "leave the last lab's folder (logs, configs) in "+labDir)
	differential := flag.Bool("differential", false, "run the differential instead of the e2e suite: random Service shapes observed with ours and with kube-proxy (nftables)")
	seed := flag.Int64("seed", 0, "the differential's seed (0: a new one, printed)")
	shapes := flag.Int("shapes", 200, "how many shapes the differential draws")
	oneCase := flag.Int("case", -1, "run only this case of the seed (with -differential)")
	batch := flag.Int("batch", 16, "shapes applied and observed together (with -differential)")
	noShrink := flag.Bool("no-shrink", false, "report differences without reducing their shapes (with -differential)")
	buildOnly := flag.Bool("build-only", false, "fill the build cache (the control plane, Kubernetes, containerd, CoreDNS) and exit; needs no root")
	writeSpecs := flag.Bool("write-upstream-specs", false, "write "+upstreamSpecsFile+" from upstream's whole e2e binary (make conformance-specs, after a Kubernetes upgrade) and exit")
	upstreamBinary := flag.String("upstream-e2e", "", "with -write-upstream-specs: upstream's e2e binary, already built (default: build it)")
	flag.Parse()
	repo, err := repoRoot()
	if err != nil {
		fatal(err)
	}
	if *writeSpecs {
		if err := writeUpstreamSpecs(repo, *upstreamBinary); err != nil {
			fatal(err)
		}
		return
	}
	if *buildOnly {
		if err := buildCached(repo, &binaries{}); err != nil {
			fatal(err)
		}
		return
	}
	if os.Geteuid() != 0 {
		// As the root-only tests: a skip in make test, a failure in CI.
		if *short && os.Getenv("KUP_REQUIRE_ROOT_TESTS") == "" {
			fmt.Println("conformance-short: skipped: needs root (it makes network namespaces, cgroups and mounts)")
			return
		}
		fatal(fmt.Errorf("needs root: it makes network namespaces, cgroups and mounts"))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	f := *focus
	if f == "" {
		f = fullFocus
		if *short {
			f = shortFocus
		}
	}
	conf := filepath.Join(repo, "test", "conformance")
	skips, err := readSkips(filepath.Join(conf, "skips.txt"))
	if err != nil {
		fatal(err)
	}
	knowns, err := readKnown(filepath.Join(conf, "known-differences.txt"))
	if err != nil {
		fatal(err)
	}
	b, err := build(repo)
	if err != nil {
		fatal(err)
	}
	if err := checkSpecSet(conf, filepath.Join(b.k8s, "e2e.test")); err != nil {
		fatal(err)
	}
	tars, err := buildImages(repo, b)
	if err != nil {
		fatal(err)
	}
	if *differential {
		o := diffOptions{seed: *seed, shapes: *shapes, only: *oneCase, batch: *batch, shrink: !*noShrink, writeDocs: *oneCase < 0,
			resultsFile: filepath.Join(conf, "results", "differential.json")}
		if o.seed == 0 {
			o.seed = time.Now().UnixNano() % 1_000_000
		}
		if *oneCase >= 0 {
			o.resultsFile = ""
		}
		fmt.Printf("== differential: seed %d, %d shapes (rerun with make differential SEED=%d)\n", o.seed, o.shapes, o.seed)
		ok, err := runDifferential(ctx, repo, b, tars, o)
		if err != nil {
			fatal(err)
		}
		if !ok {
			os.Exit(1)
		}
		return
	}
	command := "make conformance"
	if *short {
		command = "make conformance-short"
	}
	for _, p := range strings.Split(*proxies, ",") {
		if !knownProxy(p) {
			fatal(fmt.Errorf("unknown proxy %q (want %s, %s or %s)", p, proxyOurs, proxyKubeNftables, proxyKubeIptables))
		}
		fmt.Printf("== %s: a %d-node cluster, then the e2e suite (%s)\n", p, *nodes, f)
		res, err := runOne(ctx, repo, b, tars, p, *nodes, f, skips, *procs, *keep)
		if err != nil {
			fatal(fmt.Errorf("%s: %w", p, err))
		}
		rr := runResults{Proxy: p, Date: time.Now().UTC().Format("2006-01-02"), Command: command, Nodes: *nodes, Focus: f, Specs: res}
		if err := saveResults(conf, rr, *short, *focus != ""); err != nil {
			fatal(err)
		}
		printSummary(rr)
	}
	ok, err := verdicts(repo, conf, knowns, *short)
	if err != nil {
		fatal(err)
	}
	if !ok {
		os.Exit(1)
	}
}

// runOne brings a lab up with proxy as the Service proxy, runs the suite
// and takes the lab down again, whatever happened.
func runOne(
	ctx context.Context,
	repo string,
	b *binaries,
	tars []string,
	proxy string,
	nodes int,
	focus string,
	skips []skip,
	procs int,
	keep bool,
) ([]result, error) {
	sweep(labDir, false)
	l := &lab{dir: labDir, log: os.Stdout, nodes: nodes, keepLogs: filepath.Join(os.TempDir(), "kup-conformance-logs", proxy)}
	defer l.close(keep)
	cp, err := l.bringUp(ctx, b, tars)
	if err != nil {
		return nil, err
	}
	if err := l.deployProxy(ctx, cp, repo, proxy); err != nil {
		return nil, fmt.Errorf("deploying %s: %w", proxy, err)
	}
	if err := l.deployDNS(ctx, cp); err != nil {
		return nil, err
	}
	if _, err := cp.kubectl("wait", "--for=condition=Ready", "node", "--all", "--timeout=120s"); err != nil {
		return nil, err
	}
	fmt.Printf("   cluster up (%d nodes, %s serving, CoreDNS answering)\n", nodes, proxy)
	return runE2E(ctx, l, cp, focus, skips, procs, os.Stdout)
}

// build returns the programs a run uses: the cached ones (buildCached)
// and this repository's daemon, built afresh.
func build(repo string) (*binaries, error) {
	b := &binaries{}
	if err := buildCached(repo, b); err != nil {
		return nil, err
	}
	b.ours = filepath.Join(repo, "bin", "kube-userspace-proxy")
	if err := goBuild(repo, "build", "-o", b.ours, "./cmd/kube-userspace-proxy"); err != nil {
		return nil, err
	}
	return b, nil
}

// goBuild runs the go command in dir in the suite's one build
// configuration (cluster.GoCommand), its output on stderr.
func goBuild(dir string, args ...string) error {
	cmd := cluster.GoCommand(dir, args...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	return cmd.Run()
}

// buildCached fills b's folders of programs built from pinned modules,
// building what the cache lacks (first run: roughly 25 minutes on two
// cores, the control plane first, as the e2e tests want it too).
func buildCached(repo string, b *binaries) error {
	var err error
	if b.controlPlane, err = cluster.BinDir(repo, os.Stderr); err != nil {
		return err
	}
	mod := func(name string) string { return filepath.Join(repo, "test", "conformance", "build", name) }
	k8sProgs := []string{"kubelet", "kube-scheduler", "kube-proxy", "kubectl", "agnhost", "regression-issue-74839", "mkimage", "ginkgo", "e2e.test"}
	if b.k8s, err = cluster.Cached("conformance-k8s", mod("k8s"), k8sProgs, os.Stderr,
		"kubelet, kube-proxy, agnhost and the e2e suite (first time only: ~8 minutes)", func(out string) error {
			if err := goBuild(mod("k8s"), "build", "-o", out+"/", "k8s.io/kubernetes/cmd/kubelet",
				"k8s.io/kubernetes/cmd/kube-scheduler", "k8s.io/kubernetes/cmd/kube-proxy", "k8s.io/kubernetes/cmd/kubectl",
				"k8s.io/kubernetes/test/images/agnhost", "k8s.io/kubernetes/test/images/regression-issue-74839", "./cmd/mkimage",
				"github.com/onsi/ginkgo/v2/ginkgo"); err != nil {
				return err
			}
			// upstream's suite with only the network specs compiled in (see specs.go)
			return goBuild(mod("k8s"), "test", "-c", "-o", filepath.Join(out, "e2e.test"), "./e2enet")
		}); err != nil {
		return err
	}
	if b.containerd, err = cluster.Cached("conformance-containerd", mod("containerd"), []string{"containerd", "ctr", "containerd-shim-runc-v2"}, os.Stderr,
		"containerd (first time only: ~3 minutes)", func(out string) error {
			if err := goBuild(mod("containerd"), "build", "-tags", "no_btrfs urfave_cli_no_docs", "-o", out+"/",
				"github.com/containerd/containerd/v2/cmd/containerd", "github.com/containerd/containerd/v2/cmd/ctr"); err != nil {
				return err
			}
			return goBuild(mod("containerd"), "build", "-tags", "no_btrfs urfave_cli_no_docs no_grpc", "-o", out+"/",
				"github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2")
		}); err != nil {
		return err
	}
	b.dns, err = cluster.Cached("conformance-coredns", mod("coredns"), []string{"coredns"}, os.Stderr,
		"CoreDNS (first time only: ~3 minutes)", func(out string) error {
			return goBuild(mod("coredns"), "build", "-o", filepath.Join(out, "coredns"), "github.com/coredns/coredns")
		})
	return err
}

// buildImages writes every image's tarball (a minute; not cached, as they
// take this machine's binaries and the proxy just built).
func buildImages(repo string, b *binaries) ([]string, error) {
	list := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "k8s.io/kubernetes")
	list.Dir = filepath.Join(repo, "test", "conformance", "build", "k8s")
	modDir, err := list.Output()
	if err != nil {
		return nil, fmt.Errorf("finding k8s.io/kubernetes in the module cache: %w", err)
	}
	ib := &imageBuilder{k8sBin: b.k8s, dnsBin: b.dns, ourBin: b.ours, k8sModDir: strings.TrimSpace(string(modDir))}
	work := filepath.Join(repo, "bin", "conformance-images")
	if err := os.MkdirAll(work, 0o755); err != nil {
		return nil, err
	}
	var tars []string
	for _, img := range ib.images() {
		out := filepath.Join(work, strings.NewReplacer("/", "_", ":", "_").Replace(img.ref)+".tar")
		if err := ib.build(img, work, out); err != nil {
			return nil, err
		}
		tars = append(tars, out)
	}
	return tars, nil
}

func repoRoot() (string, error) {
	out, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err != nil {
		return "", fmt.Errorf("run from the repository: %w", err)
	}
	return strings.TrimSpace(string(out)), nil
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "conformance:", err)
	os.Exit(2)
}
