// Command loadgen is the benchmark's client: it runs in the lab's client
// namespace and prints one JSON result.
//
//	loadgen -mode cps     -addr A -d 5s -c 32          new connections per second (HTTP, Connection: close)
//	loadgen -mode rps     -addr A -d 5s -c 32          keep-alive requests per second
//	loadgen -mode latency -addr A -d 5s -rate 2000     fixed-rate keep-alive requests: p50/p99/p99.9
//	loadgen -mode udp     -addr A -d 3s -size 64 -flows 1 -rate R -burst 4   datagrams sent/received at a paced rate
//	loadgen -mode idle    -addr A -n 1000              open n idle connections, print "ready", hold until stdin closes
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/ipv4"
	"golang.org/x/sys/unix"
)

func main() {
	mode := flag.String("mode", "rps", "cps, rps, latency, udp or idle")
	addr := flag.String("addr", "", "host:port")
	dur := flag.Duration("d", 5*time.Second, "duration")
	conns := flag.Int("c", 32, "concurrent connections (cps, rps, latency)")
	rate := flag.Float64("rate", 1000, "requests or datagrams per second (latency, udp)")
	size := flag.Int("size", 64, "datagram size (udp)")
	flows := flag.Int("flows", 1, "UDP client sockets (udp)")
	burst := flag.Int("burst", 4, "datagrams a flow sends at once (udp), paced by the clock between sends")
	n := flag.Int("n", 1000, "connections (idle)")
	flag.Parse()
	var out any
	switch *mode {
	case "cps":
		out = closeLoop(*addr, *dur, *conns)
	case "rps":
		out = keepAlive(*addr, *dur, *conns)
	case "latency":
		out = fixedRate(*addr, *dur, *conns, *rate)
	case "udp":
		if *rate <= 0 || *flows < 1 || *burst < 1 {
			fmt.Fprintln(os.Stderr, "udp: -rate must be > 0, -flows and -burst ≥ 1")
			os.Exit(2)
		}
		out = udp(*addr, *dur, *size, *flows, *burst, *rate)
	case "idle":
		idle(*addr, *n)
		return
	default:
		fmt.Fprintln(os.Stderr, "unknown mode")
		os.Exit(2)
	}
	_ = json.NewEncoder(os.Stdout).Encode(out)
}

const request = "GET / HTTP/1.1\r\nHost: bench\r\n\r\n"
const closeRequest = "GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"

// readResponse reads one HTTP response with a Content-Length body.
func readResponse(r *bufio.Reader) error {
	length := -1
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			return err
		}
		if line == "\r\n" {
			break
		}
		// Header names are case-insensitive (HAProxy sends lower case).
		if name, v, ok := strings.Cut(line, ":"); ok && strings.EqualFold(name, "Content-Length") {
			if n, err := strconv.Atoi(strings.TrimSpace(v)); err == nil {
				length = n
			}
		}
	}
	if length < 0 {
		return fmt.Errorf("no Content-Length")
	}
	_, err := io.CopyN(io.Discard, r, int64(length))
	return err
}

type rateResult struct {
	PerSecond float64 `json:"perSecond"`
	Count     int64   `json:"count"`
	Errors    int64   `json:"errors"`
}

// countRate runs c copies of work until d has passed; work counts its
// successes and failures.
func countRate(d time.Duration, c int, work func(end time.Time, ok, bad *atomic.Int64)) rateResult {
	var ok, bad atomic.Int64
	end := time.Now().Add(d)
	var wg sync.WaitGroup
	for i := 0; i < c; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			work(end, &ok, &bad)
		}()
	}
	wg.Wait()
	return rateResult{PerSecond: float64(ok.Load()) / d.Seconds(), Count: ok.Load(), Errors: bad.Load()}
}

// closeLoop: one request per connection.
func closeLoop(addr string, d time.Duration, c int) rateResult {
	return countRate(d, c, func(end time.Time, ok, bad *atomic.Int64) {
		for time.Now().Before(end) {
			conn, err := net.DialTimeout("tcp", addr, 2*time.Second)
			if err != nil {
				bad.Add(1)
				continue
			}
			_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := conn.Write([]byte(closeRequest)); err == nil && readResponse(bufio.NewReader(conn)) == nil {
				ok.Add(1)
			} else {
				bad.Add(1)
			}
			conn.Close()
		}
	})
}

