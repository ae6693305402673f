package e2e

import (
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// A proxy port range inside the kernel's ephemeral range that the daemon
// cannot reserve (a read-only /proc/sys, as in an unprivileged container
// without the init container) is refused at start with the reason, before
// any rule is written; outside the ephemeral range the same daemon starts.
func TestProxyPortRangeInUnreservableEphemeralRangeRefused(t *testing.T) {
	l := NewLab(t)
	m := filepath.Join(t.TempDir(), "m.yaml")
	writeManifest(t, m, webManifest())
	l.MustExec("node", "sysctl", "-qw", "net.ipv4.ip_local_port_range=32768 60999")
	// A mount namespace of its own with /proc/sys read-only.
	args := func(portRange string) []string {
		return []string{"unshare", "-m", "sh", "-c",
			`mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && exec "$@"`, "sh",
			filepath.Join(binDir, "kube-userspace-proxy"), "--manifests", m, "--hostname-override", "node",
			"--admin-socket", filepath.Join(t.TempDir(), "a.sock"), "--handover-socket", filepath.Join(t.TempDir(), "h.sock"),
			"--proxy-port-range", portRange}
	}
	out, err := l.Exec("node", args("45000-45999")...)
	if err == nil || !strings.Contains(out, "overlaps the kernel's ephemeral port range 32768-60999") {
		t.Fatalf("exit %v:\n%s", err, tail(out, 2000))
	}
	if rules := l.MustExec("node", "iptables-save"); strings.Contains(rules, "KUBE-") {
		t.Fatalf("a refused start wrote rules:\n%s", rules)
	}
	d := l.Start("node", args("61000-61999")...)
	waitFor(t, "the daemon outside the ephemeral range to serve", func() bool { return strings.Contains(d.Output(), "msg=Started") })
	_ = d.Cmd.Process.Signal(syscall.SIGTERM)
	if err := d.Cmd.Wait(); err != nil {
		t.Fatalf("outside the ephemeral range: %v\n%s", err, tail(d.Output(), 2000))
	}
}
