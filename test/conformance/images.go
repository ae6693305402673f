package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
)

// image is one container image the lab loads into every node's containerd,
// under the reference the e2e framework (or our manifests) ask for, since
// nothing here reaches a registry. Its root file system is assembled from
// programs built from Go modules and this machine's Debian binaries with
// the shared libraries they link.
type image struct {
	ref        string
	entrypoint string
	cmd        string
	// fill makes the root file system in dir.
	fill func(b *imageBuilder, dir string) error
}

// Tags as test/utils/image/manifest.go of k8s.io/kubernetes v1.37.2 names them.
const (
	pauseImage     = "registry.k8s.io/pause:3.10.2"
	agnhostImage   = "registry.k8s.io/e2e-test-images/agnhost:2.66.1"
	busyboxImage   = "registry.k8s.io/e2e-test-images/busybox:1.37.0-2"
	iptablesImage  = "registry.k8s.io/build-image/distroless-iptables:v0.9.9"
	regressionImg  = "registry.k8s.io/e2e-test-images/regression-issue-74839:1.5"
	corednsImage   = "registry.k8s.io/coredns/coredns:v1.15.0"
	ourImage       = "ghcr.io/kube-userspace-proxy/kube-userspace-proxy:conformance"
	daemonImageTag = "ghcr.io/kube-userspace-proxy/kube-userspace-proxy:v0.3.0" // what docs/deploy names
)

// imageBuilder knows where the built programs are.
type imageBuilder struct {
	k8sBin, dnsBin, ourBin string
	k8sModDir              string // k8s.io/kubernetes in the module cache
}

func (b *imageBuilder) images() []image {
	shellTools := []string{"/bin/bash", "/bin/sh", "/usr/bin/nc.openbsd", "/usr/bin/curl", "/usr/bin/wget",
		"/usr/bin/dig", "/usr/bin/nslookup", "/sbin/ip", "/usr/bin/ss", "/usr/bin/socat"}
	return []image{
		{ref: pauseImage, entrypoint: "/pause", fill: func(b *imageBuilder, dir string) error {
			src := filepath.Join(b.k8sModDir, "build/pause/linux/pause.c")
			return run("", "gcc", "-Os", "-static", "-o", filepath.Join(dir, "pause"), src)
		}},
		{ref: agnhostImage, entrypoint: "/agnhost", cmd: "pause", fill: func(b *imageBuilder, dir string) error {
			if err := addProgram(dir, filepath.Join(b.k8sBin, "agnhost"), "agnhost"); err != nil {
				return err
			}
			if err := os.Symlink("agnhost", filepath.Join(dir, "agnhost-2")); err != nil {
				return err
			}
			for _, f := range []string{"localhost.crt", "localhost.key"} {
				if err := copyFile(filepath.Join(b.k8sModDir, "test/images/agnhost/porter", f), filepath.Join(dir, f)); err != nil {
					return err
				}
			}
			if err := os.MkdirAll(filepath.Join(dir, "uploads"), 0o755); err != nil {
				return err
			}
			if err := hostFiles(dir, shellTools...); err != nil {
				return err
			}
			// nc as the agnhost image has it (OpenBSD's: -v, -z, -u, -p).
			if err := os.Symlink("nc.openbsd", filepath.Join(dir, "usr/bin/nc")); err != nil {
				return err
			}
			return busyboxApplets(dir)
		}},
		{ref: busyboxImage, cmd: "sh", fill: func(b *imageBuilder, dir string) error { return busyboxApplets(dir) }},
		{ref: iptablesImage, fill: func(b *imageBuilder, dir string) error {
			if err := hostFiles(dir, iptablesFiles()...); err != nil {
				return err
			}
			if err := hostFiles(dir, "/usr/sbin/conntrack"); err != nil {
				return err
			}
			return busyboxApplets(dir)
		}},
		{ref: regressionImg, entrypoint: "/regression-issue-74839", fill: func(b *imageBuilder, dir string) error {
			return addProgram(dir, filepath.Join(b.k8sBin, "regression-issue-74839"), "regression-issue-74839")
		}},
		{ref: corednsImage, entrypoint: "/coredns", fill: func(b *imageBuilder, dir string) error {
			return addProgram(dir, filepath.Join(b.dnsBin, "coredns"), "coredns")
		}},
		{ref: ourImage, entrypoint: "/usr/local/bin/kube-userspace-proxy", fill: func(b *imageBuilder, dir string) error {
			if err := addProgram(dir, b.ourBin, "usr/local/bin/kube-userspace-proxy"); err != nil {
				return err
			}
			// The DaemonSet's readiness probe runs test(1), which the
			// Dockerfile's Debian base has.
			return hostFiles(dir, append(iptablesFiles(), "/usr/bin/test")...)
		}},
	}
}

// iptablesFiles are this machine's iptables (the nf_tables backend, as the
// Dockerfile selects) with its extensions.
func iptablesFiles() []string {
	files := []string{"/usr/sbin/xtables-nft-multi"}
	for _, n := range []string{"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore"} {
		files = append(files, "/usr/sbin/"+n)
	}
	ext, _ := filepath.Glob("/usr/lib/x86_64-linux-gnu/xtables/*.so")
	return append(files, ext...)
}

