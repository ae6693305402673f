package kernel

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestSysctls(t *testing.T) {
	s := Sysctls{Root: t.TempDir()}
	if got, want := s.Path("net.ipv4.ip_local_port_range"), filepath.Join(s.Root, "net/ipv4/ip_local_port_range"); got != want {
		t.Fatalf("path %q, want %q", got, want)
	}
	if got := (Sysctls{}).Path("net.core.somaxconn"); got != "/proc/sys/net/core/somaxconn" {
		t.Fatalf("the node's path %q", got)
	}
	if _, err := s.Read("net.netfilter.nf_conntrack_max"); !errors.Is(err, ErrNoSysctl) {
		t.Fatalf("a missing setting: %v, want ErrNoSysctl", err)
	}
	if _, err := s.SetInt("net.netfilter.nf_conntrack_max", 1); !errors.Is(err, ErrNoSysctl) {
		t.Fatalf("setting a missing one: %v, want ErrNoSysctl", err)
	}
	p := s.Path("net.netfilter.nf_conntrack_max")
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(p, []byte("65536\n"), 0o644)
	for _, step := range []struct {
		set     int
		changed bool
	}{{65536, false}, {131072, true}, {131072, false}} {
		changed, err := s.SetInt("net.netfilter.nf_conntrack_max", step.set)
		if err != nil || changed != step.changed {
			t.Fatalf("set %d: changed %v, %v; want changed %v", step.set, changed, err, step.changed)
		}
		if got, err := s.ReadInt("net.netfilter.nf_conntrack_max"); err != nil || got != step.set {
			t.Fatalf("read back %d, %v; want %d", got, err, step.set)
		}
	}
	os.WriteFile(p, []byte("lots\n"), 0o644)
	if _, err := s.ReadInt("net.netfilter.nf_conntrack_max"); err == nil {
		t.Fatal("a value that is no number read as one")
	}
	if !s.Writable("net.netfilter.nf_conntrack_max") || s.Writable("net.netfilter.missing") {
		t.Fatal("Writable")
	}
}
