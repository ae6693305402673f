package sock

import (
	"errors"
	"net"
	"net/netip"
	"runtime"
	"testing"
	"time"
)

// Many listeners on one acceptor: no goroutine per listener, every
// listener's connections reach its own handler (also those queued before
// Serve), and a closed listener refuses while the others go on.
func TestAcceptorManyListeners(t *testing.T) {
	const n = 300
	acc, err := NewAcceptor()
	if err != nil {
		t.Fatal(err)
	}
	defer acc.Close()
	type hit struct {
		i int
		c *Conn
	}
	hits := make(chan hit, n)
	before := runtime.NumGoroutine()
	lns := make([]*Listener, n)
	early := make([]net.Conn, 0, n)
	defer func() {
		for _, c := range early {
			c.Close()
		}
	}()
	for i := range lns {
		ln, err := ListenTCP(netip.AddrPortFrom(loopback, 0))
		if err != nil {
			t.Fatal(err)
		}
		lns[i] = ln
		defer ln.Close()
		if i%10 == 0 {
			// Queued before the acceptor knows the listener: edge-triggered
			// epoll must still report it.
			c, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			early = append(early, c)
		}
		if err := ln.Serve(acc, func(c *Conn, _ netip.AddrPort) { hits <- hit{i, c} }, nil); err != nil {
			t.Fatal(err)
		}
	}
	if grown := runtime.NumGoroutine() - before; grown > 5 {
		t.Errorf("%d listeners started %d goroutines", n, grown)
	}
	if got := acc.Listeners(); got != n {
		t.Errorf("acceptor serves %d listeners, want %d", got, n)
	}
	want := map[int]int{}
	for i := 0; i < n; i += 10 {
		want[i]++
	}
	var clients []net.Conn
	defer func() {
		for _, c := range clients {
			c.Close()
		}
	}()
	for i := 0; i < n; i += 7 {
		c, err := net.Dial("tcp", lns[i].Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		clients = append(clients, c)
		want[i]++
	}
	got := map[int]int{}
	total := 0
	for _, w := range want {
		total += w
	}
	deadline := time.After(10 * time.Second)
	for k := 0; k < total; k++ {
		select {
		case h := <-hits:
			got[h.i]++
			h.c.Close()
		case <-deadline:
			t.Fatalf("%d of %d connections accepted", k, total)
		}
	}
	for i, w := range want {
		if got[i] != w {
			t.Errorf("listener %d: %d connections, want %d", i, got[i], w)
		}
	}
	// Close every other listener: those refuse, the rest still accept.
	for i := 0; i < n; i += 2 {
		lns[i].Close()
	}
	if got := acc.Listeners(); got != n/2 {
		t.Errorf("acceptor serves %d listeners after closing half, want %d", got, n/2)
	}
	if _, err := net.Dial("tcp", lns[0].Addr().String()); err == nil {
		t.Error("a closed listener accepted")
	}
	c, err := net.Dial("tcp", lns[1].Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	select {
	case h := <-hits:
		if h.i != 1 {
			t.Errorf("connection to listener 1 reached listener %d", h.i)
		}
		h.c.Close()
	case <-time.After(10 * time.Second):
		t.Fatal("an open listener stopped accepting after others closed")
	}
}

// Close of the acceptor ends its goroutine at once and a listener closed
// afterwards does not touch a reused descriptor number; Serve on a closed
// listener fails.
func TestAcceptorClose(t *testing.T) {
	acc, err := NewAcceptor()
	if err != nil {
		t.Fatal(err)
	}
	ln, err := ListenTCP(netip.AddrPortFrom(loopback, 0))
	if err != nil {
		t.Fatal(err)
	}
	if err := ln.Serve(acc, func(c *Conn, _ netip.AddrPort) { c.Close() }, nil); err != nil {
		t.Fatal(err)
	}
	if err := ln.Serve(acc, func(c *Conn, _ netip.AddrPort) { c.Close() }, nil); err == nil {
		t.Error("a second Serve of one listener succeeded")
	}
	within(t, 5*time.Second, "Acceptor.Close", func() { acc.Close() })
	if err := ln.Close(); err != nil {
		t.Errorf("closing a listener after its acceptor: %v", err)
	}
	ln2, err := ListenTCP(netip.AddrPortFrom(loopback, 0))
	if err != nil {
		t.Fatal(err)
	}
	ln2.Close()
	acc2, err := NewAcceptor()
	if err != nil {
		t.Fatal(err)
	}
	defer acc2.Close()
	if err := ln2.Serve(acc2, func(c *Conn, _ netip.AddrPort) { c.Close() }, nil); !errors.Is(err, net.ErrClosed) {
		t.Errorf("Serve of a closed listener: %v, want net.ErrClosed", err)
	}
}
