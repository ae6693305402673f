package sock

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var loopback = netip.MustParseAddr("127.0.0.1")

// within fails the test unless fn returns within d; it returns at once when
// fn does, and leaves fn running (the test fails) when it does not.
func within(t *testing.T, d time.Duration, what string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { fn(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s did not return within %v", what, d)
	}
}

// stuckBackend accepts one connection and never reads from it: a Copy to it
// parks writing once the socket buffers are full. It returns the proxy's
// socket to it and the backend's end (closed with the test).
func stuckBackend(t *testing.T) (*Conn, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := DialTCP(context.Background(), ln.Addr().(*net.TCPAddr).AddrPort(), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	peer, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { peer.Close() })
	return c, peer
}

// A copy parked writing to a peer that stopped reading ends when its
// sockets are aborted, and then closing them waits for nothing: the
// teardown that hung a daemon at SIGTERM (Close alone waits for the parked
// write, os.File's rule).
func TestAbortWakesCopyParkedInWrite(t *testing.T) {
	dst, _ := stuckBackend(t)
	src, client := sockPair(t)
	t.Cleanup(func() { client.Close() })
	var moved atomic.Int64
	copied := make(chan error, 1)
	go func() {
		_, err := Copy(dst, src, func(n int64) { moved.Add(n) }, 0)
		copied <- err
	}()
	// The client pushes until the whole chain (its buffer, src's, dst's
	// and the backend's) is full; then its writes block too.
	go func() {
		buf := make([]byte, 64<<10)
		for {
			if _, err := client.Write(buf); err != nil {
				return
			}
		}
	}()
	// Parked: bytes stop moving.
	testutil.WaitStalled(t, "the copy to park on the full backend", 20*time.Second, 200*time.Millisecond, moved.Load)
	within(t, 5*time.Second, "Abort", func() { src.Abort(); dst.Abort() })
	select {
	case err := <-copied:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("copy returned %v, want net.ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the parked copy did not return after Abort")
	}
	within(t, 5*time.Second, "Close of both sockets", func() { src.Close(); dst.Close() })
	// Abort after Close is allowed and does nothing.
	src.Abort()
}

// Abort wakes a copy parked in a read, and a later wait returns at once.
func TestAbortWakesReadAndStays(t *testing.T) {
	src, client := sockPair(t)
	dst, server := sockPair(t)
	t.Cleanup(func() { client.Close(); server.Close(); src.Close(); dst.Close() })
	copied := make(chan error, 1)
	go func() {
		_, err := Copy(dst, src, func(int64) {}, 0)
		copied <- err
	}()
	if _, err := client.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 5)
	_ = server.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(server, buf); err != nil {
		t.Fatal(err)
	}
	src.Abort()
	select {
	case err := <-copied:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("copy returned %v, want net.ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the copy parked in a read did not return after Abort")
	}
	within(t, 5*time.Second, "a wait after Abort", func() {
		if reset, _ := src.WaitPeerReset(); reset {
			t.Error("WaitPeerReset reported a reset on an aborted socket")
		}
	})
}

