package proxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/proxyproto"
)

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
	for _, v := range []string{proxyproto.V1, proxyproto.V2} {
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
				want := proxyproto.Header(v, client, listen)
				line, err := bufio.NewReader(c).ReadString('\n')
				c.Close()
				if err != nil || line != fmt.Sprintf("%q\n", want) {
					t.Fatalf("backend got %s, want %q (%v)", line, want, err)
				}
			}
		})
	}
}