// build writes the image's tarball into out (a docker archive).
func (b *imageBuilder) build(img image, work, out string) error {
	dir := filepath.Join(work, "rootfs")
	os.RemoveAll(dir)
	for _, d := range []string{"etc", "tmp", "proc", "sys", "dev", "var/run", "root"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return err
		}
	}
	if err := os.Chmod(filepath.Join(dir, "tmp"), 0o1777); err != nil {
		return err
	}
	base := map[string]string{
		"etc/passwd":        "root:x:0:0:root:/root:/bin/sh\nuser-defined-in-image:x:1000:1000::/home/user:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
		"etc/group":         "root:x:0:\ngroup-defined-in-image:x:50000:user-defined-in-image\nnogroup:x:65534:\n",
		"etc/nsswitch.conf": "hosts: files dns\npasswd: files\ngroup: files\n",
	}
	for p, data := range base {
		if err := os.WriteFile(filepath.Join(dir, p), []byte(data), 0o644); err != nil {
			return err
		}
	}
	if err := img.fill(b, dir); err != nil {
		return fmt.Errorf("image %s: %w", img.ref, err)
	}
	return run("", filepath.Join(b.k8sBin, "mkimage"), "-dir", dir, "-tag", img.ref,
		"-entrypoint", img.entrypoint, "-cmd", img.cmd, "-o", out)
}

// addProgram copies a built program to dst in the root file system with
// the shared libraries it links (a Go program that uses cgo's resolver
// needs libc and the loader).
func addProgram(root, src, dst string) error {
	if err := copyFile(src, filepath.Join(root, dst)); err != nil {
		return err
	}
	libs, err := sharedLibs(src)
	if err != nil {
		return err
	}
	return hostFiles(root, libs...)
}

// hostFiles copies host files into the root file system at the same
// paths, with the shared libraries (and loader) each one links; a symlink
// stays a symlink and its target comes along.
func hostFiles(root string, paths ...string) error {
	seen := map[string]bool{}
	var add func(p string) error
	add = func(p string) error {
		if seen[p] {
			return nil
		}
		seen[p] = true
		fi, err := os.Lstat(p)
		if err != nil {
			return fmt.Errorf("host file: %w", err)
		}
		dst := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return err
		}
		if fi.Mode()&os.ModeSymlink != 0 {
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			os.Remove(dst)
			if err := os.Symlink(target, dst); err != nil {
				return err
			}
			if !filepath.IsAbs(target) {
				target = filepath.Join(filepath.Dir(p), target)
			}
			return add(target)
		}
		if err := copyFile(p, dst); err != nil {
			return err
		}
		libs, err := sharedLibs(p)
		if err != nil {
			return err
		}
		for _, l := range libs {
			if err := add(l); err != nil {
				return err
			}
		}
		return nil
	}
	for _, p := range paths {
		if err := add(p); err != nil {
			return err
		}
	}
	return nil
}

var lddPath = regexp.MustCompile(`(/[^ ]+) \(0x`)

// sharedLibs lists what ldd says p links (nothing for a static program).
func sharedLibs(p string) ([]string, error) {
	out, err := exec.Command("ldd", p).CombinedOutput()
	if err != nil {
		if bytes.Contains(out, []byte("not a dynamic executable")) {
			return nil, nil
		}
		return nil, fmt.Errorf("ldd %s: %w: %s", p, err, out)
	}
	var libs []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if m := lddPath.FindStringSubmatch(sc.Text()); m != nil {
			libs = append(libs, m[1])
		}
	}
	return libs, nil
}

// busyboxApplets adds Debian's static busybox and a link for each applet
// the image has no real program for (sleep, cat, grep, test, …).
func busyboxApplets(root string) error {
	bb := filepath.Join(root, "bin/busybox")
	if err := os.MkdirAll(filepath.Dir(bb), 0o755); err != nil {
		return err
	}
	if err := copyFile("/bin/busybox", bb); err != nil {
		return err
	}
	out, err := exec.Command("/bin/busybox", "--list-full").Output()
	if err != nil {
		return fmt.Errorf("busybox --list-full: %w", err)
	}
	for _, applet := range strings.Fields(string(out)) {
		dst := filepath.Join(root, applet)
		if _, err := os.Lstat(dst); err == nil {
			continue
		}
		if _, err := os.Lstat(filepath.Join(root, "usr", applet)); err == nil {
			continue // merged /usr: /bin/x is /usr/bin/x on Debian
		}
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return err
		}
		if err := os.Symlink("/bin/busybox", dst); err != nil {
			return err
		}
	}
	return nil
}

func copyFile(src, dst string) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	fi, err := os.Stat(src)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	return os.WriteFile(dst, data, fi.Mode().Perm())
}

// run runs a command in dir, its output folded into the error.
func run(dir, name string, args ...string) error {
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}
