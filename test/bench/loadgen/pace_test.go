package main

import (
	"net"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/ipv4"
)

// TestPaceOffersWhatTheClockOwes: what a paced flow offers (sends plus
// skips) follows the clock: never more than the rate owes for the run, and
// not far under it, at rates that sleep in nanosleep (20 000/s: a tick of
// 200 µs) and in Go's timers (300/s).
func TestPaceOffersWhatTheClockOwes(t *testing.T) {
	for _, tc := range []struct {
		rate  float64
		burst int
	}{{2000, 4}, {20000, 4}, {300, 1}} {
		srv, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			t.Fatal(err)
		}
		_ = srv.SetReadBuffer(4 << 20)
		c, err := net.DialUDP("udp4", nil, srv.LocalAddr().(*net.UDPAddr))
		if err != nil {
			t.Fatal(err)
		}
		pc := ipv4.NewPacketConn(c)
		msgs := make([]ipv4.Message, 64)
		for i := range msgs {
			msgs[i].Buffers = [][]byte{make([]byte, 16)}
		}
		const d = 300 * time.Millisecond
		var sent, skipped atomic.Int64
		end := time.Now().Add(d)
		pace(pc, msgs, tc.rate, tc.burst, end, &sent, &skipped)
		c.Close()
		srv.Close()

		offered := sent.Load() + skipped.Load()
		owed := tc.rate * d.Seconds()
		if float64(offered) > owed+1 {
			t.Errorf("rate %.0f: offered %d (sent %d, skipped %d) in %v, more than the %.0f owed", tc.rate, offered, sent.Load(), skipped.Load(), d, owed)
		}
		if float64(offered) < owed/2 {
			t.Errorf("rate %.0f: offered %d in %v, under half the %.0f owed", tc.rate, offered, d, owed)
		}
		if sent.Load() == 0 {
			t.Errorf("rate %.0f: nothing sent", tc.rate)
		}
	}
}
