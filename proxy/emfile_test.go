package proxy

import (
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// Running out of descriptors must make the proxy back off and recover, not
// panic (the classic proxier's choice) or spin.
func TestRecoversFromFileLimit(t *testing.T) {
	h := startProxier(t, Config{DialTimeouts: []time.Duration{time.Second}})
	h.apply(svc("fd", config.TCP, tcpBackend(t, "a")))
	addr := h.addr("fd")

	var orig unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &orig); err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir("/proc/self/fd")
	tight := orig
	tight.Cur = uint64(len(entries) + 8)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &tight); err != nil {
		t.Fatal(err)
	}
	restored := false
	restore := func() {
		if !restored {
			restored = true
			if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &orig); err != nil {
				t.Fatal(err)
			}
		}
	}
	defer restore()

	// Each proxied connection costs four descriptors in this one process
	// (client, accepted, dialled, backend's accepted): a few exhaust them.
	var clients []net.Conn
	for i := 0; i < 8; i++ {
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err != nil {
			break
		}
		clients = append(clients, c)
	}
	waitFor(t, "the proxy to hit the limit", func() bool {
		for _, e := range h.logs.entries() {
			if strings.Contains(e, "too many open files") {
				return true
			}
		}
		return false
	})
	restore()
	for _, c := range clients {
		c.Close()
	}
	// Recovered: new connections are proxied again.
	waitFor(t, "recovery", func() bool {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			return false
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		buf := make([]byte, 2)
		n, _ := c.Read(buf)
		return n == 2 && string(buf) == "a\n"
	})
}
