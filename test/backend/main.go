// Command backend is the lab's pod: an HTTP server on TCP that answers every
// request with its name, and a UDP server that answers every datagram with
// "name:" followed by the datagram ("peer?" is answered "name (client
// A:P)", the address it came from). Used by make demo and the netns tests.
package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

func main() {
	name := flag.String("name", "", "the name to answer with (default: the hostname)")
	tcp := flag.String("tcp", ":8080", "TCP listen address (HTTP); empty to disable")
	udp := flag.String("udp", ":8080", "UDP listen address; empty to disable")
	echo := flag.String("echo", "", "TCP echo listen address (benchmarks); empty to disable")
	slowEcho := flag.String("echo-after-eof", "", "TCP listen address that reads until the client half-closes, then sends back what it read, 1 KiB every 10 ms, and closes (a half-closed connection that lives for a while); empty to disable")
	stall := flag.String("stall", "", "TCP listen address whose connections are accepted and never read (a stuck backend); empty to disable")
	dns := flag.String("dns", "", "UDP DNS listen address: every question is answered with one A record, 192.0.2.1 (for dig); empty to disable")
	flag.IntVar(&udpBuffer, "udp-buffer", 0, "UDP socket buffer size in bytes, each way (0: the kernel's default; with CAP_NET_ADMIN beyond net.core.rmem_max)")
	flag.Parse()
	if *name == "" {
		*name, _ = os.Hostname()
	}
	errc := make(chan error, 5)
	serveTCP(*echo, errc, func(c net.Conn) { go func() { defer c.Close(); _, _ = io.Copy(c, c) }() })
	serveTCP(*slowEcho, errc, func(c net.Conn) { go echoAfterEOF(c) })
	var held []net.Conn // the stall port's: kept open, never read
	serveTCP(*stall, errc, func(c net.Conn) { held = append(held, c) })
	if *dns != "" {
		go func() { errc <- serveUDP(*dns, dnsAnswer) }()
	}
	if *udp != "" {
		go func() {
			errc <- serveUDP(*udp, func(q []byte, from net.Addr) []byte {
				if string(q) == "peer?" {
					return []byte(fmt.Sprintf("%s (client %s)", *name, from))
				}
				return append([]byte(*name+":"), q...)
			})
		}()
	}
	if *tcp != "" {
		go func() {
			errc <- http.ListenAndServe(*tcp, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/bytes" {
					serveBytes(w, r)
					return
				}
				fmt.Fprintf(w, "%s (client %s)\n", *name, r.RemoteAddr)
			}))
		}()
	}
	log.Fatal(<-errc)
}

// serveBytes answers GET /bytes?n=N with N zero bytes: a download as long
// as a test needs (a slow client makes it a transfer under backpressure).
func serveBytes(w http.ResponseWriter, r *http.Request) {
	n, err := strconv.ParseInt(r.URL.Query().Get("n"), 10, 64)
	if err != nil || n < 0 {
		http.Error(w, "n: want a byte count", http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
	chunk := make([]byte, 64<<10)
	for n > 0 {
		k := min(n, int64(len(chunk)))
		if _, err := w.Write(chunk[:k]); err != nil {
			return
		}
		n -= k
	}
}

// udpBuffer is --udp-buffer.
var udpBuffer int

// serveUDP answers every datagram on addr with what answer returns for it
// and its sender (nothing for nil), until reading fails.
func serveUDP(addr string, answer func(q []byte, from net.Addr) []byte) error {
	c, err := net.ListenPacket("udp", addr)
	if err != nil {
		log.Fatal(err)
	}
	if udpBuffer > 0 {
		setBuffers(c.(*net.UDPConn), udpBuffer)
	}
	buf := make([]byte, 65536)
	for {
		n, from, err := c.ReadFrom(buf)
		if err != nil {
			return err
		}
		if reply := answer(buf[:n], from); reply != nil {
			_, _ = c.WriteTo(reply, from)
		}
	}
}

// setBuffers sets both buffers of c to size: with SO_RCVBUFFORCE and
// SO_SNDBUFFORCE where the process may (CAP_NET_ADMIN), else as far as
// net.core.rmem_max and wmem_max allow.
func setBuffers(c *net.UDPConn, size int) {
	raw, err := c.SyscallConn()
	if err != nil {
		log.Fatal(err)
	}
	_ = raw.Control(func(fd uintptr) {
		for _, o := range [][2]int{{unix.SO_RCVBUFFORCE, unix.SO_RCVBUF}, {unix.SO_SNDBUFFORCE, unix.SO_SNDBUF}} {
			if unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, o[0], size) != nil {
				_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, o[1], size)
			}
		}
	})
}

// dnsAnswer answers a DNS query's first question with the A record
// 192.0.2.1, or returns nil for anything that is not a query.
func dnsAnswer(q []byte, _ net.Addr) []byte {
	if len(q) < 12 || q[2]&0x80 != 0 || q[4] != 0 || q[5] == 0 {
		return nil // too short, a response, or no question
	}
	end := 12
	for end < len(q) && q[end] != 0 { // the name's labels
		end += 1 + int(q[end])
	}
	end += 1 + 4 // the root label, QTYPE and QCLASS
	if end > len(q) {
		return nil
	}
	r := append([]byte(nil), q[:end]...)
	r[2] = 0x80 | q[2]&0x79             // QR, the opcode and RD of the query
	r[3] = 0x80                         // RA, NOERROR
	r[4], r[5], r[6], r[7] = 0, 1, 0, 1 // one question, one answer
	r[8], r[9], r[10], r[11] = 0, 0, 0, 0
	return append(r,
		0xc0, 12, // the name: a pointer to the question's
		0, 1, 0, 1, // type A, class IN
		0, 0, 0, 30, // TTL
		0, 4, 192, 0, 2, 1)
}

// echoAfterEOF reads c until the client's FIN, then sends back what it
// read, 1 KiB every 10 ms, and closes c.
func echoAfterEOF(c net.Conn) {
	defer c.Close()
	b, err := io.ReadAll(c)
	if err != nil {
		return
	}
	for len(b) > 0 {
		n := min(len(b), 1024)
		if _, err := c.Write(b[:n]); err != nil {
			return
		}
		b = b[n:]
		time.Sleep(10 * time.Millisecond)
	}
}

// serveTCP listens on addr (none when empty) and gives each connection to
// handle, on the accept loop's goroutine; the loop's end goes to errc.
func serveTCP(addr string, errc chan<- error, handle func(net.Conn)) {
	if addr == "" {
		return
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		log.Fatal(err)
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				errc <- err
				return
			}
			handle(c)
		}
	}()
}
