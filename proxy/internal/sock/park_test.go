package sock

import (
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// runParker starts a Parker and stops it when the test ends.
func runParker(t testing.TB) *Parker {
	t.Helper()
	p, err := NewParker()
	if err != nil {
		t.Fatal(err)
	}
	stop, done := make(chan struct{}), make(chan struct{})
	go func() { p.Run(stop); close(done) }()
	// Park refuses until Run has begun.
	deadline := time.Now().Add(5 * time.Second)
	for {
		p.mu.Lock()
		running := p.running
		p.mu.Unlock()
		if running {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the parker did not start")
		}
		time.Sleep(time.Millisecond)
	}
	t.Cleanup(func() {
		close(stop)
		<-done
		_ = p.Close()
	})
	return p
}

// Copy with an idle time returns ErrIdle when its source stays quiet, but
// not while data keeps coming more often than that; after a park the wake
// comes with the data, and a new Copy carries it, counted on.
func TestCopyParksWhenIdleAndWakesWithData(t *testing.T) {
	p := runParker(t)
	src, client := sockPair(t)
	dst, server := sockPair(t)
	defer src.Close()
	defer dst.Close()
	defer client.Close()
	defer server.Close()

	// A conversation with pauses shorter than the idle time: no ErrIdle.
	const idle = 60 * time.Millisecond
	type result struct {
		n   int64
		err error
	}
	res := make(chan result, 1)
	go func() {
		n, err := Copy(dst, src, func(int64) {}, idle)
		res <- result{n, err}
	}()
	buf := make([]byte, 5)
	for i := 0; i < 8; i++ {
		if _, err := client.Write([]byte("hello")); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(server, buf); err != nil {
			t.Fatal(err)
		}
		time.Sleep(idle / 3)
	}
	start := time.Now()
	var r result
	within(t, 10*time.Second, "Copy to find its source idle", func() { r = <-res })
	if !errors.Is(r.err, ErrIdle) || r.n != 40 {
		t.Fatalf("Copy returned %d, %v; want 40 bytes and ErrIdle", r.n, r.err)
	}
	if waited := time.Since(start); waited < idle/2 {
		t.Fatalf("ErrIdle %v after the last message, want about %v", waited, idle)
	}

	woken := make(chan struct{})
	if err := p.Park(src, func() { close(woken) }); err != nil {
		t.Fatal(err)
	}
	if p.Parked() != 1 {
		t.Fatalf("parked %d, want 1", p.Parked())
	}
	select {
	case <-woken:
		t.Fatal("woken without data")
	case <-time.After(50 * time.Millisecond):
	}
	if _, err := client.Write([]byte("again")); err != nil {
		t.Fatal(err)
	}
	within(t, 5*time.Second, "the wake after data", func() { <-woken })
	if p.Parked() != 0 {
		t.Fatalf("parked %d after the wake, want 0", p.Parked())
	}
	// No deadline was left behind: a plain Copy waits, carries the data
	// and ends at EOF.
	go func() {
		n, err := Copy(dst, src, func(int64) {}, 0)
		res <- result{n, err}
	}()
	if _, err := io.ReadFull(server, buf); err != nil || string(buf) != "again" {
		t.Fatalf("after the wake read %q, %v", buf, err)
	}
	client.CloseWrite()
	within(t, 5*time.Second, "Copy to end at EOF", func() { r = <-res })
	if r.err != nil || r.n != 5 {
		t.Fatalf("Copy returned %d, %v; want 5 bytes at EOF", r.n, r.err)
	}
}

// A parked socket is woken by Abort (and the wake's Copy says closed), by a
// peer's FIN or reset, and by the Parker's stop; each wake comes once.
func TestParkedSocketWakes(t *testing.T) {
	p := runParker(t)
	park := func(c *Conn) chan struct{} {
		woken := make(chan struct{}, 2)
		if err := p.Park(c, func() { woken <- struct{}{} }); err != nil {
			t.Fatal(err)
		}
		return woken
	}
	once := func(what string, woken chan struct{}) {
		within(t, 5*time.Second, what, func() { <-woken })
		select {
		case <-woken:
			t.Fatalf("%s: woken twice", what)
		case <-time.After(20 * time.Millisecond):
		}
	}

	aborted, peer := sockPair(t)
	defer aborted.Close()
	defer peer.Close()
	woken := park(aborted)
	aborted.Abort()
	once("the wake after Abort", woken)
	if _, err := Copy(aborted, aborted, func(int64) {}, time.Second); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Copy after Abort: %v, want net.ErrClosed", err)
	}

	finned, peer2 := sockPair(t)
	defer finned.Close()
	woken = park(finned)
	peer2.CloseWrite()
	once("the wake after a FIN", woken)
	peer2.Close()

	reset, peer3 := sockPair(t)
	defer reset.Close()
	woken = park(reset)
	_ = peer3.SetLinger(0)
	peer3.Close()
	once("the wake after a reset", woken)

	// Aborted before parking: Park wakes it at once.
	early, peer4 := sockPair(t)
	defer early.Close()
	defer peer4.Close()
	early.Abort()
	once("the wake of a socket aborted before it was parked", park(early))

	if p.Parked() != 0 {
		t.Fatalf("parked %d, want 0", p.Parked())
	}
}

