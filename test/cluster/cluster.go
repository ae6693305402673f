// Package cluster starts a real Kubernetes control plane — etcd,
// kube-apiserver and kube-controller-manager (endpointslice controller only) —
// built from Go modules by the test/controlplane module, on loopback, with
// generated credentials. The binaries are built once and cached outside the
// repository, so only the first run pays the ~10 minute build.
package cluster

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"syscall"
	"time"
)

// BinDir returns the folder holding etcd, kube-apiserver and
// kube-controller-manager for the controlplane module in repoRoot, building
// them first if the cache does not have them. The cache key is the module's
// go.mod, go.sum and sources, so a version bump rebuilds.
func BinDir(repoRoot string, log io.Writer) (string, error) {
	mod := filepath.Join(repoRoot, "test", "controlplane")
	return Cached("controlplane", mod, []string{"etcd", "kube-apiserver", "kube-controller-manager"}, log,
		"the control plane (first time only: ~10 minutes)",
		func(out string) error {
			cmd := GoCommand(mod, "build", "-o", out+"/", "./cmd/...")
			cmd.Stdout, cmd.Stderr = log, log
			return cmd.Run()
		})
}

// Cached returns the cache folder named after kind and a hash of the files
// under src, after filling it with build when it lacks one of the programs
// in want. Builds are serialised across processes by a lock file, and a
// build that fails leaves nothing behind, so the next run starts clean.
// $KUP_CACHE_DIR overrides the cache's place (the user's cache folder).
func Cached(kind, src string, want []string, log io.Writer, what string, build func(out string) error) (string, error) {
	h := sha256.New()
	var files []string
	_ = filepath.Walk(src, func(p string, fi os.FileInfo, err error) error {
		if err == nil && !fi.IsDir() {
			files = append(files, p)
		}
		return nil
	})
	sort.Strings(files)
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return "", err
		}
		rel, _ := filepath.Rel(src, f)
		fmt.Fprintf(h, "%s\x00%d\x00", rel, len(data))
		h.Write(data)
	}
	base := os.Getenv("KUP_CACHE_DIR")
	if base == "" {
		c, err := os.UserCacheDir()
		if err != nil {
			return "", err
		}
		base = filepath.Join(c, "kube-userspace-proxy")
	}
	dir := filepath.Join(base, kind+"-"+hex.EncodeToString(h.Sum(nil))[:16])
	if haveAll(dir, want) {
		return dir, nil
	}
	if err := os.MkdirAll(base, 0o755); err != nil {
		return "", err
	}
	lock, err := os.OpenFile(filepath.Join(base, "build.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return "", err
	}
	if haveAll(dir, want) {
		return dir, nil
	}
	fmt.Fprintf(log, "building %s into %s\n", what, dir)
	tmp := dir + ".tmp"
	os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return "", err
	}
	if err := build(tmp); err != nil {
		os.RemoveAll(tmp)
		return "", fmt.Errorf("building %s: %w", kind, err)
	}
	if !haveAll(tmp, want) {
		os.RemoveAll(tmp)
		return "", fmt.Errorf("building %s: %v not all made", kind, want)
	}
	if err := os.Rename(tmp, dir); err != nil {
		return "", err
	}
	return dir, nil
}

func haveAll(dir string, want []string) bool {
	for _, b := range want {
		if fi, err := os.Stat(filepath.Join(dir, b)); err != nil || fi.Mode()&0o111 == 0 {
			return false
		}
	}
	return true
}

// Options place the control plane.
type Options struct {
	BinDir string
	Dir    string // state: etcd data, certificates, kubeconfig
	// Netns runs every process inside this network namespace (ip netns
	// exec); empty runs them here.
	Netns string
	// ListenAll makes the API server listen on every address of its
	// namespace, not only loopback: daemons of other lab nodes reach it.
	ListenAll bool
	// Log receives the processes' output (ports are picked free on
	// loopback).
	Log io.Writer
}

// ControlPlane is a running etcd + kube-apiserver + kube-controller-manager.
type ControlPlane struct {
	opts       Options
	URL        string // https://127.0.0.1:PORT
	AdminToken string
	Kubeconfig string // admin kubeconfig

	etcd, apiserver, kcm *proc
	apiArgs              []string
}

