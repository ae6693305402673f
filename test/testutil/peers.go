package testutil

// Misbehaving TCP peers on loopback, for the tests of the proxy and of its
// socket layer.

import (
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"
)

// ClosedPort returns a loopback port nobody listens on (connection refused).
func ClosedPort(t testing.TB) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ap := ln.Addr().(*net.TCPAddr).AddrPort()
	ln.Close()
	return ap
}

// Blackhole returns a loopback address whose SYNs are dropped, so that a
// dial times out: a listener with a full accept queue that never accepts.
func Blackhole(t testing.TB) netip.AddrPort {
	ap, _ := FullListener(t)
	return ap
}

// FullListener is Blackhole's listener: new SYNs are dropped until one of
// the queued connections is taken with accept(fd). Both go with the test.
func FullListener(t testing.TB) (netip.AddrPort, int) {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, _ := syscall.Getsockname(fd)
	ap := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(sa.(*syscall.SockaddrInet4).Port))
	var fillers []net.Conn
	t.Cleanup(func() {
		for _, c := range fillers {
			c.Close()
		}
		syscall.Close(fd)
	})
	// Fill the accept queue until a dial no longer completes.
	for i := 0; i < 8; i++ {
		c, err := net.DialTimeout("tcp4", ap.String(), 200*time.Millisecond)
		if err != nil {
			return ap, fd
		}
		fillers = append(fillers, c)
	}
	t.Fatal("could not fill the accept queue of the blackhole listener")
	return ap, fd
}

// TCPState is the kernel's TCP state of c (tcpi_state: 1 ESTABLISHED,
// 7 CLOSE, 8 CLOSE_WAIT), or 0 when it cannot be read.
func TCPState(c syscall.Conn) byte {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0
	}
	var state int
	_ = raw.Control(func(fd uintptr) {
		// The first byte of struct tcp_info (little-endian in an int).
		v, err := syscall.GetsockoptInt(int(fd), syscall.IPPROTO_TCP, syscall.TCP_INFO)
		if err == nil {
			state = v & 0xff
		}
	})
	return byte(state)
}
