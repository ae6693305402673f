package sock

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

var labSeq atomic.Int32

// natLab is a node namespace and a backend namespace on one veth link
// (10.0.2.1 and 10.0.2.2, fd00:2::1 and fd00:2::2), the backend's default
// route through the node, and conntrack on in the node (a MASQUERADE rule
// no packet matches: conntrack follows a namespace's connections only once
// a rule needs it, as the daemon's REDIRECT rules do).
type natLab struct{ node, backend string }

func newNATLab(t *testing.T) natLab {
	t.Helper()
	testutil.RequireRoot(t, "it creates network namespaces")
	n := labSeq.Add(1)
	l := natLab{node: fmt.Sprintf("kupnatn%d-%d", os.Getpid(), n), backend: fmt.Sprintf("kupnatb%d-%d", os.Getpid(), n)}
	t.Cleanup(func() {
		_ = exec.Command("ip", "netns", "del", l.node).Run()
		_ = exec.Command("ip", "netns", "del", l.backend).Run()
	})
	for _, c := range [][]string{
		{"ip", "netns", "add", l.node},
		{"ip", "netns", "add", l.backend},
		{"ip", "-n", l.node, "link", "set", "lo", "up"},
		{"ip", "-n", l.backend, "link", "set", "lo", "up"},
		{"ip", "-n", l.node, "link", "add", "tobe", "type", "veth", "peer", "name", "eth0", "netns", l.backend},
		{"ip", "-n", l.node, "addr", "add", "10.0.2.1/24", "dev", "tobe"},
		{"ip", "-n", l.node, "addr", "add", "fd00:2::1/64", "dev", "tobe", "nodad"},
		{"ip", "-n", l.node, "link", "set", "tobe", "up"},
		{"ip", "-n", l.backend, "addr", "add", "10.0.2.2/24", "dev", "eth0"},
		{"ip", "-n", l.backend, "addr", "add", "fd00:2::2/64", "dev", "eth0", "nodad"},
		{"ip", "-n", l.backend, "link", "set", "eth0", "up"},
		{"ip", "-n", l.backend, "route", "add", "default", "via", "10.0.2.1"},
		{"ip", "-n", l.backend, "-6", "route", "add", "default", "via", "fd00:2::1"},
		{"ip", "netns", "exec", l.node, "iptables", "-w", "-t", "nat", "-A", "POSTROUTING", "-d", "192.0.2.255", "-j", "MASQUERADE"},
		{"ip", "netns", "exec", l.node, "ip6tables", "-w", "-t", "nat", "-A", "POSTROUTING", "-d", "2001:db8::ff", "-j", "MASQUERADE"},
	} {
		if out, err := exec.Command(c[0], c[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v: %s", strings.Join(c, " "), err, out)
		}
	}
	return l
}

// in runs fn on a thread in the namespace ns; sockets made there stay in
// it. The thread ends with its goroutine, never back in the pool.
func in(t *testing.T, ns string, fn func()) {
	t.Helper()
	f, err := os.Open("/run/netns/" + ns)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- err
			return
		}
		fn()
		errc <- nil
	}()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// clientNAT is a ClientNAT of n sockets in the node namespace, its ports
