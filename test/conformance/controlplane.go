package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

// controlPlane is etcd, kube-apiserver, kube-controller-manager (every
// controller, node CIDRs allocated from the cluster CIDR) and
// kube-scheduler, all in kupc-net; the API server listens on the bridge,
// where the nodes and the pods reach it.
type controlPlane struct {
	l          *lab
	b          *binaries
	dir        string
	adminToken string
	nodeTokens []string
	kubeconfig string // admin
}

func token() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func (l *lab) startControlPlane(ctx context.Context, b *binaries) (*controlPlane, error) {
	cp := &controlPlane{l: l, b: b, dir: filepath.Join(l.dir, "control-plane"), adminToken: token()}
	if err := os.MkdirAll(cp.dir, 0o755); err != nil {
		return nil, err
	}
	// Kubelets as the Node authorizer wants them: system:node:NAME in system:nodes.
	tokens := cp.adminToken + ",admin,admin,system:masters\n"
	for i := 1; i <= l.nodes; i++ {
		t := token()
		cp.nodeTokens = append(cp.nodeTokens, t)
		tokens += fmt.Sprintf("%s,system:node:%s,%s,system:nodes\n", t, nodeName(i), nodeName(i))
	}
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	saKey := filepath.Join(cp.dir, "sa.key")
	cp.kubeconfig = filepath.Join(cp.dir, "admin.kubeconfig")
	files := map[string][]byte{
		saKey:                               pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}),
		filepath.Join(cp.dir, "tokens.csv"): []byte(tokens),
	}
	for f, data := range files {
		if err := os.WriteFile(f, data, 0o600); err != nil {
			return nil, err
		}
	}
	if err := cluster.WriteKubeconfig(cp.kubeconfig, apiServer, cp.adminToken); err != nil {
		return nil, err
	}
	etcd := "http://127.0.0.1:2379"
	if _, err := l.start("etcd", netNS, nil, filepath.Join(b.controlPlane, "etcd"),
		"--data-dir", filepath.Join(cp.dir, "etcd"), "--listen-client-urls", etcd, "--advertise-client-urls", etcd,
		"--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
		"--initial-cluster", "default=http://127.0.0.1:2380", "--unsafe-no-fsync"); err != nil {
		return nil, err
	}
	pki := filepath.Join(cp.dir, "pki")
	if _, err := l.start("kube-apiserver", netNS, nil, filepath.Join(b.controlPlane, "kube-apiserver"),
		"--etcd-servers", etcd, "--service-cluster-ip-range", serviceCIDR,
		"--cert-dir", pki, "--secure-port", "6443", "--bind-address", "0.0.0.0", "--advertise-address", bridgeAddr,
		"--allow-privileged=true", "--token-auth-file", filepath.Join(cp.dir, "tokens.csv"),
		"--authorization-mode", "Node,RBAC", "--kubelet-preferred-address-types", "InternalIP",
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", saKey, "--service-account-signing-key-file", saKey,
		"--service-node-port-range", "30000-32767"); err != nil {
		return nil, err
	}
	if err := waitFor(ctx, 2*time.Minute, "kube-apiserver", func() error {
		_, err := cp.kubectl("get", "--raw", "/readyz")
		return err
	}); err != nil {
		return nil, err
	}
	// The API server's self-signed certificate (with its CA) is what pods
	// get as their service account's ca.crt.
	if _, err := l.start("kube-controller-manager", netNS, nil, filepath.Join(b.controlPlane, "kube-controller-manager"),
		"--kubeconfig", cp.kubeconfig, "--leader-elect=false", "--secure-port", "0",
		"--service-account-private-key-file", saKey, "--root-ca-file", filepath.Join(pki, "apiserver.crt"),
		"--allocate-node-cidrs", "--cluster-cidr", clusterCIDR, "--node-cidr-mask-size", "24",
		"--service-cluster-ip-range", serviceCIDR, "--use-service-account-credentials"); err != nil {
		return nil, err
	}
	if _, err := l.start("kube-scheduler", netNS, nil, filepath.Join(b.k8s, "kube-scheduler"),
		"--kubeconfig", cp.kubeconfig, "--leader-elect=false"); err != nil {
		return nil, err
	}
	return cp, nil
}

// kubectl runs kubectl as admin from kupc-net; stdin, when given, is fed.
func (cp *controlPlane) kubectl(args ...string) (string, error) {
	return cp.kubectlIn(nil, args...)
}

func (cp *controlPlane) kubectlIn(stdin []byte, args ...string) (string, error) {
	full := append([]string{"--net=/run/netns/" + netNS, "--", filepath.Join(cp.b.k8s, "kubectl"), "--kubeconfig", cp.kubeconfig}, args...)
	cmd := exec.Command("nsenter", full...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}

// apply applies a manifest.
func (cp *controlPlane) apply(manifest []byte) error {
	_, err := cp.kubectlIn(manifest, "apply", "-f", "-")
	return err
}
