package main

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// startFloor runs one loop that proxies a fresh listener to backend, and
// returns the listener's address.
func startFloor(t *testing.T, backend netip.AddrPort) string {
	t.Helper()
	fd, err := listen(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	sa, err := unix.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	l, err := newLoop([]route{{fd: fd, backend: &unix.SockaddrInet4{Addr: backend.Addr().As4(), Port: int(backend.Port())}}})
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
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(sa.(*unix.SockaddrInet4).Port))
}

// TestProxiesBothWaysWithHalfClose: a request, the client's FIN passed on,
// then the backend's whole reply (larger than a pipe's first splice) and
// its FIN.
func TestProxiesBothWaysWithHalfClose(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	reply := make([]byte, 3<<20)
	for i := range reply {
		reply[i] = byte(i * 7)
	}
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		req, _ := io.ReadAll(c) // until the client's FIN arrives through the floor
		if string(req) == "request" {
			_, _ = c.Write(reply)
		}
	}()
	addr := startFloor(t, netip.MustParseAddrPort(ln.Addr().String()))

	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := c.Write([]byte("request")); err != nil {
		t.Fatal(err)
	}
	_ = c.(*net.TCPConn).CloseWrite()
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("reading the reply: %v", err)
	}
	if len(got) != len(reply) || string(got) != string(reply) {
		t.Fatalf("reply: got %d bytes, want the backend's %d", len(got), len(reply))
	}
}

// TestRefusedBackendResetsClient: nothing listens at the backend, so the
// client's connection ends with a reset rather than hanging.
func TestRefusedBackendResetsClient(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := netip.MustParseAddrPort(ln.Addr().String())
	ln.Close() // the port is now refused
	addr := startFloor(t, dead)

	c, err := net.Dial("tcp", addr)
	if errors.Is(err, unix.ECONNRESET) {
		return // the reset came before the dial returned
	}
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	_, err = io.ReadAll(c)
	if !errors.Is(err, unix.ECONNRESET) {
		t.Fatalf("read: got %v, want a reset", err)
	}
}
