package sock

// Socket addresses in the kernel's layout, for the system calls the proxy
// makes itself. A unix.RawSockaddrInet6 is the storage
// for both families: a sockaddr_in fits in its first bytes.

import (
	"net/netip"
	"unsafe"

	"golang.org/x/sys/unix"
)

// putSockaddr writes ap into sa as a sockaddr_in (family 4) or sockaddr_in6
// (family 6; an IPv4 address becomes v4-mapped) and returns its length.
func putSockaddr(sa *unix.RawSockaddrInet6, ap netip.AddrPort, family int) uint32 {
	port := [2]byte{byte(ap.Port() >> 8), byte(ap.Port())} // network byte order
	if family == 4 {
		sa4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(sa))
		*sa4 = unix.RawSockaddrInet4{Family: unix.AF_INET, Addr: ap.Addr().Unmap().As4()}
		*(*[2]byte)(unsafe.Pointer(&sa4.Port)) = port
		return unix.SizeofSockaddrInet4
	}
	*sa = unix.RawSockaddrInet6{Family: unix.AF_INET6, Addr: ap.Addr().As16()}
	*(*[2]byte)(unsafe.Pointer(&sa.Port)) = port
	return unix.SizeofSockaddrInet6
}

// sockaddrAddrPort reads the sockaddr_in or sockaddr_in6 the kernel wrote
// into sa; IPv4-mapped addresses come back as IPv4.
func sockaddrAddrPort(sa *unix.RawSockaddrInet6) netip.AddrPort {
	port := func(p *uint16) uint16 { b := (*[2]byte)(unsafe.Pointer(p)); return uint16(b[0])<<8 | uint16(b[1]) }
	switch sa.Family {
	case unix.AF_INET:
		sa4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(sa))
		return netip.AddrPortFrom(netip.AddrFrom4(sa4.Addr), port(&sa4.Port))
	case unix.AF_INET6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr).Unmap(), port(&sa.Port))
	}
	return netip.AddrPort{}
}

// familyOf is 4 or 6, the socket family that serves ap.
func familyOf(ap netip.AddrPort) int {
	if ap.Addr().Is4() {
		return 4
	}
	return 6
}

// domain is the socket domain of family 4 or 6.
func domain(family int) int {
	if family == 4 {
		return unix.AF_INET
	}
	return unix.AF_INET6
}
