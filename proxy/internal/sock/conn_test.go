package sock

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

func TestDialTCPRefused(t *testing.T) {
	_, err := DialTCP(context.Background(), testutil.ClosedPort(t), time.Second)
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("got %v, want ECONNREFUSED", err)
	}
}

func TestDialTCPTimeout(t *testing.T) {
	start := time.Now()
	_, err := DialTCP(context.Background(), testutil.Blackhole(t), 100*time.Millisecond)
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("got %v, want a timeout", err)
	}
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("%v is not a net.Error with Timeout()", err)
	}
	if d := time.Since(start); d < 100*time.Millisecond {
		t.Fatalf("gave up after %v, before the timeout", d)
	}
}

// dialed is what a dialTCP run by dialAsync returned.
type dialed struct {
	s   *Conn
	err error
}

// dialAsync runs dialTCP on a goroutine of its own.
func dialAsync(ctx context.Context, ep netip.AddrPort, timeout time.Duration) <-chan dialed {
	done := make(chan dialed, 1)
	go func() {
		s, err := DialTCP(ctx, ep, timeout)
		done <- dialed{s, err}
	}()
	return done
}

// A dial waiting on a backend that does not answer ends when the proxier's
// context does (shutdown), not at its timeout.
func TestDialTCPCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	done := dialAsync(ctx, testutil.Blackhole(t), time.Minute)
	// Usually the dial is waiting on the poller by now; if not, it sees the
	// cancelled context when it starts to wait. Either way it must end.
	time.Sleep(50 * time.Millisecond)
	cancel()
	select {
	case d := <-done:
		if !errors.Is(d.err, context.Canceled) {
			t.Fatalf("got %v, want context.Canceled", d.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the dial did not end with its context")
	}
}

// An acceptor gives every connection with the client's address, and a
// closed listener leaves the acceptor's set.
func TestListenerServe(t *testing.T) {
	for _, ip := range []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.IPv6Loopback()} {
		t.Run(ip.String(), func(t *testing.T) {
			ln, err := ListenTCP(netip.AddrPortFrom(ip, 0))
			if err != nil {
				if ip.Is6() {
					t.Skipf("no IPv6 loopback: %v", err)
				}
				t.Fatal(err)
			}
			type accepted struct {
				s    *Conn
				from netip.AddrPort
			}
			acc, err := NewAcceptor()
			if err != nil {
				t.Fatal(err)
			}
			defer acc.Close()
			got := make(chan accepted, 8)
			if err := ln.Serve(acc, func(s *Conn, from netip.AddrPort) { got <- accepted{s, from} }, nil); err != nil {
				t.Fatal(err)
			}
			for i := 0; i < 3; i++ {
				c, err := net.Dial("tcp", ln.Addr().String())
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				select {
				case a := <-got:
					if want := c.LocalAddr().(*net.TCPAddr).AddrPort(); a.from != want {
						t.Errorf("client address %v, want %v", a.from, want)
					}
					if dst := a.s.OriginalDst(ln.Addr()); dst != ln.Addr() {
						t.Errorf("original destination %v, want the listener's %v", dst, ln.Addr())
					}
					a.s.Close()
				case <-time.After(10 * time.Second):
					t.Fatal("connection not accepted")
				}
			}
			if n := acc.Listeners(); n != 1 {
				t.Errorf("acceptor serves %d listeners, want 1", n)
			}
			if err := ln.Close(); err != nil {
				t.Fatal(err)
			}
			if n := acc.Listeners(); n != 0 {
				t.Errorf("acceptor serves %d listeners after Close, want 0", n)
			}
			if err := ln.Close(); !errors.Is(err, net.ErrClosed) {
				t.Errorf("second Close: %v, want net.ErrClosed", err)
			}
			if _, err := net.Dial("tcp", ln.Addr().String()); err == nil {
				t.Error("a closed listener still accepts")
			}
		})
	}
}

// A connect that is still in SYN_SENT when connect(2) returns (any backend
// on another host) waits on the poller and succeeds when the handshake does:
// here the listener's queue is full, so the first SYN is dropped, and a slot
// is freed for its retransmission.
func TestDialTCPWaitsForHandshake(t *testing.T) {
	ap, fd := testutil.FullListener(t)
	done := dialAsync(context.Background(), ap, 30*time.Second)
	// The first SYN goes out at once and is dropped; freeing a slot any time
	// before its retransmission (1 s later) lets the handshake finish then.
	time.Sleep(100 * time.Millisecond)
	select {
	case d := <-done:
		t.Fatalf("the dial ended while the listener's queue was full: %v", d.err)
	default:
	}
	nfd, _, err := syscall.Accept(fd)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(nfd)
	select {
	case d := <-done:
		if d.err != nil {
			t.Fatalf("dial: %v", d.err)
		}
		defer d.s.Close()
		var state byte
		_ = d.s.control(func(fd int) { state, _ = tcpState(fd) })
		if state != tcpEstablished {
			t.Fatalf("TCP state %d after the dial, want ESTABLISHED", state)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the dial did not finish after the listener made room")
	}
}

func TestDialTCPIPv6(t *testing.T) {
	ln, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		t.Skipf("no IPv6 loopback: %v", err)
	}
	defer ln.Close()
	s, err := DialTCP(context.Background(), ln.Addr().(*net.TCPAddr).AddrPort(), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var local netip.AddrPort
	_ = s.control(func(fd int) { local, _ = localAddr(fd) })
	if want := c.RemoteAddr().(*net.TCPAddr).AddrPort(); local != want {
		t.Fatalf("dialled from %v, the listener saw %v", local, want)
	}
}
