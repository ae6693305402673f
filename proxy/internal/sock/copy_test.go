package sock

import (
	"context"
	"io"
	"net"
	"sync/atomic"
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
		_, err := Copy(dst, src, func(int64) {}, 0)
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

// Under backpressure (a reader slower than the writer) a bulk transfer keeps
// the copy in one long splice burst; its bytes must be counted as they land,
// not when the burst ends (which was the end of the transfer).
func TestCopyCountsUnderBackpressure(t *testing.T) {
	src, client := sockPair(t)
	dst, server := sockPair(t)
	defer func() { src.Close(); dst.Close(); client.Close(); server.Close() }()
	var counted atomic.Int64
	done := make(chan struct{})
	go func() {
		_, _ = Copy(dst, src, func(n int64) { counted.Add(n) }, 0)
		close(done)
	}()
	const total = 32 << 20
	go func() {
		_, _ = client.Write(make([]byte, total))
		client.CloseWrite()
	}()
	// The reader takes 256 KiB every 20 ms: the transfer lasts seconds.
	seenMoving := 0
	last := int64(0)
	buf := make([]byte, 256<<10)
	read := 0
	for read < total {
		_ = server.SetReadDeadline(time.Now().Add(10 * time.Second))
		n, err := io.ReadFull(server, buf[:min(len(buf), total-read)])
		if err != nil {
			t.Fatalf("after %d bytes: %v", read, err)
		}
		read += n
		if c := counted.Load(); c > last && read < total/2 {
			select {
			case <-done:
			default:
				seenMoving++ // counted while the copy still runs
			}
			last = c
		}
		time.Sleep(20 * time.Millisecond)
	}
	if seenMoving < 5 || last < 1<<20 {
		t.Fatalf("the count moved %d times (to %d bytes) during the first half of a %d-byte transfer", seenMoving, last, total)
	}
	<-done
	if c := counted.Load(); c != total {
		t.Fatalf("counted %d, moved %d", c, total)
	}
}

// Acked follows what the peer took in: nothing while it reads nothing,
// every byte once it has read them all, and no answer once closed.
func TestAckedFollowsThePeer(t *testing.T) {
	a, b := sockPair(t)
	defer b.Close()
	if n, ok := a.Acked(); !ok || n != 0 {
		t.Fatalf("before any write: %d %v", n, ok)
	}
	msg := make([]byte, 300<<10)
	go func() { _ = a.WriteAll(msg) }()
	got, err := io.ReadFull(b, make([]byte, len(msg)))
	if err != nil {
		t.Fatal(got, err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		n, ok := a.Acked()
		if ok && n == uint64(len(msg)) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("acked %d (ok %v) of %d read by the peer", n, ok, len(msg))
		}
		time.Sleep(5 * time.Millisecond)
	}
	a.Close()
	if _, ok := a.Acked(); ok {
		t.Fatal("Acked answered on a closed socket")
	}
}

// A copy costs no allocation of its own: a connection's two copies take
// their state from a pool (eight each before). A source
// at EOF lets Copy run whole, start to end, again and again.
func TestCopyAllocatesNothing(t *testing.T) {
	src, client := sockPair(t)
	dst, server := sockPair(t)
	defer func() { src.Close(); dst.Close(); server.Close() }()
	if _, err := client.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	client.Close()
	if n, err := Copy(dst, src, nil, 0); n != 5 || err != nil {
		t.Fatalf("first copy: %d bytes, %v; want 5, nil", n, err)
	}
	count := func(int64) {}
	allocs := testing.AllocsPerRun(100, func() {
		if n, err := Copy(dst, src, count, 0); n != 0 || err != nil {
			t.Fatalf("copy at EOF: %d bytes, %v", n, err)
		}
	})
	// Under the race detector the pool drops a quarter of the copiers put
	// back: a copier's three allocations then come about once a copy.
	want := 0.0
	if raceEnabled {
		want = 2
	}
	if allocs > want {
		t.Errorf("a whole Copy allocates %.1f times, want at most %.0f", allocs, want)
	}
}
