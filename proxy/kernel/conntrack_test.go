package kernel

import (
	"net/netip"
	"os"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// What the UDP guard pays per new flow on a kernel without the conntrack
// match: one UDPOriginalDst, a netlink round trip (in a network namespace
// of its own; the entry does not exist, which costs the kernel the same
// hash lookup as one that does).
func BenchmarkConntrackUDPOriginalDst(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root: a network namespace of its own")
	}
	runtime.LockOSThread() // never unlocked: the thread ends with the benchmark
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		b.Fatal(err)
	}
	ct, err := OpenConntrack(1)
	if err != nil {
		b.Fatal(err)
	}
	defer ct.Close()
	local, peer := netip.MustParseAddrPort("192.0.2.1:53"), netip.MustParseAddrPort("192.0.2.2:40000")
	b.ReportAllocs()
	for b.Loop() {
		if _, found, err := ct.UDPOriginalDst(local, peer); err != nil || found {
			b.Fatal(found, err)
		}
	}
}
