package main

import (
	"bytes"
	"context"
	_ "embed"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

//go:embed manifests/coredns.yaml
var corednsManifest []byte

// The Service proxies a run can judge: ours, deployed as users deploy it,
// and the reference, upstream kube-proxy in its two Linux modes.
const (
	proxyOurs          = "kube-userspace-proxy"
	proxyKubeNftables  = "kube-proxy-nftables"
	proxyKubeIptables  = "kube-proxy-iptables"
	ourDaemonSetName   = "kube-userspace-proxy"
	ourDeployDir       = "docs/deploy"
	kubeProxyModeFlags = "--proxy-mode"
)

func knownProxy(p string) bool {
	return p == proxyOurs || p == proxyKubeNftables || p == proxyKubeIptables
}

// ourManifests are docs/deploy's rbac.yaml and daemonset.yaml with the two
// things the DaemonSet's comment asks a user to fill in: the control-plane
// endpoint, and the image (built here, as the lab reaches no registry).
func ourManifests(repo string) ([]byte, error) {
	var all []byte
	for _, f := range []string{"rbac.yaml", "daemonset.yaml"} {
		data, err := os.ReadFile(filepath.Join(repo, ourDeployDir, f))
		if err != nil {
			return nil, err
		}
		all = append(all, data...)
		all = append(all, []byte("\n---\n")...)
	}
	// The local-traffic detection kube-proxy gets here too (--cluster-cidr):
	// the DaemonSet's own, by the Node's pod CIDRs, which this lab's
	// controller manager allocates.
	if !bytes.Contains(all, []byte("\n        - --detect-local-mode=NodeCIDR\n")) {
		return nil, fmt.Errorf("%s no longer detects local traffic by the Node's pod CIDRs: update test/conformance", ourDeployDir)
	}
	for old, repl := range map[string]string{"CONTROL_PLANE_ENDPOINT": bridgeAddr, daemonImageTag: ourImage} {
		if !bytes.Contains(all, []byte(old)) {
			return nil, fmt.Errorf("%s no longer names %q: update test/conformance", ourDeployDir, old)
		}
		all = bytes.ReplaceAll(all, []byte(old), []byte(repl))
	}
	return all, nil
}

// deployProxy makes proxy the Service proxy of every node and waits until
// it serves there.
func (l *lab) deployProxy(ctx context.Context, cp *controlPlane, repo, proxy string) error {
	switch proxy {
	case proxyOurs:
		m, err := ourManifests(repo)
		if err != nil {
			return err
		}
		if err := cp.apply(m); err != nil {
			return err
		}
		return waitFor(ctx, 3*time.Minute, "the "+ourDaemonSetName+" DaemonSet ready on every node", func() error {
			out, err := cp.kubectl("-n", "kube-system", "get", "daemonset", ourDaemonSetName,
				"-o", "jsonpath={.status.numberReady}/{.status.desiredNumberScheduled}")
			if err != nil {
				return err
			}
			if out != fmt.Sprintf("%d/%d", l.nodes, l.nodes) {
				return fmt.Errorf("ready/desired %s", out)
			}
			return nil
		})
	case proxyKubeNftables, proxyKubeIptables:
		for i := 1; i <= l.nodes; i++ {
			if _, err := l.startKubeProxy(cp, proxy, i); err != nil {
				return err
			}
		}
		return waitFor(ctx, 2*time.Minute, "kube-proxy healthy on every node", func() error {
			for i := 1; i <= l.nodes; i++ {
				if err := run("", "nsenter", "--net=/run/netns/"+nodeName(i), "--", "curl", "-sf", "-o", "/dev/null",
					"http://127.0.0.1:10256/healthz"); err != nil {
					return err
				}
			}
			return nil
		})
	}
	return fmt.Errorf("unknown proxy %q", proxy)
}

// startKubeProxy starts kube-proxy (proxy: kube-proxy-MODE) on node i.
// --conntrack-max-per-core=0 leaves the machine-wide conntrack table size
// alone (it is not per namespace); its proxier.go logs at level 4, which
// says when it takes its node's topology labels (the differential checks
// that it did: kubeProxyTookZone).
func (l *lab) startKubeProxy(cp *controlPlane, proxy string, i int) (*proc, error) {
	return l.start(kubeProxyName(i), nodeName(i), nil, filepath.Join(cp.b.k8s, "kube-proxy"),
		"--kubeconfig", cp.kubeconfig, "--hostname-override", nodeName(i), kubeProxyModeFlags, strings.TrimPrefix(proxy, "kube-proxy-"),
		"--cluster-cidr", clusterCIDR, "--conntrack-max-per-core=0", "--v=2", "--vmodule=proxier=4")
}

func kubeProxyName(i int) string { return fmt.Sprintf("kube-proxy-%d", i) }

// deployDNS starts CoreDNS and waits for it to answer through the proxy.
func (l *lab) deployDNS(ctx context.Context, cp *controlPlane) error {
	if err := cp.apply(corednsManifest); err != nil {
		return err
	}
	return waitFor(ctx, 3*time.Minute, "CoreDNS answering at "+clusterDNS, func() error {
		return run("", "nsenter", "--net=/run/netns/"+nodeName(1), "--", "dig", "+short", "+time=1", "+tries=1",
			"@"+clusterDNS, "kubernetes.default.svc.cluster.local")
	})
}