// Both sockets of a proxied connection carry keep-alive and TCP_NODELAY:
// the accepted one inherits them (and TCP_INQ) from its listener, the
// dialled one gets TCP_NODELAY at dial and keep-alive from KeepAlive.
func TestConnOptions(t *testing.T) {
	ln, err := ListenTCP(netip.AddrPortFrom(loopback, 0))
	if err != nil {
		t.Fatal(err)
	}
	acceptor, err := NewAcceptor()
	if err != nil {
		t.Fatal(err)
	}
	defer acceptor.Close()
	accepted := make(chan *Conn, 1)
	if err := ln.Serve(acceptor, func(c *Conn, _ netip.AddrPort) { accepted <- c }, nil); err != nil {
		t.Fatal(err)
	}
	dialled, err := DialTCP(context.Background(), ln.Addr(), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer dialled.Close()
	var acc *Conn
	select {
	case acc = <-accepted:
		defer acc.Close()
	case <-time.After(10 * time.Second):
		t.Fatal("not accepted")
	}
	ln.Close()
	// A dialled socket probes only once KeepAlive turns it on.
	_ = dialled.control(func(fd int) {
		if got, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_KEEPALIVE); err != nil || got != 0 {
			t.Errorf("dialled socket before KeepAlive: SO_KEEPALIVE = %d (%v), want 0", got, err)
		}
	})
	if err := dialled.KeepAlive(); err != nil {
		t.Fatal(err)
	}
	for side, c := range map[string]*Conn{"accepted": acc, "dialled": dialled} {
		_ = c.control(func(fd int) {
			for _, o := range []struct {
				name       string
				level, opt int
				want       int
			}{
				{"SO_KEEPALIVE", unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
				{"TCP_KEEPIDLE", unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, 15},
				{"TCP_KEEPINTVL", unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, 15},
				{"TCP_NODELAY", unix.IPPROTO_TCP, unix.TCP_NODELAY, 1},
			} {
				got, err := unix.GetsockoptInt(fd, o.level, o.opt)
				if err != nil || got != o.want {
					t.Errorf("%s socket: %s = %d (%v), want %d", side, o.name, got, err, o.want)
				}
			}
			if side == "accepted" {
				// Copy relies on the inq flag matching the socket.
				got, err := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_INQ)
				if err != nil || (got == 1) != c.inq {
					t.Errorf("accepted socket: TCP_INQ = %d (%v), inq flag %v", got, err, c.inq)
				}
			}
		})
	}
}

