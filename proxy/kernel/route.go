package kernel

// What the node's links and main routing table say: read through the
// route netlink family with this package's one codec, and the links' names
// and addresses through the standard library.

import (
	"encoding/binary"
	"net"
	"net/netip"
	"os"
	"slices"

	"golang.org/x/sys/unix"
)

// Route is a unicast route of the main table: its destination and the
// interface it leaves by.
type Route struct {
	Dst netip.Prefix
	Dev string
}

// sizeofRtMsg is struct rtmsg's size: family, dst_len, src_len, tos,
// table, protocol, scope, type, flags.
const sizeofRtMsg = 12

// MainRoutes reads the main routing table's unicast routes of both
// families, longest prefix first.
func MainRoutes() ([]Route, error) {
	pool, err := OpenPool(unix.NETLINK_ROUTE, 1)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, err
	}
	names := make(map[int]string, len(ifs))
	for _, ifc := range ifs {
		names[ifc.Index] = ifc.Name
	}
	var routes []Route
	req := NewMessage(unix.RTM_GETROUTE, unix.NLM_F_DUMP, make([]byte, sizeofRtMsg)...) // AF_UNSPEC: both families
	err = pool.Do(req, func(msg []byte) {
		if binary.NativeEndian.Uint16(msg[4:]) != unix.RTM_NEWROUTE || len(msg) < unix.SizeofNlMsghdr+sizeofRtMsg {
			return
		}
		rt := msg[unix.SizeofNlMsghdr:]
		family, dstLen, table, typ := rt[0], int(rt[1]), uint32(rt[4]), rt[7]
		if typ != unix.RTN_UNICAST || (family != unix.AF_INET && family != unix.AF_INET6) {
			return
		}
		dst, oif := netip.IPv4Unspecified(), -1
		if family == unix.AF_INET6 {
			dst = netip.IPv6Unspecified()
		}
		EachAttr(rt[sizeofRtMsg:], func(t uint16, v []byte) bool {
			switch {
			case t == unix.RTA_TABLE && len(v) >= 4:
				table = binary.NativeEndian.Uint32(v)
			case t == unix.RTA_OIF && len(v) >= 4:
				oif = int(binary.NativeEndian.Uint32(v))
			case t == unix.RTA_DST:
				if d, ok := netip.AddrFromSlice(v); ok {
					dst = d
				}
			}
			return true
		})
		dev, ok := names[oif]
		if table != unix.RT_TABLE_MAIN || !ok {
			return
		}
		if p, err := dst.Prefix(dstLen); err == nil {
			routes = append(routes, Route{Dst: p, Dev: dev})
		}
	})
	if err != nil {
		return nil, os.NewSyscallError("netlink route dump", err)
	}
	slices.SortStableFunc(routes, func(a, b Route) int { return b.Dst.Bits() - a.Dst.Bits() })
	return routes, nil
}

// Link is one of the node's interfaces with its connected prefixes.
type Link struct {
	Name     string
	Bridge   bool
	Prefixes []netip.Prefix
}

// Links are the node's interfaces that have a connected prefix (an
// address with a mask shorter than its length), each said to be a bridge
// or not (its link kind, from the route netlink family).
func Links() ([]Link, error) {
	bridges, err := bridgeIndexes()
	if err != nil {
		return nil, err
	}
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, err
	}
	links := make([]Link, 0, len(ifs))
	for _, ifc := range ifs {
		addrs, err := ifc.Addrs()
		if err != nil {
			continue
		}
		l := Link{Name: ifc.Name, Bridge: bridges[ifc.Index]}
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok {
				if p, err := netip.ParsePrefix(ipn.String()); err == nil && p.Bits() < p.Addr().BitLen() {
					l.Prefixes = append(l.Prefixes, p.Masked())
				}
			}
		}
		if len(l.Prefixes) > 0 {
			links = append(links, l)
		}
	}
	return links, nil
}

// sizeofIfInfomsg is struct ifinfomsg's size: family, pad, type, index,
// flags, change.
const sizeofIfInfomsg = 16

// bridgeIndexes are the indexes of the links whose kind is bridge.
func bridgeIndexes() (map[int]bool, error) {
	pool, err := OpenPool(unix.NETLINK_ROUTE, 1)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	bridges := map[int]bool{}
	req := NewMessage(unix.RTM_GETLINK, unix.NLM_F_DUMP, make([]byte, sizeofIfInfomsg)...)
	err = pool.Do(req, func(msg []byte) {
		if binary.NativeEndian.Uint16(msg[4:]) != unix.RTM_NEWLINK || len(msg) < unix.SizeofNlMsghdr+sizeofIfInfomsg {
			return
		}
		ifi := msg[unix.SizeofNlMsghdr:]
		if string(Attr(ifi[sizeofIfInfomsg:], unix.IFLA_LINKINFO, unix.IFLA_INFO_KIND)) == "bridge\x00" {
			bridges[int(int32(binary.NativeEndian.Uint32(ifi[4:])))] = true
		}
	})
	if err != nil {
		return nil, os.NewSyscallError("netlink link dump", err)
	}
	return bridges, nil
}

// Addrs are the addresses of the node's interfaces (IPv4-mapped ones
// unmapped); none on an error.
func Addrs() []netip.Addr {
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
