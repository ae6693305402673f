package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

// nodeDirs are the per-node folders: containerd's root and state, the
// kubelet's root, pod logs and the CNI configuration.
type nodeDirs struct{ base string }

func (d nodeDirs) path(p string) string { return filepath.Join(d.base, p) }
func (d nodeDirs) socket() string       { return d.path("containerd/containerd.sock") }

// containerdConfig is containerd 2's configuration for a node of the lab:
// runc from Debian with its own root, cgroupfs, the CNI bridge from Debian,
// overlayfs, the pinned pause image, and restrict_oom_score_adj because
// root here lacks CAP_SYS_RESOURCE (runc fails with "can't get final
// child's PID from pipe: EOF" otherwise).
func containerdConfig(d nodeDirs) string {
	return fmt.Sprintf(`version = 3
root = %[1]q
state = %[2]q

[grpc]
  address = %[3]q

[ttrpc]
  address = %[4]q

[plugins."io.containerd.cri.v1.runtime"]
  enable_selinux = false
  disable_apparmor = true
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        Root = %[5]q
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = %[6]q

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = %[7]q

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
`, d.path("containerd/root"), d.path("containerd/state"), d.socket(), d.path("containerd/ttrpc.sock"),
		d.path("runc"), d.path("cni"), pauseImage)
}

// kubeletConfig is the KubeletConfiguration of node i. failCgroupV1: this
// machine has cgroup v1, which kubelet ≥ 1.35 refuses by default; the
// cgroupRoot keeps each node's pods in their own tree.
func kubeletConfig(i int, d nodeDirs) string {
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /%[1]s
failSwapOn: false
makeIPTablesUtilChains: false
containerRuntimeEndpoint: unix://%[2]s
address: %[3]s
port: 10250
readOnlyPort: 0
healthzPort: 0
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
clusterDNS: [%[4]s]
clusterDomain: cluster.local
resolvConf: %[5]q
podLogsDir: %[6]q
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%%", nodefs.inodesFree: "1%%", imagefs.available: "1%%"}
protectKernelDefaults: false
`, nodeName(i), d.socket(), nodeAddr(i), clusterDNS, d.path("resolv.conf"), d.path("pod-logs"))
}

// cniConfig is the CNI bridge for node i's pod subnet. No masquerade: a
// pod's address must reach the other node (and a backend must see it).
func cniConfig(d nodeDirs, podCIDR string) ([]byte, error) {
	return json.MarshalIndent(map[string]any{
		"cniVersion": "1.0.0",
		"name":       "kupc",
		"plugins": []any{
			map[string]any{
				"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
				"ipam": map[string]any{
					"type":    "host-local",
					"ranges":  [][]map[string]string{{{"subnet": podCIDR}}},
					"routes":  []map[string]string{{"dst": "0.0.0.0/0"}},
					"dataDir": d.path("cni-ipam"),
				},
			},
			map[string]any{"type": "portmap", "capabilities": map[string]bool{"portMappings": true}},
		},
	}, "", "  ")
}

// startNode starts containerd and the kubelet of node i, loads the images
// and, once the controller manager gave the node its pod subnet, writes
// the CNI configuration and the routes to it.
func (l *lab) startNode(ctx context.Context, i int, b *binaries, cp *controlPlane, imageTars []string) error {
	d := nodeDirs{base: filepath.Join(l.dir, nodeName(i))}
	for _, p := range []string{"containerd", "runc", "cni", "cni-ipam", "pod-logs", "kubelet"} {
		if err := os.MkdirAll(d.path(p), 0o755); err != nil {
			return err
		}
	}
	files := map[string]string{
		"containerd.toml": containerdConfig(d),
		"kubelet.yaml":    kubeletConfig(i, d),
		"resolv.conf":     "",
	}
	for name, data := range files {
		if err := os.WriteFile(d.path(name), []byte(data), 0o600); err != nil {
			return err
		}
	}
	if err := cluster.WriteKubeconfig(d.path("kubelet.kubeconfig"), apiServer, cp.nodeTokens[i-1]); err != nil {
		return err
	}
	if err := makeCgroupRoot(nodeName(i)); err != nil {
		return err
	}
	path := []string{"PATH=" + b.containerd + ":" + os.Getenv("PATH")}
	if _, err := l.start(fmt.Sprintf("containerd-%d", i), nodeName(i), path, filepath.Join(b.containerd, "containerd"),
		"--config", d.path("containerd.toml")); err != nil {
		return err
	}
	if err := waitFor(ctx, time.Minute, "containerd of "+nodeName(i), func() error {
		_, err := os.Stat(d.socket())
		return err
	}); err != nil {
		return err
	}
	for _, tar := range imageTars {
		if err := run("", filepath.Join(b.containerd, "ctr"), "--address", d.socket(), "-n", "k8s.io",
			"images", "import", "--no-unpack=false", tar); err != nil {
			return err
		}
	}
	if _, err := l.start(fmt.Sprintf("kubelet-%d", i), nodeName(i), path, filepath.Join(b.k8s, "kubelet"),
		"--config", d.path("kubelet.yaml"), "--kubeconfig", d.path("kubelet.kubeconfig"),
		"--root-dir", d.path("kubelet"), "--cert-dir", d.path("kubelet/pki"),
		"--hostname-override", nodeName(i), "--node-ip", nodeAddr(i), "-v", "2"); err != nil {
		return err
	}
	var podCIDR string
	if err := waitFor(ctx, 2*time.Minute, nodeName(i)+" registered with a pod subnet", func() error {
		out, err := cp.kubectl("get", "node", nodeName(i), "-o", "jsonpath={.spec.podCIDR}")
		if err != nil {
			return err
		}
		if podCIDR = strings.TrimSpace(out); podCIDR == "" {
			return fmt.Errorf("no podCIDR yet")
		}
		return nil
	}); err != nil {
		return err
	}
	conf, err := cniConfig(d, podCIDR)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(d.path("cni"), "10-kupc.conflist"), conf, 0o644); err != nil {
		return err
	}
	return l.routePods(i, podCIDR)
}

// waitFor retries check until it returns nil, for at most limit.
func waitFor(ctx context.Context, limit time.Duration, what string, check func() error) error {
	deadline := time.Now().Add(limit)
	for {
		err := check()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("waiting %v for %s: %w", limit, what, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}