func TestDialFailure(t *testing.T) {
	_, err := DialTCP(context.Background(), testutil.ClosedPort(t), time.Second)
	if got := DialFailure(err); got != "refused" {
		t.Errorf("closed port: %q (%v), want refused", got, err)
	}
	_, err = DialTCP(context.Background(), testutil.Blackhole(t), 50*time.Millisecond)
	if got := DialFailure(err); got != "timeout" {
		t.Errorf("blackhole: %q (%v), want timeout", got, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = DialTCP(ctx, testutil.Blackhole(t), time.Minute)
	if got := DialFailure(err); got != "cancelled" {
		t.Errorf("cancelled: %q (%v), want cancelled", got, err)
	}
	for errno, want := range map[syscall.Errno]string{
		syscall.EHOSTUNREACH: "unreachable", syscall.ENETUNREACH: "unreachable", syscall.EMFILE: "file limit",
		syscall.ECONNRESET: "reset", syscall.EPERM: "error", syscall.EADDRNOTAVAIL: "no local port",
	} {
		if got := DialFailure(dialError(netip.AddrPortFrom(loopback, 1), errno)); got != want {
			t.Errorf("%v: %q, want %q", errno, got, want)
		}
	}
}

// A held port keeps others off it until Close.
func TestHoldPort(t *testing.T) {
	for _, udp := range []bool{false, true} {
		network := map[bool]string{false: "tcp4", true: "udp4"}[udp]
		probe := func(ap netip.AddrPort) error {
			if udp {
				c, err := net.ListenUDP(network, net.UDPAddrFromAddrPort(ap))
				if err == nil {
					c.Close()
				}
				return err
			}
			l, err := net.Listen(network, ap.String())
			if err == nil {
				l.Close()
			}
			return err
		}
		free := testutil.ClosedPort(t)
		h, err := HoldPort(udp, free)
		if err != nil {
			t.Fatal(err)
		}
		if err := probe(free); !errors.Is(err, syscall.EADDRINUSE) {
			t.Errorf("%s: binding a held port: %v, want EADDRINUSE", network, err)
		}
		if _, err := HoldPort(udp, free); !errors.Is(err, syscall.EADDRINUSE) {
			t.Errorf("%s: holding a held port: %v, want EADDRINUSE", network, err)
		}
		h.Close()
		h.Close() // twice is harmless
		if err := probe(free); err != nil {
			t.Errorf("%s: after Close: %v", network, err)
		}
	}
	var none *Hold
	none.Close()
}

// The frontend socket's buffers are raised past the kernel's defaults (with
// CAP_NET_ADMIN to exactly the size asked for; the kernel reports double),
// and it reports each datagram's local address.
func TestListenUDP(t *testing.T) {
	c, err := ListenUDP(netip.AddrPortFrom(loopback, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	raw, _ := c.SyscallConn()
	get := func(level, opt int) (v int) {
		_ = raw.Control(func(fd uintptr) { v, _ = unix.GetsockoptInt(int(fd), level, opt) })
		return v
	}
	if os.Geteuid() == 0 {
		if get(unix.SOL_SOCKET, unix.SO_RCVBUF) != 2*udpListenerBuffer || get(unix.SOL_SOCKET, unix.SO_SNDBUF) != 2*udpListenerBuffer {
			t.Fatalf("as root: SO_RCVBUF %d, SO_SNDBUF %d, want %d", get(unix.SOL_SOCKET, unix.SO_RCVBUF),
				get(unix.SOL_SOCKET, unix.SO_SNDBUF), 2*udpListenerBuffer)
		}
	}
	if get(unix.IPPROTO_IP, unix.IP_PKTINFO) != 1 {
		t.Fatal("IP_PKTINFO is off")
	}
	r, err := NewReceiver(c, true)
	if err != nil {
		t.Fatal(err)
	}
	client, err := net.DialUDP("udp4", nil, c.LocalAddr().(*net.UDPAddr))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	if _, err := client.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var got []byte
	var from netip.AddrPort
	var to netip.Addr
	err = r.Next(func(b *Batch) {
		got, from, to = append(got, b.Datagram(0)...), b.From(0), b.To(0)
	})
	if err != nil || string(got) != "ping" || from != client.LocalAddr().(*net.UDPAddr).AddrPort() || to != loopback {
		t.Fatalf("got %q from %v to %v (%v)", got, from, to, err)
	}
	// The reply leaves from the address the datagram came to.
	s, err := NewSender(c, 4)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send([]byte("pong"), to, from); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 100)
	_ = client.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := client.Read(buf); err != nil || string(buf[:n]) != "pong" {
		t.Fatalf("reply %q, %v", buf[:n], err)
	}
}

// A flow socket to a dead UDP port learns of it from the ICMP error: the
// next receive says ECONNREFUSED.
func TestDialUDPDeadPort(t *testing.T) {
	dead, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	ep := dead.LocalAddr().(*net.UDPAddr).AddrPort()
	dead.Close()
	c, err := DialUDP(ep)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, _ := NewSender(c, 4)
	r, _ := NewReceiver(c, false)
	if err := s.Send([]byte("query"), netip.Addr{}, netip.AddrPort{}); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if err := r.Next(func(*Batch) { t.Error("a datagram from a dead port") }); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("receive: %v, want ECONNREFUSED", err)
	}
}

// A refusing port answers as a port without a socket would — a TCP connect
// is reset, a UDP client's next read after its datagram fails with
// ECONNREFUSED (an ICMP port unreachable) — and keeps the port from others,
// on the unspecified address and on a specific one, IPv4 and IPv6.
func TestRefusePort(t *testing.T) {
	for _, bind := range []string{"0.0.0.0", "127.0.0.1", "::", "::1"} {
		for _, udp := range []bool{false, true} {
			network := map[bool]string{false: "tcp", true: "udp"}[udp]
			free := testutil.ClosedPort(t)
			ap := netip.AddrPortFrom(netip.MustParseAddr(bind), free.Port())
			h, err := RefusePort(udp, ap)
			if err != nil {
				t.Fatalf("%s %s: %v", network, ap, err)
			}
			dst := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), ap.Port())
			if ap.Addr().Is6() {
				dst = netip.AddrPortFrom(netip.IPv6Loopback(), ap.Port())
			}
			if _, err := HoldPort(udp, ap); !errors.Is(err, syscall.EADDRINUSE) {
				t.Errorf("%s %s: binding a refusing port: %v, want EADDRINUSE", network, ap, err)
			}
			if udp {
				c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(dst))
				if err != nil {
					t.Fatal(err)
				}
				_, _ = c.Write([]byte("q"))
				_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
				_, err = c.Read(make([]byte, 16))
				c.Close()
				if !errors.Is(err, syscall.ECONNREFUSED) {
					t.Errorf("udp %s: a datagram to it: %v, want ECONNREFUSED", ap, err)
				}
			} else {
				c, err := net.DialTimeout("tcp", dst.String(), 5*time.Second)
				if err == nil {
					c.Close()
				}
				if !errors.Is(err, syscall.ECONNREFUSED) {
					t.Errorf("tcp %s: a connect to it: %v, want ECONNREFUSED", ap, err)
				}
			}
			h.Close()
		}
	}
}
