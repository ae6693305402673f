// Package proxyproto encodes the PROXY protocol header toward backends
// (haproxy.org/download/2.6/doc/proxy-protocol.txt):
// a header sent on the backend connection before any client byte, carrying
// the client's address and the address the client connected to, so that a
// backend that parses it (nginx, HAProxy, Envoy, Postgres poolers, mail
// servers) sees the client instead of the node. Opt-in per Service with the
// annotation kube-userspace-proxy.io/proxy-protocol: "v1" or "v2".
//
// It owns nothing and imports nothing of this project.
package proxyproto

import (
	"encoding/binary"
	"fmt"
	"net/netip"
)

// PROXY protocol versions, as the annotation gives them.
const (
	V1 = "v1"
	V2 = "v2"
)

// v2Signature starts every version 2 header.
var v2Signature = []byte("\r\n\r\n\x00\r\nQUIT\n")

// Header returns the header of version (v1 or v2) for a connection from
// src to dst (the original destination), or nil for another version. When
// the two addresses are not of one family (never, for a redirected
// connection), v1 says UNKNOWN and v2 LOCAL, as the specification asks.
func Header(version string, src, dst netip.AddrPort) []byte {
	src = netip.AddrPortFrom(src.Addr().Unmap(), src.Port())
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	same := src.Addr().Is4() == dst.Addr().Is4() && src.IsValid() && dst.IsValid()
	switch version {
	case V1:
		if !same {
			return []byte("PROXY UNKNOWN\r\n")
		}
		proto := "TCP4"
		if src.Addr().Is6() {
			proto = "TCP6"
		}
		return fmt.Appendf(nil, "PROXY %s %s %s %d %d\r\n", proto, src.Addr(), dst.Addr(), src.Port(), dst.Port())
	case V2:
		h := append([]byte(nil), v2Signature...)
		if !same {
			return append(h, 0x20, 0x00, 0, 0) // version 2, LOCAL; no address
		}
		h = append(h, 0x21) // version 2, PROXY
		if src.Addr().Is4() {
			h = append(h, 0x11, 0, 12) // TCP over IPv4, 12 address bytes
			s4, d4 := src.Addr().As4(), dst.Addr().As4()
			h = append(append(h, s4[:]...), d4[:]...)
		} else {
			h = append(h, 0x21, 0, 36) // TCP over IPv6, 36 address bytes
			s16, d16 := src.Addr().As16(), dst.Addr().As16()
			h = append(append(h, s16[:]...), d16[:]...)
		}
		h = binary.BigEndian.AppendUint16(h, src.Port())
		return binary.BigEndian.AppendUint16(h, dst.Port())
	}
	return nil
}

// Known reports whether v is "", v1 or v2.
func Known(v string) bool {
	return v == "" || v == V1 || v == V2
}
