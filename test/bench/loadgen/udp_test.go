package main

import (
	"net"
	"testing"
	"time"
)

// echoAfter answers every datagram after delay, and every other one only
// when dropHalf; it stops with the test.
func echoAfter(t *testing.T, delay time.Duration, dropHalf bool) string {
	t.Helper()
	srv, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	_ = srv.SetReadBuffer(4 << 20)
	t.Cleanup(func() { srv.Close() })
	go func() {
		buf := make([]byte, 65536)
		for k := 0; ; k++ {
			n, from, err := srv.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			if dropHalf && k%2 == 1 {
				continue
			}
			b := append([]byte(nil), buf[:n]...)
			time.AfterFunc(delay, func() { _, _ = srv.WriteToUDPAddrPort(b, from) })
		}
	}()
	return srv.LocalAddr().String()
}

// TestUDPStopsWhenEveryReplyIsIn: with a long grace for late replies, a run
// whose replies all come (150 ms late) counts them all and ends without
// waiting out the grace; a run that loses half waits it out and says so.
func TestUDPStopsWhenEveryReplyIsIn(t *testing.T) {
	defer func(g time.Duration) { udpGrace = g }(udpGrace)
	udpGrace = 10 * time.Second
	const d = 300 * time.Millisecond

	start := time.Now()
	r := udp(echoAfter(t, 150*time.Millisecond, false), d, 64, 4, 4, 2000)
	if took := time.Since(start); took > d+udpGrace/2 {
		t.Errorf("every reply was in, yet the run took %v (grace %v)", took, udpGrace)
	}
	if r.Sent == 0 || r.Received != r.Sent || r.Loss != 0 {
		t.Errorf("late replies not all counted: %+v", r)
	}

	udpGrace = time.Second
	start = time.Now()
	r = udp(echoAfter(t, 0, true), d, 64, 1, 4, 2000)
	if took := time.Since(start); took < d+udpGrace {
		t.Errorf("half the replies never came, yet the run ended after %v, inside the grace", took)
	}
	if r.Loss < 0.4 || r.Loss > 0.6 {
		t.Errorf("loss %.2f, want about half: %+v", r.Loss, r)
	}
}