// proc is a started process; done is closed once it has been waited for.
type proc struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// Start brings the control plane up and waits until the API server is ready.
func Start(ctx context.Context, o Options) (*ControlPlane, error) {
	if err := os.MkdirAll(o.Dir, 0o755); err != nil {
		return nil, err
	}
	if o.Log == nil {
		o.Log = io.Discard
	}
	cp := &ControlPlane{opts: o, AdminToken: randomToken()}
	ports, err := freePorts(o.Netns, 3)
	if err != nil {
		return nil, err
	}
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", ports[0])
	cp.URL = fmt.Sprintf("https://127.0.0.1:%d", ports[2])

	keyFile := filepath.Join(o.Dir, "sa.key")
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	pemKey := pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)})
	tokens := filepath.Join(o.Dir, "tokens.csv")
	for f, data := range map[string][]byte{keyFile: pemKey, tokens: []byte(cp.AdminToken + ",admin,admin,system:masters\n")} {
		if err := os.WriteFile(f, data, 0o600); err != nil {
			return nil, err
		}
	}
	cp.Kubeconfig = filepath.Join(o.Dir, "admin.kubeconfig")
	if err := WriteKubeconfig(cp.Kubeconfig, cp.URL, cp.AdminToken); err != nil {
		return nil, err
	}

	cp.etcd, err = cp.spawn("etcd", "--data-dir", filepath.Join(o.Dir, "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", ports[1]),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", ports[1]),
		"--initial-cluster", fmt.Sprintf("default=http://127.0.0.1:%d", ports[1]))
	if err != nil {
		return nil, err
	}
	bind := "127.0.0.1"
	if o.ListenAll {
		bind = "0.0.0.0"
	}
	cp.apiArgs = []string{"--etcd-servers", etcdURL, "--service-cluster-ip-range", "10.96.0.0/16",
		"--cert-dir", filepath.Join(o.Dir, "certs"), "--secure-port", fmt.Sprint(ports[2]),
		"--bind-address", bind, "--advertise-address", "127.0.0.1",
		"--endpoint-reconciler-type", "none",
		// As kubeadm's: kube-proxy's DaemonSet, and ours, run privileged.
		"--allow-privileged=true", "--token-auth-file", tokens, "--authorization-mode", "RBAC",
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", keyFile, "--service-account-signing-key-file", keyFile}
	if err := cp.StartAPIServer(ctx); err != nil {
		cp.Stop()
		return nil, err
	}
	cp.kcm, err = cp.spawn("kube-controller-manager", "--kubeconfig", cp.Kubeconfig,
		"--controllers", "endpointslice", "--secure-port", "0", "--leader-elect=false")
	if err != nil {
		cp.Stop()
		return nil, err
	}
	return cp, nil
}

// StartAPIServer starts (or restarts) kube-apiserver and waits for /readyz.
func (cp *ControlPlane) StartAPIServer(ctx context.Context) error {
	var err error
	if cp.apiserver, err = cp.spawn("kube-apiserver", cp.apiArgs...); err != nil {
		return err
	}
	return cp.waitReady(ctx)
}

// StopAPIServer stops kube-apiserver only (an outage for its clients).
func (cp *ControlPlane) StopAPIServer() { stop(cp.apiserver) }

// Stop stops everything.
func (cp *ControlPlane) Stop() {
	stop(cp.kcm)
	stop(cp.apiserver)
	stop(cp.etcd)
}

func stop(p *proc) {
	if p != nil {
		StopProcess(p.cmd, p.done, 10*time.Second)
	}
}

// StopProcess ends a started process: SIGTERM, then SIGKILL after grace;
// done is closed once it has been waited for.
func StopProcess(cmd *exec.Cmd, done <-chan struct{}, grace time.Duration) {
	select {
	case <-done:
		return
	default:
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(grace):
		_ = cmd.Process.Kill()
		<-done
	}
}

func (cp *ControlPlane) spawn(name string, args ...string) (*proc, error) {
	bin := filepath.Join(cp.opts.BinDir, name)
	var cmd *exec.Cmd
	if cp.opts.Netns != "" {
		cmd = exec.Command("ip", append([]string{"netns", "exec", cp.opts.Netns, bin}, args...)...)
	} else {
		cmd = exec.Command(bin, args...)
	}
	logf, err := os.OpenFile(filepath.Join(cp.opts.Dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	p := &proc{cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); logf.Close(); close(p.done) }()
	return p, nil
}

// waitReady polls /readyz through the namespace's loopback.
func (cp *ControlPlane) waitReady(ctx context.Context) error {
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true},
		DialContext:     DialContextIn(cp.opts.Netns),
	}}
	deadline := time.Now().Add(90 * time.Second)
	for {
		req, _ := http.NewRequestWithContext(ctx, "GET", cp.URL+"/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+cp.AdminToken)
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return nil
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("kube-apiserver not ready (see %s): %v", filepath.Join(cp.opts.Dir, "kube-apiserver.log"), err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// WriteKubeconfig writes a kubeconfig for server with a bearer token.
func WriteKubeconfig(path, server, token string) error {
	return os.WriteFile(path, []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {server: %q, insecure-skip-tls-verify: true}
users:
- name: user
  user: {token: %q}
contexts:
- name: local
  context: {cluster: local, user: user}
current-context: local
`, server, token)), 0o600)
}

func randomToken() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// freePorts returns n TCP ports free on the namespace's loopback.
func freePorts(netns string, n int) ([]int, error) {
	var out []int
	var lns []net.Listener
	defer func() {
		for _, l := range lns {
			l.Close()
		}
	}()
	for i := 0; i < n; i++ {
		var ln net.Listener
		err := InNetns(netns, func() error {
			var err error
			ln, err = net.Listen("tcp4", "127.0.0.1:0")
			return err
		})
		if err != nil {
			return nil, err
		}
		lns = append(lns, ln)
		out = append(out, ln.Addr().(*net.TCPAddr).Port)
	}
	return out, nil
}