// keepAlive: requests back to back on one connection per worker.
func keepAlive(addr string, d time.Duration, c int) rateResult {
	return countRate(d, c, func(end time.Time, ok, bad *atomic.Int64) {
		conn, err := net.DialTimeout("tcp", addr, 2*time.Second)
		if err != nil {
			bad.Add(1)
			return
		}
		defer conn.Close()
		r := bufio.NewReader(conn)
		for time.Now().Before(end) {
			_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := conn.Write([]byte(request)); err != nil || readResponse(r) != nil {
				bad.Add(1)
				return
			}
			ok.Add(1)
		}
	})
}

type latencyResult struct {
	Rate   float64 `json:"rate"`
	P50us  float64 `json:"p50us"`
	P99us  float64 `json:"p99us"`
	P999us float64 `json:"p999us"`
	Errors int64   `json:"errors"`
}

// fixedRate sends requests on c keep-alive connections at a total rate,
// measuring each from its scheduled send time (no coordinated omission).
func fixedRate(addr string, d time.Duration, c int, rate float64) latencyResult {
	var mu sync.Mutex
	var lat []time.Duration
	var bad atomic.Int64
	interval := time.Duration(float64(time.Second) * float64(c) / rate)
	start := time.Now()
	var wg sync.WaitGroup
	for i := 0; i < c; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			conn, err := net.DialTimeout("tcp", addr, 2*time.Second)
			if err != nil {
				bad.Add(1)
				return
			}
			defer conn.Close()
			r := bufio.NewReader(conn)
			next := start.Add(interval * time.Duration(i) / time.Duration(c))
			var mine []time.Duration
			for next.Before(start.Add(d)) {
				time.Sleep(time.Until(next))
				_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
				if _, err := conn.Write([]byte(request)); err != nil || readResponse(r) != nil {
					bad.Add(1)
					return
				}
				mine = append(mine, time.Since(next))
				next = next.Add(interval)
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		}(i)
	}
	wg.Wait()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	pct := func(p float64) float64 {
		if len(lat) == 0 {
			return 0
		}
		return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))].Microseconds())
	}
	return latencyResult{Rate: rate, P50us: pct(0.5), P99us: pct(0.99), P999us: pct(0.999), Errors: bad.Load()}
}

type udpResult struct {
	Sent     int64   `json:"sent"`
	Received int64   `json:"received"`
	Loss     float64 `json:"loss"`
	PPS      float64 `json:"pps"`
	Skipped  int64   `json:"skipped"` // owed while the generator itself stalled, not sent
}

// udpGrace is how long a UDP flow waits for late replies after its last
// send, unless every reply is in before.
var udpGrace = 500 * time.Millisecond

// udp sends datagrams from flows sockets at a total rate to an echo server
// and counts the replies. Each flow is paced by the clock (pace); sending
// and receiving are batched (sendmmsg, recvmmsg) so that the generator, not
// the path under test, is cheap.
func udp(addr string, d time.Duration, size, flows, burst int, rate float64) udpResult {
	var sent, recv, skipped atomic.Int64
	end := time.Now().Add(d)
	var wg sync.WaitGroup
	perFlow := rate / float64(flows)
	const batch = 64
	for f := 0; f < flows; f++ {
		ra, _ := net.ResolveUDPAddr("udp", addr)
		c, err := net.DialUDP("udp", nil, ra)
		if err != nil {
			continue
		}
		_ = c.SetReadBuffer(4 << 20)
		_ = c.SetWriteBuffer(4 << 20)
		pc := ipv4.NewPacketConn(c)
		// The flow's own counts: its reader stops once every datagram
		// sent has its reply, instead of waiting out the grace for late
		// ones (half a second a try, most of a short try's time).
		var flowSent, flowRecv atomic.Int64
		var sendDone atomic.Bool
		wg.Add(2)
		go func() {
			defer wg.Done()
			defer c.Close()
			msgs := make([]ipv4.Message, batch)
			for i := range msgs {
				msgs[i].Buffers = [][]byte{make([]byte, 65536)}
			}
			_ = c.SetReadDeadline(end.Add(udpGrace))
			for {
				n, err := pc.ReadBatch(msgs, 0)
				if err != nil {
					return // the grace is over, or the sender saw every reply in
				}
				recv.Add(int64(n))
				if flowRecv.Add(int64(n)) >= flowSent.Load() && sendDone.Load() {
					return
				}
			}
		}()
		go func() {
			defer wg.Done()
			msgs := make([]ipv4.Message, batch)
			for i := range msgs {
				msgs[i].Buffers = [][]byte{make([]byte, size)}
			}
			pace(pc, msgs, perFlow, burst, end, &flowSent, &skipped)
			sent.Add(flowSent.Load())
			sendDone.Store(true)
			// The reader may be waiting with every reply in: wake it.
			if flowRecv.Load() >= flowSent.Load() {
				_ = c.SetReadDeadline(time.Now())
			}
		}()
	}
	wg.Wait()
	s, r := sent.Load(), recv.Load()
	loss := 1.0
	if s > 0 {
		loss = 1 - float64(r)/float64(s)
	}
	return udpResult{Sent: s, Received: r, Loss: loss, PPS: float64(r) / d.Seconds(), Skipped: skipped.Load()}
}

