package clientaddr

// What the node's links and routes say of an address, for the source NAT
// (policy.go): which link it is on and whether that link is a bridge,
// which interface the node routes it by, and whether it is the node's own.

import (
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// nodeLinks are the node's connected prefixes by interface and its main
// routes, each read at most once every linksTTL: which link an address is
// on, whether that link is a bridge, and which interface routes it.
type nodeLinks struct {
	mu     sync.Mutex // guards the fields below
	read   time.Time  // of links
	routed time.Time  // of routes (read only for the interface modes)
	links  []kernel.Link
	routes []kernel.Route // the main table's, longest prefix first
}

const linksTTL = 10 * time.Second

// sameLink returns the link both addresses are on, if any.
func (n *nodeLinks) sameLink(a, b netip.Addr) (name string, bridge, ok bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if time.Since(n.read) > linksTTL {
		n.read = time.Now()
		if links, err := kernel.Links(); err == nil { // on an error the old ones stay
			n.links = links
		}
	}
	for _, l := range n.links {
		if slices.ContainsFunc(l.Prefixes, func(p netip.Prefix) bool { return p.Contains(a) }) &&
			slices.ContainsFunc(l.Prefixes, func(p netip.Prefix) bool { return p.Contains(b) }) {
			return l.Name, l.Bridge, true
		}
	}
	return "", false, false
}

// routeDev is the interface of the main table's route to addr.
func (n *nodeLinks) routeDev(addr netip.Addr) (string, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if time.Since(n.routed) > linksTTL {
		n.routed = time.Now()
		if routes, err := kernel.MainRoutes(); err == nil {
			n.routes = routes
		}
	}
	for _, r := range n.routes {
		if r.Dst.Contains(addr) {
			return r.Dev, true
		}
	}
	return "", false
}

// nodeAddrs are the node's own addresses: a client of a ClusterIP keeps
// its address on the dial (choiceBindIfLocal) only when it is one of them,
// so a client from elsewhere costs no bind that fails. A miss rereads
// them, at most once every nodeAddrsMissTTL, so an address added a moment
// ago is found after that long; before, its client's backend sees the
// node's address on the route, another of the node's own.
type nodeAddrs struct {
	snap   atomic.Pointer[addrSnapshot]
	reread sync.Mutex // one reader at a time; the others use the snapshot
}

type addrSnapshot struct {
	read  time.Time
	addrs []netip.Addr
}

const nodeAddrsMissTTL = time.Second

// has says whether addr is one of the node's addresses.
func (n *nodeAddrs) has(addr netip.Addr) bool {
	s := n.snap.Load()
	if s != nil && slices.Contains(s.addrs, addr) {
		return true
	}
	if s != nil && time.Since(s.read) < nodeAddrsMissTTL || !n.reread.TryLock() {
		return false
	}
	defer n.reread.Unlock()
	s = &addrSnapshot{read: time.Now(), addrs: kernel.Addrs()}
	n.snap.Store(s)
	return slices.Contains(s.addrs, addr)
}
