package proxy

// What the node's links and routes say of an address, for the source NAT
// (source.go): which link it is on and whether that link is a bridge,
// which interface the node routes it by, and whether it is the node's own.

import (
	"encoding/binary"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"
)

// nodeLinks are the node's connected prefixes by interface and its main
// routes, each read at most once every linksTTL: which link an address is
// on, whether that link is a bridge, and which interface routes it.
type nodeLinks struct {
	mu     sync.Mutex // guards the fields below
	read   time.Time  // of links
	routed time.Time  // of routes (read only for the interface modes)
	links  []nodeLink
	routes []nodeRoute // the main table's, longest prefix first
}

// nodeRoute is a route of the main table: its destination and the name of
// the interface it leaves by.
type nodeRoute struct {
	dst netip.Prefix
	dev string
}

type nodeLink struct {
	name     string
	bridge   bool
	prefixes []netip.Prefix
}

const linksTTL = 10 * time.Second

// sameLink returns the link both addresses are on, if any.
func (n *nodeLinks) sameLink(a, b netip.Addr) (name string, bridge, ok bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if time.Since(n.read) > linksTTL {
		n.refreshLinks()
	}
	for _, l := range n.links {
		if slices.ContainsFunc(l.prefixes, func(p netip.Prefix) bool { return p.Contains(a) }) &&
			slices.ContainsFunc(l.prefixes, func(p netip.Prefix) bool { return p.Contains(b) }) {
			return l.name, l.bridge, true
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
		if routes, err := mainRoutes(); err == nil {
			n.routes = routes
		}
	}
	for _, r := range n.routes {
		if r.dst.Contains(addr) {
			return r.dev, true
		}
	}
	return "", false
}

// mainRoutes reads the main routing table's unicast routes (both
// families), longest prefix first.
func mainRoutes() ([]nodeRoute, error) {
	rib, err := syscall.NetlinkRIB(syscall.RTM_GETROUTE, syscall.AF_UNSPEC)
	if err != nil {
		return nil, os.NewSyscallError("netlink route dump", err)
	}
	msgs, err := syscall.ParseNetlinkMessage(rib)
	if err != nil {
		return nil, err
	}
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, err
	}
	names := make(map[int]string, len(ifs))
	for _, ifc := range ifs {
		names[ifc.Index] = ifc.Name
	}
	var routes []nodeRoute
	for _, m := range msgs {
		if m.Header.Type != syscall.RTM_NEWROUTE || len(m.Data) < syscall.SizeofRtMsg {
			continue
		}
		rt := (*syscall.RtMsg)(unsafe.Pointer(&m.Data[0]))
		if rt.Type != syscall.RTN_UNICAST || (rt.Family != syscall.AF_INET && rt.Family != syscall.AF_INET6) {
			continue
		}
		attrs, err := syscall.ParseNetlinkRouteAttr(&m)
		if err != nil {
			continue
		}
		table, oif := uint32(rt.Table), -1
		dst := netip.IPv4Unspecified()
		if rt.Family == syscall.AF_INET6 {
			dst = netip.IPv6Unspecified()
		}
		for _, a := range attrs {
			switch a.Attr.Type {
			case syscall.RTA_TABLE:
				if len(a.Value) >= 4 {
					table = binary.NativeEndian.Uint32(a.Value)
				}
			case syscall.RTA_OIF:
				if len(a.Value) >= 4 {
					oif = int(binary.NativeEndian.Uint32(a.Value))
				}
			case syscall.RTA_DST:
				if d, ok := netip.AddrFromSlice(a.Value); ok {
					dst = d
				}
			}
		}
		dev, ok := names[oif]
		if table != syscall.RT_TABLE_MAIN || !ok {
			continue
		}
		if p, err := dst.Prefix(int(rt.Dst_len)); err == nil {
			routes = append(routes, nodeRoute{dst: p, dev: dev})
		}
	}
	slices.SortStableFunc(routes, func(a, b nodeRoute) int { return b.dst.Bits() - a.dst.Bits() })
	return routes, nil
}

// refreshLinks reads the interfaces' prefixes; on an error the old ones
// stay.
func (n *nodeLinks) refreshLinks() {
	n.read = time.Now()
	ifs, err := net.Interfaces()
	if err != nil {
		return
	}
	links := make([]nodeLink, 0, len(ifs))
	for _, ifc := range ifs {
		addrs, err := ifc.Addrs()
		if err != nil {
			continue
		}
		l := nodeLink{name: ifc.Name}
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok {
				if p, err := netip.ParsePrefix(ipn.String()); err == nil && p.Bits() < p.Addr().BitLen() {
					l.prefixes = append(l.prefixes, p.Masked())
				}
			}
		}
		if len(l.prefixes) > 0 {
			_, err := os.Stat("/sys/class/net/" + ifc.Name + "/bridge")
			l.bridge = err == nil
			links = append(links, l)
		}
	}
	n.links = links
}

// nodeAddrs are the node's own addresses: a client of a ClusterIP keeps
// its address on the dial (sourceBindIfLocal) only when it is one of them,
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
	s = &addrSnapshot{read: time.Now(), addrs: interfaceAddrs()}
	n.snap.Store(s)
	return slices.Contains(s.addrs, addr)
}

// interfaceAddrs are the addresses of the node's interfaces; none on an
// error (every client then dials from the node's address).
func interfaceAddrs() []netip.Addr {
	as, err := net.InterfaceAddrs()
	if err != nil {
		return nil
	}
	out := make([]netip.Addr, 0, len(as))
	for _, a := range as {
		if ipn, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(ipn.IP); ok {
				out = append(out, ip.Unmap())
			}
		}
	}
	return out
}
