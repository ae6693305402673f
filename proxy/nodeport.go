package proxy

import (
	"fmt"
	"net/netip"

	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// holdPort binds a socket to ap without listening on it, so that no other
// process can take the port while nothing answers on it directly: a
// connection that slips past the rules is refused rather than served on an
// address --nodeport-addresses excludes.
func holdPort(proto config.Protocol, ap netip.AddrPort) (int, error) {
	domain := unix.AF_INET6
	var sa unix.Sockaddr = &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
	if ap.Addr().Is4() {
		domain = unix.AF_INET
		sa = &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	}
	typ := unix.SOCK_STREAM
	if proto == config.UDP {
		typ = unix.SOCK_DGRAM
	}
	fd, err := unix.Socket(domain, typ|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("socket: %w", err)
	}
	if domain == unix.AF_INET6 {
		_ = unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 1)
	}
	if err := unix.Bind(fd, sa); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("bind %s: %w", ap, err)
	}
	return fd, nil
}

func closeHold(fd int) {
	if fd >= 0 {
		unix.Close(fd)
	}
}
