package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// engines runs a test against both engines.
func engines(t *testing.T, test func(t *testing.T, engine string)) {
	for _, e := range []string{"epoll", "ring"} {
		t.Run(e, func(t *testing.T) { test(t, e) })
	}
}

// startFloor runs one loop of engine that proxies a fresh listener to
// backend, and returns the listener's address.
func startFloor(t *testing.T, engine string, backend netip.AddrPort) string {
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
	routes := []route{{fd: fd, backend: &unix.SockaddrInet4{Addr: backend.Addr().As4(), Port: int(backend.Port())}}}
	var l eventLoop
	if engine == "ring" {
		l, err = newRingLoop(routes)
	} else {
		l, err = newLoop(routes)
	}
	runLoop(t, l, err)
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(sa.(*unix.SockaddrInet4).Port))
}

// runLoop runs l (made with err) until the test ends, and fails the test
// if it ends with an error.
func runLoop(t *testing.T, l eventLoop, err error) {
	t.Helper()
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
}

// TestProxiesBothWaysWithHalfClose: a request, the client's FIN passed on,
// then the backend's whole reply (larger than a pipe's first splice) and
// its FIN.
func TestProxiesBothWaysWithHalfClose(t *testing.T) { engines(t, proxiesBothWaysWithHalfClose) }

func proxiesBothWaysWithHalfClose(t *testing.T, engine string) {
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
	addr := startFloor(t, engine, netip.MustParseAddrPort(ln.Addr().String()))

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
func TestRefusedBackendResetsClient(t *testing.T) { engines(t, refusedBackendResetsClient) }

func refusedBackendResetsClient(t *testing.T, engine string) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := netip.MustParseAddrPort(ln.Addr().String())
	ln.Close() // the port is now refused
	addr := startFloor(t, engine, dead)

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

// TestManyConnectionsAndASlowReader: 100 echo connections at once while
// another connection's client does not read a 48 MiB reply for a while (the
// ring engine's buffers run out: receives wait for buffers to come back),
// then reads it all. Every byte arrives, in order, on every connection.
func TestManyConnectionsAndASlowReader(t *testing.T) { engines(t, manyConnectionsAndASlowReader) }

func manyConnectionsAndASlowReader(t *testing.T, engine string) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	const big = 48 << 20
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				var first [1]byte
				if _, err := io.ReadFull(c, first[:]); err != nil {
					return
				}
				if first[0] == 'B' { // the big reply
					buf := make([]byte, 1<<20)
					for i := range buf {
						buf[i] = byte(i)
					}
					for sent := 0; sent < big; sent += len(buf) {
						if _, err := c.Write(buf); err != nil {
							return
						}
					}
					return
				}
				_, _ = c.Write(first[:])
				_, _ = io.Copy(c, c) // echo until the client's FIN
			}()
		}
	}()
	addr := startFloor(t, engine, netip.MustParseAddrPort(ln.Addr().String()))

	slow, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	_ = slow.SetDeadline(time.Now().Add(60 * time.Second))
	if _, err := slow.Write([]byte("B")); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 100)
	for i := range 100 {
		go func() {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(60 * time.Second))
			msg := make([]byte, 64<<10)
			for j := range msg {
				msg[j] = byte(i + j)
			}
			go func() { _, _ = c.Write(append([]byte("e"), msg...)); _ = c.(*net.TCPConn).CloseWrite() }()
			got, err := io.ReadAll(c)
			if err != nil {
				errs <- fmt.Errorf("echo %d: %w", i, err)
				return
			}
			if string(got) != "e"+string(msg) {
				errs <- fmt.Errorf("echo %d: got %d bytes, want %d, or other bytes", i, len(got), len(msg)+1)
				return
			}
			errs <- nil
		}()
	}
	time.Sleep(200 * time.Millisecond) // the slow client holds back; the echoes go on meanwhile
	n := 0
	buf := make([]byte, 1<<20)
	for n < big {
		m, err := slow.Read(buf)
		for k := range m {
			if buf[k] != byte((n+k)%(1<<20)) {
				t.Fatalf("big reply: byte %d is %d", n+k, buf[k])
			}
		}
		n += m
		if err != nil {
			t.Fatalf("big reply after %d bytes: %v", n, err)
		}
	}
	for range 100 {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

// TestRingOutOfBuffers: the same with a ring of 8 buffers, which the slow
// reader's queue takes whole: the other connections' receives end for want
// of buffers and must be armed again when buffers come back.
func TestRingOutOfBuffers(t *testing.T) {
	defer func(n int) { ringBuffers = n }(ringBuffers)
	ringBuffers = 8
	manyConnectionsAndASlowReader(t, "ring")
}
