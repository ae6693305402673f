package proxy

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// The specification's examples (section 2.1) and the layout of 2.2.
func TestProxyHeader(t *testing.T) {
	ap := netip.MustParseAddrPort
	if got := string(proxyHeader(ProxyProtocolV1, ap("192.168.0.1:56324"), ap("192.168.0.11:443"))); got != "PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n" {
		t.Errorf("v1 TCP4: %q", got)
	}
	if got := string(proxyHeader(ProxyProtocolV1, ap("[2001:db8::1]:56324"), ap("[2001:db8::11]:443"))); got != "PROXY TCP6 2001:db8::1 2001:db8::11 56324 443\r\n" {
		t.Errorf("v1 TCP6: %q", got)
	}
	if got := string(proxyHeader(ProxyProtocolV1, ap("192.168.0.1:1"), ap("[2001:db8::11]:443"))); got != "PROXY UNKNOWN\r\n" {
		t.Errorf("v1 mixed families: %q", got)
	}
	// v4-mapped addresses are IPv4.
	if got := string(proxyHeader(ProxyProtocolV1, ap("[::ffff:10.0.0.1]:5"), ap("10.96.0.10:80"))); got != "PROXY TCP4 10.0.0.1 10.96.0.10 5 80\r\n" {
		t.Errorf("v1 v4-mapped: %q", got)
	}
	want4 := append([]byte("\r\n\r\n\x00\r\nQUIT\n\x21\x11\x00\x0c"), 192, 168, 0, 1, 192, 168, 0, 11, 0xdc, 0x04, 0x01, 0xbb)
	if got := proxyHeader(ProxyProtocolV2, ap("192.168.0.1:56324"), ap("192.168.0.11:443")); !bytes.Equal(got, want4) {
		t.Errorf("v2 TCP4: % x\nwant      % x", got, want4)
	}
	got6 := proxyHeader(ProxyProtocolV2, ap("[2001:db8::1]:56324"), ap("[2001:db8::11]:443"))
	if len(got6) != 16+36 || got6[12] != 0x21 || got6[13] != 0x21 || got6[14] != 0 || got6[15] != 36 ||
		got6[16] != 0x20 || got6[31] != 1 || got6[47] != 0x11 || got6[48] != 0xdc || got6[51] != 0xbb {
		t.Errorf("v2 TCP6: % x", got6)
	}
	if got := proxyHeader(ProxyProtocolV2, ap("192.168.0.1:1"), ap("[2001:db8::11]:443")); !bytes.Equal(got, append([]byte("\r\n\r\n\x00\r\nQUIT\n"), 0x20, 0, 0, 0)) {
		t.Errorf("v2 LOCAL: % x", got)
	}
	if proxyHeader("v3", ap("192.168.0.1:1"), ap("192.168.0.11:443")) != nil || proxyHeader("", ap("192.168.0.1:1"), ap("192.168.0.11:443")) != nil {
		t.Error("a header for an unknown version")
	}
}

// proxyBackend answers each connection with the first line it got (the PROXY
// v1 header, or for v2 its length and the bytes after the signature).
func proxyBackend(t *testing.T) netip.AddrPort {
	t.Helper()
	return serveBackend(t, func(c net.Conn, _ <-chan struct{}) {
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		buf := make([]byte, 256)
		n, _ := io.ReadAtLeast(c, buf, 16)
		fmt.Fprintf(c, "%q\n", buf[:n])
	})
}

// The header goes out before any client byte, with the client's address and
// the address it connected to; after a failed dial it goes to the next
// endpoint too.
func TestProxyProtocolToBackend(t *testing.T) {
	for _, v := range []string{ProxyProtocolV1, ProxyProtocolV2} {
		t.Run(v, func(t *testing.T) {
			h := startProxier(t, Config{DialTimeouts: []time.Duration{time.Second, time.Second}})
			sp := svc("pp", config.TCP, closedPort(t), proxyBackend(t))
			sp.ProxyProtocol = v
			h.apply(sp)
			for i := 0; i < 2; i++ { // one of them retries past the closed port
				c, err := net.Dial("tcp", h.addr("pp"))
				if err != nil {
					t.Fatal(err)
				}
				_ = c.SetDeadline(time.Now().Add(10 * time.Second))
				client, listen := c.LocalAddr().(*net.TCPAddr).AddrPort(), c.RemoteAddr().(*net.TCPAddr).AddrPort()
				want := proxyHeader(v, client, listen)
				line, err := bufio.NewReader(c).ReadString('\n')
				c.Close()
				if err != nil || line != fmt.Sprintf("%q\n", want) {
					t.Fatalf("backend got %s, want %q (%v)", line, want, err)
				}
			}
		})
	}
}
