package sock

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"
)

// datagram i of a test: its size, filled with a byte of i so that any mix-up
// or truncation shows.
func datagram(i, size int) []byte { return bytes.Repeat([]byte{byte(i)}, size) }

// One flow's datagrams leave in GSO sends and arrive whole and in order,
// whatever the run of sizes: equal sizes, a shorter last one, a longer one
// that starts a new run, more than a batch; the sender's socket and the
// receiver drain them with recvmmsg, with the sender's and the local address
// of each.
func TestSendSegmentsAndReceiveMore(t *testing.T) {
	srv, err := ListenUDP(netip.AddrPortFrom(loopback, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	r, err := NewReceiver(srv, true)
	if err != nil {
		t.Fatal(err)
	}
	c, err := DialUDP(srv.LocalAddr().(*net.UDPAddr).AddrPort())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := NewSender(c, 4)
	if err != nil {
		t.Fatal(err)
	}
	from := c.LocalAddr().(*net.UDPAddr).AddrPort()

	for _, sizes := range [][]int{
		{1400, 1400, 1400, 1400},
		{1000, 1000, 1000, 300},
		{500, 500, 900, 900, 900, 10},
		{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
		{20000, 20000, 20000, 20000}, // more than one IP packet's worth: two GSO sends
		{1400},
		{1400, 1400, 0, 0, 7, 7}, // empty datagrams are datagrams too, never part of a GSO send
	} {
		t.Run(fmt.Sprint(len(sizes), "x", sizes[0]), func(t *testing.T) {
			var bufs [][]byte
			for i, size := range sizes {
				bufs = append(bufs, datagram(i, size))
			}
			if sent, err := s.SendSegments(bufs, netip.Addr{}, netip.AddrPort{}); err != nil || sent != len(bufs) {
				t.Fatalf("sent %d of %d: %v", sent, len(bufs), err)
			}
			if s.gsoRefused <= maxDatagram {
				t.Fatalf("the kernel refused GSO of %d bytes on loopback", s.gsoRefused)
			}
			// Next waits for the first and takes what is queued behind it.
			_ = srv.SetReadDeadline(time.Now().Add(10 * time.Second))
			got := 0
			for got < len(bufs) {
				err := r.Next(func(b *Batch) {
					if b.Len() < 1 || b.Len() > batchSize {
						t.Fatalf("a batch of %d", b.Len())
					}
					for i := 0; i < b.Len(); i++ {
						if got == len(bufs) {
							t.Fatalf("datagram %d of %d sent", got+1, len(bufs))
						}
						if !bytes.Equal(b.Datagram(i), bufs[got]) || b.From(i) != from || b.To(i) != loopback {
							t.Fatalf("datagram %d: %d bytes (want %d) of %v from %v to %v", got, len(b.Datagram(i)),
								len(bufs[got]), b.Datagram(i)[:min(1, len(b.Datagram(i)))], b.From(i), b.To(i))
						}
						got++
					}
				})
				if err != nil {
					t.Fatalf("after %d of %d datagrams: %v", got, len(bufs), err)
				}
			}
			b := GetBatch()
			defer b.Put()
			if k, err := r.ReceiveMore(b); k != 0 || err != nil {
				t.Fatalf("after the last datagram ReceiveMore took %d (%v)", k, err)
			}
		})
	}
}

// Replies go out as GSO sends from a given source address to an unconnected
// peer (the frontend socket's case), and a size the kernel refuses for GSO
// (larger than the device's MTU) falls back to one send per datagram.
func TestSendSegmentsFromAddressAndFallback(t *testing.T) {
	front, err := ListenUDP(netip.AddrPortFrom(loopback, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer front.Close()
	s, err := NewSender(front, 4)
	if err != nil {
		t.Fatal(err)
	}
	client, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	to := client.LocalAddr().(*net.UDPAddr).AddrPort()
	check := func(bufs [][]byte) {
		t.Helper()
		if sent, err := s.SendSegments(bufs, loopback, to); err != nil || sent != len(bufs) {
			t.Fatalf("sent %d of %d: %v", sent, len(bufs), err)
		}
		_ = client.SetReadDeadline(time.Now().Add(10 * time.Second))
		buf := make([]byte, maxDatagram)
		for i, want := range bufs {
			n, from, err := client.ReadFromUDPAddrPort(buf)
			if err != nil || !bytes.Equal(buf[:n], want) || from != front.LocalAddr().(*net.UDPAddr).AddrPort() {
				t.Fatalf("datagram %d: %d bytes (want %d) from %v (%v)", i, n, len(want), from, err)
			}
		}
	}
	check([][]byte{datagram(0, 1200), datagram(1, 1200), datagram(2, 700)})
	// A GSO send the kernel refuses: pretend it refused this size before,
	// as it would for segments over the route's MTU.
	s.gsoRefused = 1000
	check([][]byte{datagram(0, 1200), datagram(1, 1200), datagram(2, 999), datagram(3, 999), datagram(4, 999)})
}

// Batches are mapped outside the heap and kept for reuse up to a bound;
// past it they are unmapped. A reused batch still carries datagrams.
func TestBatchesKeptUpToABound(t *testing.T) {
	var held []*Batch
	for i := 0; i < batchesKept+8; i++ {
		b := GetBatch()
		if b.mem == nil {
			t.Fatal("a batch on the heap: mmap failed")
		}
		if len(b.bufs[batchSize-1]) != maxDatagram || cap(b.bufs[0]) != maxDatagram {
			t.Fatalf("buffers of %d (cap %d), want %d", len(b.bufs[batchSize-1]), cap(b.bufs[0]), maxDatagram)
		}
		held = append(held, b)
	}
	for _, b := range held {
		b.Put()
	}
	batches.mu.Lock()
	kept := len(batches.free)
	batches.mu.Unlock()
	if kept != batchesKept {
		t.Fatalf("%d batches kept, want %d", kept, batchesKept)
	}
	// A kept one works again.
	_, r, c := loopbackReceiver(t, true)
	for i := 0; i < 3; i++ {
		_, _ = c.Write(datagram(i, 65000))
	}
	b := GetBatch()
	defer b.Put()
	got := 0
	deadline := time.Now().Add(10 * time.Second)
	for got < 3 && time.Now().Before(deadline) {
		k, err := r.ReceiveMore(b)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < k; i++ {
			if !bytes.Equal(b.Datagram(i), datagram(got, 65000)) {
				t.Fatalf("datagram %d: %d bytes", got, len(b.Datagram(i)))
			}
			got++
		}
		if k == 0 {
			time.Sleep(time.Millisecond)
		}
	}
	if got != 3 {
		t.Fatalf("%d of 3 large datagrams drained", got)
	}
}

// Next waits for a datagram (a read deadline and a close end the wait),
// then takes it and everything queued behind it, in order, in batches, and
// keeps no batch once it returns.
func TestNextWaitsThenTakesTheQueue(t *testing.T) {
	srv, r, c := loopbackReceiver(t, false)
	fail := func(*Batch) { t.Error("a batch from an empty socket") }

	// The deadline ends a wait on an empty socket.
	start := time.Now()
	_ = srv.SetReadDeadline(start.Add(50 * time.Millisecond))
	if err := r.Next(fail); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Next on an empty socket: %v, want the deadline", err)
	}
	if waited := time.Since(start); waited > 5*time.Second {
		t.Fatalf("the 50 ms deadline ended the wait after %v", waited)
	}
	if r.batch != nil {
		t.Fatal("a batch held after the wait")
	}

	// A datagram sent while Next waits wakes it; then 40 queued behind
	// one another arrive whole, in order, at most a batch at a time.
	_ = srv.SetReadDeadline(time.Now().Add(10 * time.Second))
	woke := make(chan error, 1)
	var first []byte
	go func() { woke <- r.Next(func(b *Batch) { first = append(first, b.Datagram(0)...) }) }()
	if _, err := c.Write(datagram(200, 512)); err != nil {
		t.Fatal(err)
	}
	if err := <-woke; err != nil || !bytes.Equal(first, datagram(200, 512)) {
		t.Fatalf("the waiting Next: %d bytes, %v", len(first), err)
	}
	const queued = 40
	for i := 0; i < queued; i++ {
		if _, err := c.Write(datagram(i, 100+i)); err != nil {
			t.Fatal(err)
		}
	}
	got := 0
	for got < queued {
		err := r.Next(func(b *Batch) {
			if b.Len() < 1 || b.Len() > batchSize {
				t.Fatalf("a batch of %d", b.Len())
			}
			for i := 0; i < b.Len(); i++ {
				if got >= queued || !bytes.Equal(b.Datagram(i), datagram(got, 100+got)) {
					t.Fatalf("datagram %d: %d bytes", got, len(b.Datagram(i)))
				}
				got++
			}
		})
		if err != nil {
			t.Fatalf("after %d of %d: %v", got, queued, err)
		}
	}

	// Closing the socket ends a wait.
	go func() { woke <- r.Next(fail) }()
	srv.Close()
	select {
	case err := <-woke:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Next after close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a close did not end Next's wait")
	}
}

// loopbackReceiver is a frontend socket on loopback (ListenUDP) with a
// receiver on it (addrs as given) and a client socket connected to it, all
// closed when the test ends.
func loopbackReceiver(t *testing.T, addrs bool) (srv *net.UDPConn, r *Receiver, client *net.UDPConn) {
	t.Helper()
	srv, err := ListenUDP(netip.AddrPortFrom(loopback, 0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	if r, err = NewReceiver(srv, addrs); err != nil {
		t.Fatal(err)
	}
	client, err = net.DialUDP("udp4", nil, srv.LocalAddr().(*net.UDPAddr))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	return srv, r, client
}
