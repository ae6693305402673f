package sock

import (
	"bytes"
	"errors"
	"io"
	"testing"
	"time"
)

// pattern is the i-th byte of a stream no shift or doubling leaves intact.
func pattern(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i % 251)
	}
	return b
}

// A Copy detached in the middle of a bulk transfer into a slow reader
// stops with ErrDetached, and a new Copy on duplicates of the two sockets
// (what a successor process gets) carries on: the reader sees every byte
// once, in order. Then the same for a Copy waiting on an idle source.
func TestDetachLosesNothing(t *testing.T) {
	src, client := sockPair(t)
	dst, server := sockPair(t)
	defer func() { src.Close(); dst.Close(); client.Close(); server.Close() }()
	const total = 24 << 20
	want := pattern(total)
	go func() {
		_, _ = client.Write(want)
	}()
	first := make(chan error, 1)
	var moved int64
	go func() {
		n, err := Copy(dst, src, func(int64) {}, time.Second)
		moved = n
		first <- err
	}()
	got := make([]byte, 0, total)
	buf := make([]byte, 64<<10)
	read := func(n int) {
		for len(got) < n {
			_ = server.SetReadDeadline(time.Now().Add(10 * time.Second))
			k, err := server.Read(buf[:min(len(buf), n-len(got))])
			if err != nil {
				t.Fatalf("after %d bytes: %v", len(got), err)
			}
			got = append(got, buf[:k]...)
			time.Sleep(time.Millisecond) // slower than the writer: the copy stays in its burst
		}
	}
	read(4 << 20)
	src.Detach()
	// The copy stops once its write in progress is taken in: the reader
	// reads on meanwhile, slowly.
	deadline := time.Now().Add(10 * time.Second)
	for stopped := false; !stopped; {
		select {
		case err := <-first:
			if !errors.Is(err, ErrDetached) {
				t.Fatalf("detached copy returned %v", err)
			}
			stopped = true
		default:
			if time.Now().After(deadline) {
				t.Fatal("the copy did not stop after Detach")
			}
			read(len(got) + 64<<10)
		}
	}
	if moved <= 4<<20 || moved >= total {
		t.Fatalf("the detached copy moved %d bytes, want some of %d", moved, total)
	}
	// What a successor gets: duplicates of both sockets.
	sf, err := src.File()
	if err != nil {
		t.Fatal(err)
	}
	df, err := dst.File()
	if err != nil {
		t.Fatal(err)
	}
	src2, err := FileConn(sf)
	if err != nil {
		t.Fatal(err)
	}
	dst2, err := FileConn(df)
	if err != nil {
		t.Fatal(err)
	}
	sf.Close()
	df.Close()
	defer func() { src2.Close(); dst2.Close() }()
	second := make(chan error, 1)
	go func() {
		_, err := Copy(dst2, src2, func(int64) {}, 0)
		second <- err
	}()
	read(total)
	if !bytes.Equal(got, want) {
		i := 0
		for i < len(got) && got[i] == want[i] {
			i++
		}
		t.Fatalf("the stream differs from byte %d on", i)
	}

	// Idle: a detach of a copy waiting for its source returns at once,
	// and the next message goes through the copy that follows.
	src2.Detach()
	select {
	case err := <-second:
		if !errors.Is(err, ErrDetached) {
			t.Fatalf("detached idle copy returned %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the idle copy did not stop after Detach")
	}
	src2.Undetach()
	third := make(chan error, 1)
	go func() {
		_, err := Copy(dst2, src2, func(int64) {}, 0)
		third <- err
	}()
	if _, err := client.Write([]byte("after")); err != nil {
		t.Fatal(err)
	}
	msg := make([]byte, 5)
	_ = server.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(server, msg); err != nil || string(msg) != "after" {
		t.Fatalf("after Undetach: %q %v", msg, err)
	}
	client.CloseWrite()
	if err := <-third; err != nil {
		t.Fatalf("the copy after Undetach ended with %v, want EOF", err)
	}
}

// A Detach that comes between a Copy's ErrIdle and the Park of its
// source (nothing parked yet to wake) is not lost: the Park wakes at once.
func TestDetachBeforeParkWakes(t *testing.T) {
	p := runParker(t)
	src, client := sockPair(t)
	defer src.Close()
	defer client.Close()
	src.Detach()
	woke := make(chan struct{})
	if err := p.Park(src, func() { close(woke) }); err != nil {
		t.Fatal(err)
	}
	select {
	case <-woke:
	case <-time.After(5 * time.Second):
		t.Fatal("a socket detached before its Park stayed parked")
	}
}