// count ports from first, closed when the test ends.
func (l natLab) clientNAT(t *testing.T, n, first, count int) *ClientNAT {
	t.Helper()
	var nat *ClientNAT
	var err error
	in(t, l.node, func() { nat, err = NewClientNAT(n, first, count) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nat.Close)
	return nat
}

// peers listens on addr in the backend and sends each accepted
// connection's peer address to the channel.
func (l natLab) peers(t *testing.T, addr string) <-chan netip.AddrPort {
	t.Helper()
	var ln net.Listener
	var err error
	in(t, l.backend, func() { ln, err = net.Listen("tcp", addr) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	got := make(chan netip.AddrPort, 16)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			got <- c.RemoteAddr().(*net.TCPAddr).AddrPort()
			go func() { // read until the dialer closes: its bytes must be ACKed
				defer c.Close()
				var b [64]byte
				for {
					if _, err := c.Read(b[:]); err != nil {
						return
					}
				}
			}()
		}
	}()
	return got
}

// hold dials ep from the node namespace with src and leaves the
// connection open.
func (l natLab) hold(t *testing.T, ep netip.AddrPort, src Source) *Conn {
	t.Helper()
	var c *Conn
	var err error
	in(t, l.node, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		c, _, err = DialTCPFrom(ctx, ep, 5*time.Second, src)
	})
	if err != nil {
		t.Fatalf("dial %s from %+v: %v", ep, src, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// dialFrom dials ep from the node namespace with src and sends a few bytes,
// waiting until the backend has acknowledged them: the replies, addressed
// to whoever the backend saw, found the dialled socket.
func (l natLab) dialFrom(t *testing.T, ep netip.AddrPort, src Source) Dialed {
	t.Helper()
	var c *Conn
	var d Dialed
	var err error
	in(t, l.node, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		c, d, err = DialTCPFrom(ctx, ep, 5*time.Second, src)
	})
	if err != nil {
		t.Fatalf("dial %s from %+v: %v", ep, src, err)
	}
	defer c.Close()
	if err := c.WriteAll([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, "the backend's ACK of 5 bytes", 5*time.Second, 2*time.Millisecond, func() bool {
		acked, ok := c.Acked()
		return ok && acked >= 5
	})
	return d
}

func TestDialFromClientThroughConntrack(t *testing.T) {
	l := newNATLab(t)
	nat := l.clientNAT(t, 2, 20000, 64)
	for _, fam := range []int{4, 6} {
		if err := nat.Probe(fam); err != nil {
			t.Fatalf("probe IPv%d: %v", fam, err)
		}
	}
	for _, tc := range []struct{ listen, ep, client, node string }{
		{"10.0.2.2:8080", "10.0.2.2:8080", "10.0.1.2", "10.0.2.1"},
		{"[fd00:2::2]:8080", "[fd00:2::2]:8080", "fd00:1::2", "fd00:2::1"},
	} {
		peers := l.peers(t, tc.listen)
		ep, client := netip.MustParseAddrPort(tc.ep), netip.MustParseAddr(tc.client)
		// Many in a row, more than the 64 ports of the range: every dial
		// binds a port of the range and creates its entry; none may be
		// left to the kernel's choice.
		for i := range 100 {
			d := l.dialFrom(t, ep, Source{Client: client, NAT: nat})
			if d.SourceErr != nil || d.Sees != client {
				t.Fatalf("dial %d to %s: %+v, want the backend to see %s", i, ep, d, client)
			}
			if p := <-peers; p.Addr() != client || p.Port() < 20000 || p.Port() >= 20064 {
				t.Fatalf("dial %d to %s: the backend saw %s, want %s from a port of 20000-20063", i, ep, p, client)
			}
		}
		// The client's port too, again and again at once: each dial finds
		// the entry of the one before, takes it over once it is in
		// TIME_WAIT, and keeps the client's address from its own port
		// while that one still closes (its last packets would be taken
		// for the new connection's).
		from40000 := netip.AddrPortFrom(client, 40000)
		for i := range 20 {
			d := l.dialFrom(t, ep, Source{Client: client, Port: 40000, NAT: nat})
			if p := <-peers; d.Sees != client || p.Addr() != client {
				t.Fatalf("dial %d at once from the client's port 40000: %+v, the backend saw %s", i, d, p)
			}
		}
		for i := range 10 {
			testutil.WaitFor(t, "the entry from port 40000 in TIME_WAIT", 10*time.Second, 2*time.Millisecond, func() bool {
				state, err := nat.tcpState(kernel.Reply, ep, from40000)
				return errors.Is(err, syscall.ENOENT) || state == 7 // TCP_CONNTRACK_TIME_WAIT
			})
			d := l.dialFrom(t, ep, Source{Client: client, Port: 40000, NAT: nat})
			if p := <-peers; d.Sees != client || p != from40000 {
				t.Fatalf("dial %d from the client's port 40000 after TIME_WAIT: %+v, the backend saw %s", i, d, p)
			}
		}
		open := l.hold(t, ep, Source{Client: client, Port: 40001, NAT: nat})
		if p := <-peers; p != netip.AddrPortFrom(client, 40001) {
			t.Fatalf("the held connection: the backend saw %s", p)
		}
		if d := l.dialFrom(t, ep, Source{Client: client, Port: 40001, NAT: nat}); d.Sees != client {
			t.Fatalf("a second connection from the held port: %+v", d)
		}
		if p := <-peers; p.Addr() != client || p.Port() == 40001 {
			t.Fatalf("a second connection from the held port: the backend saw %s, want %s from another port", p, client)
		}
		open.Close()
		// Without a source the backend sees the node.
		if d := l.dialFrom(t, ep, Source{}); d.Sees.IsValid() || d.SourceErr != nil {
			t.Fatalf("zero Source: %+v", d)
		}
		if p := <-peers; p.Addr().String() != tc.node {
			t.Fatalf("zero Source: the backend saw %s, want the node's %s", p, tc.node)
		}
		// A client that is the node itself: its own address, bound.
		node := netip.MustParseAddr(tc.node)
		if d := l.dialFrom(t, ep, Source{Client: node, NAT: nat}); d.Sees != node || d.SourceErr != nil {
			t.Fatalf("the node as client: %+v", d)
		}
		if p := <-peers; p.Addr() != node {
			t.Fatalf("the node as client: the backend saw %s", p)
		}
	}
}

// A source NAT that cannot be set up costs the client's address, never the
// connection: it is made from the node's address, and says why.
func TestDialFromFallsBackToTheNode(t *testing.T) {
	l := newNATLab(t)
	var nat *ClientNAT
	var err error
	in(t, l.node, func() { nat, err = NewClientNAT(1, 0, 0) })
	if err != nil {
		t.Fatal(err)
	}
	nat.Close() // every request fails from here on
	peers := l.peers(t, "10.0.2.2:8080")
	d := l.dialFrom(t, netip.MustParseAddrPort("10.0.2.2:8080"), Source{Client: netip.MustParseAddr("10.0.1.2"), NAT: nat})
	if d.Sees.IsValid() || d.SourceErr == nil {
		t.Fatalf("got %+v, want the node's address and an error", d)
	}
	if p := <-peers; p.Addr().String() != "10.0.2.1" {
		t.Fatalf("the backend saw %s, want the node's 10.0.2.1", p)
	}
	// Loopback clients are never bound: the node's address on the route.
	d = l.dialFrom(t, netip.MustParseAddrPort("10.0.2.2:8080"), Source{Client: netip.MustParseAddr("127.0.0.1")})
	if d.Sees.IsValid() {
		t.Fatalf("a loopback client: %+v, want the node's address", d)
	}
	if p := <-peers; p.Addr().String() != "10.0.2.1" {
		t.Fatalf("a loopback client: the backend saw %s", p)
	}
}

func TestSourcePortsInTurn(t *testing.T) {
	s := &sourcePorts{base: 100, size: 3}
	a, b := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
	var got []uint16
	for range 3 {
		p, ok := s.take(a)
		if !ok {
			t.Fatalf("take %v: none free", got)
		}
		got = append(got, p)
	}
	if fmt.Sprint(got) != "[100 101 102]" {
		t.Fatalf("ports taken: %v, want 100 101 102", got)
	}
	if p, ok := s.take(a); ok {
		t.Fatalf("a fourth port %d from a range of 3", p)
	}
	// Another address has ports of its own.
	if p, ok := s.take(b); !ok || p != 100 {
		t.Fatalf("first port for another address: %d %v, want 100", p, ok)
	}
	// A port given back comes round again only after the others.
	s.put(a, 100)
	s.put(a, 102)
	if p, _ := s.take(a); p != 100 {
		t.Fatalf("after 102 the search wraps to 100, got %d", p)
	}
	if p, _ := s.take(a); p != 102 {
		t.Fatalf("then 102, got %d", p)
	}
	s.put(b, 999) // outside the range: ignored
}

// Without TCP timestamps the kernel cannot reuse a connection's TIME_WAIT
// for the next one to the same endpoint from the same port: once every
// port of the range is held by one, a dial goes out from the node's
// address (with the reason), never fails.
func TestDialFromPortsInTimeWait(t *testing.T) {
	l := newNATLab(t)
	in(t, l.node, func() {
		if err := os.WriteFile("/proc/sys/net/ipv4/tcp_timestamps", []byte("0"), 0); err != nil {
			t.Fatal(err)
		}
	})
	nat := l.clientNAT(t, 1, 20000, 4)
	ep, client := netip.MustParseAddrPort("10.0.2.2:8080"), netip.MustParseAddr("10.0.1.2")
	peers := l.peers(t, ep.String())
	for i := range 4 {
		if d := l.dialFrom(t, ep, Source{Client: client, NAT: nat}); d.Sees != client {
			t.Fatalf("dial %d: %+v", i, d)
		}
		<-peers
	}
	// The dialled sockets closed first: the four ports are in TIME_WAIT
	// with ep.
	d := l.dialFrom(t, ep, Source{Client: client, NAT: nat})
	if d.Sees.IsValid() || d.SourceErr == nil || !strings.Contains(d.SourceErr.Error(), "TIME_WAIT") {
		t.Fatalf("with every port in TIME_WAIT: %+v, want the node's address and why", d)
	}
	if p := <-peers; p.Addr().String() != "10.0.2.1" {
		t.Fatalf("the backend saw %s, want the node's 10.0.2.1", p)
	}
}

func TestRouteCache(t *testing.T) {
	var c routeCache
	ep := netip.MustParseAddrPort("127.0.0.2:80")
	if from, err := c.from(ep); err != nil || from != netip.MustParseAddr("127.0.0.1") {
		t.Fatalf("route to %s: %s %v, want 127.0.0.1", ep, from, err)
	}
	// Within its lifetime an entry is the answer; after it, or once
	// forgotten, the route is looked up again.
	other := netip.MustParseAddr("192.0.2.9")
	c.entries[ep.Addr()] = cachedRoute{other, time.Now().Add(time.Minute)}
	if from, _ := c.from(ep); from != other {
		t.Fatalf("a live entry: %s, want %s", from, other)
	}
	c.entries[ep.Addr()] = cachedRoute{other, time.Now().Add(-time.Second)}
	if from, _ := c.from(ep); from != netip.MustParseAddr("127.0.0.1") {
		t.Fatalf("an expired entry: %s, want the route's 127.0.0.1", from)
	}
	c.entries[ep.Addr()] = cachedRoute{other, time.Now().Add(time.Minute)}
	c.forget(ep)
	if from, _ := c.from(ep); from != netip.MustParseAddr("127.0.0.1") {
		t.Fatalf("a forgotten entry: %s, want the route's 127.0.0.1", from)
	}
}

// udpPeers answers every datagram on listen, in the backend namespace, with
// the address it came from.
func (l natLab) udpPeers(t *testing.T, listen string) {
	t.Helper()
	var c net.PacketConn
	var err error
	in(t, l.backend, func() { c, err = net.ListenPacket("udp", listen) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	go func() {
		var b [64]byte
		for {
			_, from, err := c.ReadFrom(b[:])
			if err != nil {
				return
			}
			_, _ = c.WriteTo([]byte(from.(*net.UDPAddr).AddrPort().String()), from)
		}
	}()
}

// udpFlow opens a UDP socket from the node namespace to ep with src, and
// returns it with what its backend saw: the reply, addressed to whoever
// the backend saw, found the socket.
func (l natLab) udpFlow(t *testing.T, ep netip.AddrPort, src Source) (*net.UDPConn, Dialed, func(), netip.AddrPort) {
	t.Helper()
	var c *net.UDPConn
	var d Dialed
	var release func()
	var err error
	in(t, l.node, func() { c, d, release, err = DialUDPFrom(ep, src) })
	if err != nil {
		t.Fatalf("UDP socket to %s from %+v: %v", ep, src, err)
	}
	if _, err := c.Write([]byte("who?")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	var b [64]byte
	n, err := c.Read(b[:])
	if err != nil {
		t.Fatalf("UDP socket to %s from %+v: no reply: %v", ep, src, err)
	}
	return c, d, release, netip.MustParseAddrPort(string(b[:n]))
}

// UDP flows as TCP dials: the client's address and port through the
// conntrack entry, the ports of the range and the entries given back by
// release (so a flow from the client's port can follow one at once), the
// client's address from another port while its port is another flow's.
func TestDialUDPFromClientThroughConntrack(t *testing.T) {
	l := newNATLab(t)
	nat := l.clientNAT(t, 2, 20000, 64)
	for _, tc := range []struct{ listen, ep, client, node string }{
		{"10.0.2.2:8081", "10.0.2.2:8081", "10.0.1.2", "10.0.2.1"},
		{"[fd00:2::2]:8081", "[fd00:2::2]:8081", "fd00:1::2", "fd00:2::1"},
	} {
		l.udpPeers(t, tc.listen)
		ep, client := netip.MustParseAddrPort(tc.ep), netip.MustParseAddr(tc.client)
		from5353 := netip.AddrPortFrom(client, 5353)
		// More flows in a row than the range has ports, each from the
		// client's port 5353: each one's release gives its port and its
		// entry back.
		for i := range 100 {
			c, d, release, saw := l.udpFlow(t, ep, Source{Client: client, Port: 5353, NAT: nat})
			c.Close()
			release()
			if d.SourceErr != nil || d.Sees != client || saw != from5353 {
				t.Fatalf("flow %d to %s: %+v, the backend saw %s, want %s", i, ep, d, saw, from5353)
			}
		}
		// While one flow holds the client's port, a second one from it
		// keeps the client's address from a port of the range.
		c1, _, release1, saw := l.udpFlow(t, ep, Source{Client: client, Port: 5353, NAT: nat})
		if saw != from5353 {
			t.Fatalf("the held flow: the backend saw %s", saw)
		}
		c2, d, release2, saw := l.udpFlow(t, ep, Source{Client: client, Port: 5353, NAT: nat})
		if d.Sees != client || saw.Addr() != client || saw.Port() < 20000 || saw.Port() >= 20064 {
			t.Fatalf("a second flow from the held port: %+v, the backend saw %s, want %s from a port of 20000-20063", d, saw, client)
		}
		for _, c := range []*net.UDPConn{c1, c2} {
			c.Close()
		}
		release1()
		release2()
		// Without a source the backend sees the node; the node as client
		// is bound.
		if c, d, release, saw := l.udpFlow(t, ep, Source{}); d.Sees.IsValid() || saw.Addr().String() != tc.node {
			t.Fatalf("zero Source: %+v, the backend saw %s", d, saw)
		} else {
			c.Close()
			release()
		}
		node := netip.MustParseAddr(tc.node)
		if c, d, release, saw := l.udpFlow(t, ep, Source{Client: node, NAT: nat}); d.Sees != node || saw.Addr() != node {
			t.Fatalf("the node as client: %+v, the backend saw %s", d, saw)
		} else {
			c.Close()
			release()
		}
	}
}

// A client on the node itself gets its own address at the backend with a
// port chosen at connect: with an ephemeral range of 4 ports, 4
// connections to each of two endpoints all keep the node's address (a port
// taken at bind would run out at the fifth), IPv4 and IPv6.
func TestDialFromTheNodeSharesPorts(t *testing.T) {
	l := newNATLab(t)
	if out, err := exec.Command("ip", "netns", "exec", l.node, "sysctl", "-qw", "net.ipv4.ip_local_port_range=40000 40003").CombinedOutput(); err != nil {
		t.Fatalf("sysctl: %v: %s", err, out)
	}
	for _, tc := range []struct{ node, ep1, ep2 string }{
		{"10.0.2.1", "10.0.2.2:9001", "10.0.2.2:9002"},
		{"fd00:2::1", "[fd00:2::2]:9001", "[fd00:2::2]:9002"},
	} {
		node := netip.MustParseAddr(tc.node)
		for _, addr := range []string{tc.ep1, tc.ep2} {
			got := l.peers(t, addr)
			ep := netip.MustParseAddrPort(addr)
			for i := 0; i < 4; i++ {
				var d Dialed
				var err error
				var c *Conn
				in(t, l.node, func() {
					ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
					defer cancel()
					c, d, err = DialTCPFrom(ctx, ep, 5*time.Second, Source{Client: node})
				})
				if err != nil {
					t.Fatalf("connection %d to %s: %v", i+1, ep, err)
				}
				t.Cleanup(func() { c.Close() })
				if d.SourceErr != nil || d.Sees != node {
					t.Fatalf("connection %d to %s: the backend sees %v (%v), want %v", i+1, ep, d.Sees, d.SourceErr, node)
				}
				select {
				case peer := <-got:
					if peer.Addr() != node || peer.Port() < 40000 || peer.Port() > 40003 {
						t.Fatalf("connection %d to %s came from %v", i+1, ep, peer)
					}
				case <-time.After(5 * time.Second):
					t.Fatalf("connection %d to %s: not accepted", i+1, ep)
				}
			}
		}
	}
}

// A dial never takes the conntrack entry of another socket's live
// connection: two processes' ClientNATs over one range (a daemon and its
// successor, each handing out the range's ports from its first) both bind
// the range's first port to the same endpoint, SO_REUSEADDR letting them.
// The second dial takes another port, and the first connection keeps its
// source NAT: its next bytes reach the backend and are acknowledged. Once
// the first connection is adopted (HoldSourcePort) its port is not handed
// out while it is open, and is again once it is closed.
func TestDialFromSparesAnotherSocketsConnection(t *testing.T) {
	l := newNATLab(t)
	old, successor := l.clientNAT(t, 1, 20000, 8), l.clientNAT(t, 1, 20000, 8)
	ep, client := netip.MustParseAddrPort("10.0.2.2:8080"), netip.MustParseAddr("10.0.1.2")
	peers := l.peers(t, ep.String())
	held := l.hold(t, ep, Source{Client: client, NAT: old})
	if p := <-peers; p.Addr() != client || p.Port() != 20000 {
		t.Fatalf("the held connection: the backend saw %s, want %s from port 20000", p, client)
	}
	if d := l.dialFrom(t, ep, Source{Client: client, NAT: successor}); d.Sees != client || d.SourceErr != nil {
		t.Fatalf("the successor's dial: %+v", d)
	}
	if p := <-peers; p.Addr() != client || p.Port() != 20001 {
		t.Fatalf("the successor's dial: the backend saw %s, want %s from port 20001", p, client)
	}
	var sent uint64
	ackedAll := func(what string) {
		t.Helper()
		if err := held.WriteAll([]byte("after")); err != nil {
			t.Fatal(err)
		}
		sent += 5
		testutil.WaitFor(t, what, 5*time.Second, 2*time.Millisecond, func() bool {
			acked, ok := held.Acked()
			return ok && acked >= sent
		})
	}
	ackedAll("the held connection's bytes acknowledged after the successor's dial (its source NAT kept)")

	// Adopted by a third: its first port is not handed out while the
	// connection is open, and is once it is closed.
	adopter := l.clientNAT(t, 1, 20000, 8)
	held.HoldSourcePort(adopter)
	node := netip.MustParseAddr("10.0.2.1")
	if p, _ := adopter.ports.take(node); p != 20001 {
		t.Fatalf("with the adopted connection open the adopter handed out port %d, want 20001", p)
	}
	ackedAll("the adopted connection's bytes acknowledged")
	held.Close()
	adopter.ports.put(node, 20001)
	if !adopter.ports.claim(node, 20000) {
		t.Fatal("the adopted connection's port is still taken after its Close")
	}
}

// UDPOriginalDst tells a datagram a REDIRECT rule sent to a listener from one
// sent to the listener's own address, over IPv4 and IPv6, by the conntrack
// entry the first datagram made; a flow without an entry is not found.
func TestConntrackOriginalDst(t *testing.T) {
	l := newNATLab(t)
	for _, c := range [][]string{
		{"iptables", "-w", "-t", "nat", "-A", "PREROUTING", "-d", "10.96.0.53", "-p", "udp", "--dport", "53", "-j", "REDIRECT", "--to-ports", "5353"},
		{"ip6tables", "-w", "-t", "nat", "-A", "PREROUTING", "-d", "fd00:96::53", "-p", "udp", "--dport", "53", "-j", "REDIRECT", "--to-ports", "5353"},
	} {
		if out, err := exec.Command("ip", append([]string{"netns", "exec", l.node}, c...)...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v: %s", strings.Join(c, " "), err, out)
		}
	}
	for _, c := range [][]string{
		{"ip", "-n", l.backend, "route", "add", "10.96.0.0/16", "via", "10.0.2.1"},
		{"ip", "-n", l.backend, "-6", "route", "add", "fd00:96::/64", "via", "fd00:2::1"},
	} {
		if out, err := exec.Command(c[0], c[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v: %s", strings.Join(c, " "), err, out)
		}
	}
	var ct *kernel.Conntrack
	in(t, l.node, func() {
		var err error
		if ct, err = kernel.OpenConntrack(1); err != nil {
			t.Fatal(err)
		}
	})
	defer ct.Close()
	for _, tc := range []struct{ node, service string }{{"10.0.2.1", "10.96.0.53"}, {"fd00:2::1", "fd00:96::53"}} {
		var ln *net.UDPConn
		in(t, l.node, func() {
			var err error
			if ln, err = net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.MustParseAddrPort("[::]:5353"))); err != nil {
				t.Fatal(err)
			}
		})
		local := netip.AddrPortFrom(netip.MustParseAddr(tc.node), 5353)
		for _, to := range []netip.AddrPort{netip.AddrPortFrom(netip.MustParseAddr(tc.service), 53), local} {
			var peer netip.AddrPort
			in(t, l.backend, func() {
				c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(to))
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				if _, err := c.Write([]byte("q")); err != nil {
					t.Fatal(err)
				}
				peer = c.LocalAddr().(*net.UDPAddr).AddrPort()
			})
			_ = ln.SetReadDeadline(time.Now().Add(5 * time.Second))
			var buf [16]byte
			if _, from, err := ln.ReadFromUDPAddrPort(buf[:]); err != nil || netip.AddrPortFrom(from.Addr().Unmap(), from.Port()) != peer {
				t.Fatalf("to %v: read %v from %v, want from %v", to, err, from, peer)
			}
			got, found, err := ct.UDPOriginalDst(local, peer)
			if err != nil || !found || got != to {
				t.Errorf("UDPOriginalDst(%v from %v) = %v, %v, %v; want %v", local, peer, got, found, err, to)
			}
		}
		ln.Close()
		stranger := netip.AddrPortFrom(netip.MustParseAddr(map[bool]string{true: "10.0.2.9", false: "fd00:2::9"}[local.Addr().Is4()]), 9)
		if _, found, err := ct.UDPOriginalDst(local, stranger); found || err != nil {
			t.Errorf("UDPOriginalDst of a flow that never was: found %v, %v", found, err)
		}
	}
}
