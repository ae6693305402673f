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

// startUDPFloor runs one UDP loop proxying a free loopback port to each
// backend and returns the ports' addresses, in order.
func startUDPFloor(t *testing.T, backends ...netip.AddrPort) []*net.UDPAddr {
	t.Helper()
	var routes []udpRoute
	var addrs []*net.UDPAddr
	for _, be := range backends {
		port := freeUDPPort(t)
		routes = append(routes, udpRoute{port: port, backend: unix.SockaddrInet4{Addr: be.Addr().As4(), Port: int(be.Port())}})
		addrs = append(addrs, &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port})
	}
	l, err := newUDPLoop(routes)
	runLoop(t, l, err)
	return addrs
}

// freeUDPPort is a loopback UDP port nothing listens on: bound, noted and
// closed again.
func freeUDPPort(t *testing.T) int {
	t.Helper()
	probe, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer probe.Close()
	return probe.LocalAddr().(*net.UDPAddr).Port
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
	floor := startUDPFloor(t, udpEcho(t))[0]
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
			if _, err := fmt.Fprintf(c, "client %d datagram %d", i, k); err != nil {
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
	floor := startUDPFloor(t, udpEcho(t))[0]
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

// TestUDPDeadBackendPortLeavesTheLoopServing: a route whose backend port is
// dead (each datagram comes back as an ICMP port unreachable, an error on
// the flow's socket) neither stops nor stalls the loop: a client of the
// loop's other route gets every answer, within a bound.
func TestUDPDeadBackendPortLeavesTheLoopServing(t *testing.T) {
	dead := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(freeUDPPort(t)))
	floors := startUDPFloor(t, dead, udpEcho(t))
	toDead, err := net.DialUDP("udp4", nil, floors[0])
	if err != nil {
		t.Fatal(err)
	}
	defer toDead.Close()
	live, err := net.DialUDP("udp4", nil, floors[1])
	if err != nil {
		t.Fatal(err)
	}
	defer live.Close()
	buf := make([]byte, 65536)
	for k := range 20 {
		if _, err := toDead.Write([]byte("lost")); err != nil {
			t.Fatal(err)
		}
		msg := fmt.Sprintf("answer %d", k)
		if _, err := live.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		_ = live.SetReadDeadline(time.Now().Add(5 * time.Second))
		n, err := live.Read(buf)
		if err != nil {
			t.Fatalf("datagram %d beside a dead backend port: no answer within 5 s: %v", k, err)
		}
		if _, body, _ := bytes.Cut(buf[:n], []byte(" ")); string(body) != msg {
			t.Fatalf("got %q, want %q", body, msg)
		}
	}
}