// Stopping the Parker wakes what is still parked, and Park refuses after.
func TestParkerStopWakesParked(t *testing.T) {
	p, err := NewParker()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	c, peer := sockPair(t)
	defer c.Close()
	defer peer.Close()
	if err := p.Park(c, func() { t.Error("woken by a refused Park") }); !errors.Is(err, ErrNotParked) {
		t.Fatalf("Park before Run: %v, want ErrNotParked", err)
	}
	stop, done := make(chan struct{}), make(chan struct{})
	go func() { p.Run(stop); close(done) }()
	woken := make(chan struct{})
	within(t, 5*time.Second, "Park to be accepted", func() {
		for p.Park(c, func() { close(woken) }) != nil {
			time.Sleep(time.Millisecond)
		}
	})
	close(stop)
	within(t, 5*time.Second, "the Parker's stop", func() { <-done; <-woken })
	if err := p.Park(c, func() {}); !errors.Is(err, ErrNotParked) {
		t.Fatalf("Park after stop: %v, want ErrNotParked", err)
	}
	var nilParker *Parker
	if err := nilParker.Park(c, func() {}); !errors.Is(err, ErrNotParked) || nilParker.Parked() != 0 {
		t.Fatalf("a nil Parker: %v", err)
	}
}

// The cost of a wake-up: one byte written to a socket and the wait for it
// ended, for a socket parked in the Parker (BenchmarkParkedWake: Park, the
// Parker's wake and its hand-off to another goroutine) and for a goroutine
// waiting in Go's poller (BenchmarkWaitingWake: what a copy that has not
// parked pays). The difference is what a parked direction adds to the
// first message after its pause.
func BenchmarkParkedWake(b *testing.B) {
	p := runParker(b)
	src, client := sockPair(b)
	defer src.Close()
	defer client.Close()
	woken := make(chan struct{})
	wake := func() { woken <- struct{}{} }
	one, buf := []byte{1}, make([]byte, 1)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := p.Park(src, wake); err != nil {
			b.Fatal(err)
		}
		if _, err := client.Write(one); err != nil {
			b.Fatal(err)
		}
		<-woken
		if err := src.read(func(fd uintptr) bool { _, _ = rawRead(int(fd), buf); return true }); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkWaitingWake(b *testing.B) {
	src, client := sockPair(b)
	defer src.Close()
	defer client.Close()
	woken := make(chan struct{})
	buf := make([]byte, 1)
	go func() {
		for {
			n := 0
			if err := src.read(func(fd uintptr) bool { n, _ = rawRead(int(fd), buf); return n != 0 }); err != nil || n < 0 {
				close(woken)
				return
			}
			woken <- struct{}{}
		}
	}()
	one := []byte{1}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := client.Write(one); err != nil {
			b.Fatal(err)
		}
		<-woken
	}
	b.StopTimer()
	src.Abort()
	for range woken {
	}
}

// A socket parks again after a wake (its one-shot registration armed again)
// and wakes again only with new data; a socket closed while registered
// leaves nothing behind for a new one that gets its descriptor number.
func TestParkAgainAfterWake(t *testing.T) {
	p := runParker(t)
	src, client := sockPair(t)
	defer client.Close()
	buf := make([]byte, 8)
	drain := func() {
		if err := src.read(func(fd uintptr) bool { _, _ = rawRead(int(fd), buf); return true }); err != nil {
			t.Fatal(err)
		}
	}
	for round := 0; round < 3; round++ {
		woken := make(chan struct{}, 2)
		if err := p.Park(src, func() { woken <- struct{}{} }); err != nil {
			t.Fatal(err)
		}
		select {
		case <-woken:
			t.Fatalf("round %d: woken without data", round)
		case <-time.After(30 * time.Millisecond):
		}
		if _, err := client.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
		within(t, 5*time.Second, "the wake after data", func() { <-woken })
		drain()
		select {
		case <-woken:
			t.Fatalf("round %d: woken twice", round)
		case <-time.After(20 * time.Millisecond):
		}
	}

	// Parked again (re-armed) and the peer resets: the wake comes too.
	rst, rstPeer := sockPair(t)
	defer rst.Close()
	wokenRst := make(chan struct{}, 2)
	wakeRst := func() { wokenRst <- struct{}{} }
	if err := p.Park(rst, wakeRst); err != nil {
		t.Fatal(err)
	}
	if _, err := rstPeer.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	within(t, 5*time.Second, "the first wake", func() { <-wokenRst })
	if err := rst.read(func(fd uintptr) bool { _, _ = rawRead(int(fd), buf); return true }); err != nil {
		t.Fatal(err)
	}
	if err := p.Park(rst, wakeRst); err != nil {
		t.Fatal(err)
	}
	_ = rstPeer.SetLinger(0)
	rstPeer.Close()
	within(t, 5*time.Second, "the wake of a re-armed socket whose peer reset", func() { <-wokenRst })

	// Parked, then aborted and closed: the next socket, likely on the same
	// descriptor number, parks and wakes like a fresh one.
	woken := make(chan struct{}, 1)
	if err := p.Park(src, func() { woken <- struct{}{} }); err != nil {
		t.Fatal(err)
	}
	src.Abort()
	within(t, 5*time.Second, "the wake after Abort", func() { <-woken })
	src.Close()
	next, peer := sockPair(t)
	defer next.Close()
	defer peer.Close()
	woken2 := make(chan struct{}, 1)
	if err := p.Park(next, func() { woken2 <- struct{}{} }); err != nil {
		t.Fatalf("parking a socket on a reused descriptor: %v", err)
	}
	if _, err := peer.Write([]byte("y")); err != nil {
		t.Fatal(err)
	}
	within(t, 5*time.Second, "the new socket's wake", func() { <-woken2 })
	if p.Parked() != 0 {
		t.Fatalf("parked %d, want 0", p.Parked())
	}
}
