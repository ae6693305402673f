// Package e2enet is upstream's e2e test binary with only the specs the
// conformance lab runs: k8s.io/kubernetes/test/e2e's own main (flags,
// embedded manifests, RunE2ETests) over the network SIG's specs and the
// common ones ("[sig-network] Networking" lives in test/e2e/common/network).
// Upstream's binary compiles every SIG's specs, storage drivers and cloud
// SDKs included, to run the same network specs; this one builds in
// half the time (docs/conformance.md). The spec sources, the
// framework and the runner are upstream's, unchanged.
//
// Every run of test/conformance checks first (checkSpecSet, specs.go) that
// this binary selects the specs upstream's whole binary selects for the
// lab's focus, as listed in test/conformance/upstream-specs.txt.
package e2enet

import (
	"flag"
	"fmt"
	"os"
	"testing"

	"k8s.io/component-base/version"
	conformancetestdata "k8s.io/kubernetes/test/conformance/testdata"
	"k8s.io/kubernetes/test/e2e"
	"k8s.io/kubernetes/test/e2e/framework"
	"k8s.io/kubernetes/test/e2e/framework/config"
	"k8s.io/kubernetes/test/e2e/framework/testfiles"
	e2etestingmanifests "k8s.io/kubernetes/test/e2e/testing-manifests"
	testfixtures "k8s.io/kubernetes/test/fixtures"

	// define and freeze constants
	_ "k8s.io/kubernetes/test/e2e/feature"

	// the specs: test/e2e imports test/e2e/common, which holds common/network
	_ "k8s.io/kubernetes/test/e2e/network"

	// reconfigure framework, as upstream's binary does
	_ "k8s.io/kubernetes/test/e2e/framework/debug/init"
	_ "k8s.io/kubernetes/test/e2e/framework/metrics/init"
	_ "k8s.io/kubernetes/test/e2e/framework/node/init"
	_ "k8s.io/kubernetes/test/utils/ktesting/format"
)

// TestMain is upstream's (test/e2e/e2e_test.go) without the conformance
// list and the invariants' flags, which this binary's specs do not use.
func TestMain(m *testing.M) {
	versionFlag := flag.CommandLine.Bool("version", false, "Displays version information.")
	config.CopyFlags(config.Flags, flag.CommandLine)
	framework.RegisterCommonFlags(flag.CommandLine)
	framework.RegisterClusterFlags(flag.CommandLine)
	flag.Parse()
	if *versionFlag {
		fmt.Printf("%s\n", version.Get())
		os.Exit(0)
	}
	if flag.CommandLine.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "unknown additional command line arguments: %s", flag.CommandLine.Args())
		os.Exit(1)
	}
	testfiles.AddFileSource(e2etestingmanifests.GetE2ETestingManifestsFS())
	testfiles.AddFileSource(testfixtures.GetTestFixturesFS())
	testfiles.AddFileSource(conformancetestdata.GetConformanceTestdataFS())
	framework.AfterReadingAllFlags(&framework.TestContext)
	if framework.TestContext.RepoRoot != "" {
		testfiles.AddFileSource(testfiles.RootFileSource{Root: framework.TestContext.RepoRoot})
	}
	os.Exit(m.Run())
}

func TestE2E(t *testing.T) {
	e2e.RunE2ETests(t)
}
