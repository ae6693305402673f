package main

import (
	"bytes"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// startUDPFloor runs one UDP loop proxying a free loopback port to backend
// and returns the port's address.
func startUDPFloor(t *testing.T, backend netip.AddrPort) *net.UDPAddr {
	t.Helper()
	// A free port: bind one, note it, close it (the loop binds its own with SO_REUSEPORT).
	probe, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	port := probe.LocalAddr().(*net.UDPAddr).Port
	probe.Close()
	l, err := newUDPLoop([]udpRoute{{port: port, backend: unix.SockaddrInet4{Addr: backend.Addr().As4(), Port: int(backend.Port())}}})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- l.run() }()
	t.Cleanup(func() {
		_ = l.stop()
		if err := <-done; err != nil {
			t.Errorf("loop ended with %v", err)
		}
	})
	return &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port}
}

// udpEcho answers each datagram with the peer's address and the datagram,
// so that a client can see that its flow has a backend socket of its own.
func udpEcho(t *testing.T) netip.AddrPort {
	t.Helper()
	c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	go func() {
		buf := make([]byte, 65536)
		for {
			n, from, err := c.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			_, _ = c.WriteToUDPAddrPort(append([]byte(from.String()+" "), buf[:n]...), from)
		}
	}()
	return c.LocalAddr().(*net.UDPAddr).AddrPort()
}

// TestUDPFlowsKeepTheirOwnBackendSocket: two clients send bursts through
// the floor (more than one recvmmsg's worth at once, interleaved); each gets
// every answer to its own datagrams and none of the other's, and the
// backend saw each client as one peer of its own.
func TestUDPFlowsKeepTheirOwnBackendSocket(t *testing.T) {
	floor := startUDPFloor(t, udpEcho(t))
	const n = 3 * udpBatch
	var clients [2]*net.UDPConn
	for i := range clients {
		c, err := net.DialUDP("udp4", nil, floor)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		clients[i] = c
	}
	for k := range n {
		for i, c := range clients {
			if _, err := c.Write([]byte(fmt.Sprintf("client %d datagram %d", i, k))); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i, c := range clients {
		peers := map[string]bool{}
		seen := map[string]bool{}
		buf := make([]byte, 65536)
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		for len(seen) < n {
			m, err := c.Read(buf)
			if err != nil {
				t.Fatalf("client %d: %d of %d answers, then %v", i, len(seen), n, err)
			}
			peer, body, _ := bytes.Cut(buf[:m], []byte(" "))
			if want := fmt.Sprintf("client %d ", i); !bytes.HasPrefix(body, []byte(want)) {
				t.Fatalf("client %d got %q", i, body)
			}
			peers[string(peer)] = true
			seen[string(body)] = true
		}
		if len(peers) != 1 {
			t.Errorf("client %d: the backend saw it from %d addresses: %v", i, len(peers), peers)
		}
	}
}

// TestUDPLargeDatagramWhole: a 60 000-byte datagram passes whole both ways.
func TestUDPLargeDatagramWhole(t *testing.T) {
	floor := startUDPFloor(t, udpEcho(t))
	c, err := net.DialUDP("udp4", nil, floor)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	big := bytes.Repeat([]byte("x"), 60000)
	if _, err := c.Write(big); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 65536)
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	m, err := c.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	_, body, _ := bytes.Cut(buf[:m], []byte(" "))
	if !bytes.Equal(body, big) {
		t.Fatalf("got %d bytes back, want the %d sent", len(body), len(big))
	}
}
