package proxyproto

import (
	"bytes"
	"net/netip"
	"testing"
)

// The specification's examples (section 2.1) and the layout of 2.2.
func TestProxyHeader(t *testing.T) {
	ap := netip.MustParseAddrPort
	if got := string(Header(V1, ap("192.168.0.1:56324"), ap("192.168.0.11:443"))); got != "PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n" {
		t.Errorf("v1 TCP4: %q", got)
	}
	if got := string(Header(V1, ap("[2001:db8::1]:56324"), ap("[2001:db8::11]:443"))); got != "PROXY TCP6 2001:db8::1 2001:db8::11 56324 443\r\n" {
		t.Errorf("v1 TCP6: %q", got)
	}
	if got := string(Header(V1, ap("192.168.0.1:1"), ap("[2001:db8::11]:443"))); got != "PROXY UNKNOWN\r\n" {
		t.Errorf("v1 mixed families: %q", got)
	}
	// v4-mapped addresses are IPv4.
	if got := string(Header(V1, ap("[::ffff:10.0.0.1]:5"), ap("10.96.0.10:80"))); got != "PROXY TCP4 10.0.0.1 10.96.0.10 5 80\r\n" {
		t.Errorf("v1 v4-mapped: %q", got)
	}
	want4 := append([]byte("\r\n\r\n\x00\r\nQUIT\n\x21\x11\x00\x0c"), 192, 168, 0, 1, 192, 168, 0, 11, 0xdc, 0x04, 0x01, 0xbb)
	if got := Header(V2, ap("192.168.0.1:56324"), ap("192.168.0.11:443")); !bytes.Equal(got, want4) {
		t.Errorf("v2 TCP4: % x\nwant      % x", got, want4)
	}
	got6 := Header(V2, ap("[2001:db8::1]:56324"), ap("[2001:db8::11]:443"))
	if len(got6) != 16+36 || got6[12] != 0x21 || got6[13] != 0x21 || got6[14] != 0 || got6[15] != 36 ||
		got6[16] != 0x20 || got6[31] != 1 || got6[47] != 0x11 || got6[48] != 0xdc || got6[51] != 0xbb {
		t.Errorf("v2 TCP6: % x", got6)
	}
	if got := Header(V2, ap("192.168.0.1:1"), ap("[2001:db8::11]:443")); !bytes.Equal(got, append([]byte("\r\n\r\n\x00\r\nQUIT\n"), 0x20, 0, 0, 0)) {
		t.Errorf("v2 LOCAL: % x", got)
	}
	if Header("v3", ap("192.168.0.1:1"), ap("192.168.0.11:443")) != nil || Header("", ap("192.168.0.1:1"), ap("192.168.0.11:443")) != nil {
		t.Error("a header for an unknown version")
	}
}

// proxyBackend answers each connection with the first line it got (the PROXY
// v1 header, or for v2 its length and the bytes after the signature).
