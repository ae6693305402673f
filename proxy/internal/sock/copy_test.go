package sock

import (
	"context"
	"io"
	"net"
	"testing"
	"time"
)

// sockPair returns a loopback TCP connection: the proxy's dialled end and
// the net package's accepted end.
func sockPair(tb testing.TB) (*Conn, *net.TCPConn) {
	tb.Helper()
	ln, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		tb.Fatal(err)
	}
	defer ln.Close()
	a, err := DialTCP(context.Background(), ln.Addr().(*net.TCPAddr).AddrPort(), time.Second)
	if err != nil {
		tb.Fatal(err)
	}
	b, err := ln.AcceptTCP()
	if err != nil {
		tb.Fatal(err)
	}
	return a, b
}

// BenchmarkSpliceCopyMessage sends one small message at a time through
// Copy and waits for it on the far side: the keep-alive pattern. Its
// allocs/op are the copier's allocations per message.
func BenchmarkSpliceCopyMessage(b *testing.B) {
	src, client := sockPair(b)
	dst, server := sockPair(b)
	done := make(chan error, 1)
	go func() {
		_, err := Copy(dst, src, func(int64) {})
		done <- err
	}()
	msg := make([]byte, 64)
	buf := make([]byte, 64)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := client.Write(msg); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(server, buf); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	client.Close()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	src.Close()
	dst.Close()
	server.Close()
}
