package clientaddr

import (
	"net/netip"
	"testing"
	"time"
)

func TestNodeAddrs(t *testing.T) {
	var n nodeAddrs
	if !n.has(netip.MustParseAddr("127.0.0.1")) {
		t.Fatal("127.0.0.1 is not taken for one of the node's addresses")
	}
	first := n.snap.Load()
	// 192.0.2.0/24 is for documentation: no interface has it.
	if n.has(netip.MustParseAddr("192.0.2.77")) {
		t.Fatal("192.0.2.77 is taken for one of the node's addresses")
	}
	if n.snap.Load() != first {
		t.Fatal("a miss within nodeAddrsMissTTL read the addresses again")
	}
	// A miss after it reads them again (an address added since is found).
	n.snap.Store(&addrSnapshot{read: time.Now().Add(-2 * nodeAddrsMissTTL), addrs: first.addrs})
	if n.has(netip.MustParseAddr("192.0.2.77")) {
		t.Fatal("192.0.2.77 is taken for one of the node's addresses")
	}
	if s := n.snap.Load(); s == first || time.Since(s.read) > nodeAddrsMissTTL {
		t.Fatal("a miss after nodeAddrsMissTTL did not read the addresses again")
	}
	// An address found is found without reading them again.
	n.snap.Store(&addrSnapshot{read: time.Now().Add(-time.Hour), addrs: []netip.Addr{netip.MustParseAddr("192.0.2.78")}})
	stale := n.snap.Load()
	if !n.has(netip.MustParseAddr("192.0.2.78")) || n.snap.Load() != stale {
		t.Fatal("a hit read the addresses again")
	}
}
