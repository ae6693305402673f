// Command basickernel runs the daemon as on a kernel without netfilter
// extras, for the second leg of the end-to-end tests (KUP_E2E_KERNEL=basic,
// test/e2e/lab_test.go): installed under the daemon's name, it execs
// NAME.real with --iptables-basic-only added (no comment, addrtype or
// conntrack match) under a seccomp filter that fails socket(AF_NETLINK,
// …, NETLINK_NETFILTER) with EPROTONOSUPPORT, the kernel's own answer
// where nfnetlink is not built: no conntrack netlink, so no source NAT,
// no UDP guard, no deletion of stale UDP entries. The filter is inherited
// by every process the daemon starts (the keeper's workers, iptables),
// which is why the leg uses the legacy iptables binaries (x_tables, no
// netlink). Test-only: the production build has no way to do any of this.
package main

import (
	"fmt"
	"os"
	"runtime"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

func main() {
	exe, err := os.Executable()
	if err != nil {
		fail(err)
	}
	args := append([]string{os.Args[0]}, os.Args[1:]...)
	if len(args) < 2 || args[1] != "explain" {
		args = append(args, "--iptables-basic-only")
	}
	if err := denyNetfilterNetlink(); err != nil {
		fail(fmt.Errorf("installing the seccomp filter: %w", err))
	}
	fail(syscall.Exec(exe+".real", args, os.Environ()))
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "basickernel: %v\n", err)
	os.Exit(127)
}

// denyNetfilterNetlink installs the filter on every thread of the process
// (it survives exec).
func denyNetfilterNetlink() error {
	arch := map[string]uint32{"amd64": 0xc000003e, "arm64": 0xc00000b7}[runtime.GOARCH] // AUDIT_ARCH_*
	if arch == 0 {
		return fmt.Errorf("no seccomp architecture for %s", runtime.GOARCH)
	}
	const (
		ldAbs  = unix.BPF_LD | unix.BPF_W | unix.BPF_ABS
		jeq    = unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K
		ret    = unix.BPF_RET | unix.BPF_K
		offNr  = 0  // struct seccomp_data: int nr
		offArc = 4  // __u32 arch
		offA0  = 16 // __u64 args[6], low words (little-endian)
		offA2  = 32
	)
	prog := []unix.SockFilter{
		{Code: ldAbs, K: offArc},
		{Code: jeq, K: arch, Jt: 0, Jf: 6},
		{Code: ldAbs, K: offNr},
		{Code: jeq, K: unix.SYS_SOCKET, Jt: 0, Jf: 4},
		{Code: ldAbs, K: offA0},
		{Code: jeq, K: unix.AF_NETLINK, Jt: 0, Jf: 2},
		{Code: ldAbs, K: offA2},
		{Code: jeq, K: unix.NETLINK_NETFILTER, Jt: 1, Jf: 0},
		{Code: ret, K: unix.SECCOMP_RET_ALLOW},
		{Code: ret, K: unix.SECCOMP_RET_ERRNO | uint32(unix.EPROTONOSUPPORT)},
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("PR_SET_NO_NEW_PRIVS: %w", err)
	}
	if _, _, errno := unix.Syscall(
		unix.SYS_SECCOMP,
		unix.SECCOMP_SET_MODE_FILTER,
		unix.SECCOMP_FILTER_FLAG_TSYNC,
		uintptr(unsafe.Pointer(&fprog)),
	); errno != 0 {
		return fmt.Errorf("seccomp: %w", errno)
	}
	return nil
}