// pace sends one flow's datagrams by the clock: at every moment it has
// offered what perFlow datagrams a second owe since the start, about burst at
// a time (one sendmmsg). A sleep under a millisecond is a nanosleep(2) on a
// thread of its own with the least timer slack, since Go's timers wake no
// sooner than a millisecond on Linux: sends every millisecond made bursts of
// rate/1 000 datagrams, and a sleep that took 2 ms halved the rate offered.
// What a stall of the generator itself leaves owed beyond two sends or a
// millisecond's worth, whichever is more, is skipped, not sent at once, so
// that the path never gets a burst it did not make.
func pace(pc *ipv4.PacketConn, msgs []ipv4.Message, perFlow float64, burst int, end time.Time, sent, skipped *atomic.Int64) {
	tick := time.Duration(float64(burst) / perFlow * float64(time.Second))
	tick = min(max(tick, 20*time.Microsecond), time.Millisecond)
	if tick < time.Millisecond {
		// Never unlocked: the thread with its changed slack ends with the
		// goroutine instead of going back to the pool.
		runtime.LockOSThread()
		_ = unix.Prctl(unix.PR_SET_TIMERSLACK, 1, 0, 0, 0) // 1 ns: the default 50 µs is a third of a tick
	}
	limit := max(2*perFlow*tick.Seconds(), perFlow/1000, 2)
	start := time.Now()
	var offered float64 // datagrams sent, dropped by the sender, or skipped
	for now := start; now.Before(end); now = time.Now() {
		owed := perFlow*now.Sub(start).Seconds() - offered
		if owed > limit {
			skipped.Add(int64(owed - limit))
			offered += owed - limit
			owed = limit
		}
		for owed >= 1 {
			k := min(int(owed), len(msgs))
			n, err := pc.WriteBatch(msgs[:k], 0)
			if err != nil || n == 0 {
				n = k // dropped by the sender: never counted as sent
			} else {
				sent.Add(int64(n))
			}
			offered += float64(n)
			owed -= float64(n)
		}
		if tick < time.Millisecond {
			ts := unix.NsecToTimespec(tick.Nanoseconds())
			_ = unix.Nanosleep(&ts, nil)
		} else {
			time.Sleep(tick)
		}
	}
}

// idle opens n connections, says "ready" and holds them until stdin closes.
func idle(addr string, n int) {
	var conns []net.Conn
	for i := 0; i < n; i++ {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			fmt.Fprintln(os.Stderr, "dial:", err)
			os.Exit(1)
		}
		// One round trip, so that the proxy has dialled its endpoint.
		fmt.Fprintf(c, "x")
		buf := make([]byte, 1)
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadFull(c, buf); err != nil {
			fmt.Fprintln(os.Stderr, "echo:", err)
			os.Exit(1)
		}
		conns = append(conns, c)
	}
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	for _, c := range conns {
		c.Close()
	}
}
