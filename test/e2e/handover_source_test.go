package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

// detectionArgs turn local-traffic detection on as kubeadm's config does
// (clusterCIDR): a pod of this node keeps its address at the backend.
var detectionArgs = []string{"--cluster-cidr", "10.251.19.0/24,fd00:251::/64"}

// localService is lab/local: port 80 of both pods behind the externalIP
// 203.0.113.13 with externalTrafficPolicy Local, whose external clients
// keep their address.
func localService() string {
	return "---\n" + service("local", "LoadBalancer", "10.96.0.13", "  externalIPs: [203.0.113.13]\n  externalTrafficPolicy: Local\n",
		`{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 31343}`) + slices("local", `{name: http, port: 8080, protocol: TCP}`, false)
}

// heldConn is a keep-alive connection held across handovers, with the pod
// it reached and the client address that pod must go on seeing.
type heldConn struct {
	name      string
	k         *keepAlive
	pod, sees string
}

// Connections held across handovers the way a kubeadm node runs us
// (local-traffic detection on): idle keep-alive connections whose backend
// sees its client (pods of this node over IPv4 and IPv6, the node itself,
// an external client of an externalTrafficPolicy: Local Service) and one
// whose backend sees the node (an external client of a Cluster Service).
// New connections to the same Service sweep the successor's source ports
// meanwhile, so that the successor dials from the very ports, to the very
// endpoints, of the connections it adopts. After every handover each
// held connection is answered by its pod, which still sees its client.
func TestHandoverKeepsTransparentConnections(t *testing.T) {
	h := newHandoverLab(t)
	base, err := os.ReadFile(h.manifest)
	if err != nil {
		t.Fatal(err)
	}
	writeManifest(t, h.manifest, string(base)+localService())
	h.args = append(append(h.args, detectionArgs...), "--connection-log", "all")
	cur := h.daemon()
	// Every address the held connections dial is served before they
	// dial: each family's rules are their own write, and a SYN sent before
	// its rule exists is never redirected (conntrack keeps the first
	// packet's decision), so the dial would time out.
	waitFor(t, "the ClusterIP", func() bool { return h.Curl("client", "http://10.96.0.10/") != "" })
	waitFor(t, "the IPv6 ClusterIP", func() bool { return h.Curl("client", "http://[fd00:96::10]/") != "" })
	waitFor(t, "the Local externalIP", func() bool { return h.Curl("ext", "http://203.0.113.13/") != "" })
	waitFor(t, "the Cluster externalIP", func() bool { return h.Curl("ext", "http://203.0.113.10/") != "" })

	var held []*heldConn
	hold := func(name, ns, addr, sees string) {
		k := dialKeepAliveIn(t, h.Lab, ns, addr)
		pod, peer, err := k.ask()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if !seenOK(peer, sees) {
			t.Fatalf("%s: the backend sees %s, want %s", name, peer, sees)
		}
		held = append(held, &heldConn{name: name, k: k, pod: pod, sees: peer})
	}
	for i := range 4 {
		hold(fmt.Sprintf("pod → ClusterIP #%d", i), "client", "10.96.0.10:80", "10.251.19.20")
	}
	for i := range 2 {
		hold(fmt.Sprintf("pod → IPv6 ClusterIP #%d", i), "client", "[fd00:96::10]:80", "fd00:251::20")
	}
	hold("node → ClusterIP", "node", "10.96.0.10:80", "192.168.50.1")
	hold("external → eTP Local", "ext", "203.0.113.13:80", "192.168.50.2")
	hold("external → eTP Cluster", "ext", "203.0.113.10:80", "10.251.19.1")

	// Mid-stream both ways: a client pushing through the echo Service
	// (its backend seeing the pod) while it reads the echo back, and UDP
	// clients on one source port each, IPv4 and IPv6.
	stream := startEchoStream(t, h.Lab, "10.96.0.20:7")
	udp4 := startUDPClient(t, h.Lab, 45331, "10.96.0.10:53")
	udp6 := startUDPClient(t, h.Lab, 45332, "[fd00:96::10]:53")

	ld := startLoad(h.Lab, "10.96.0.10:80")
	n := 10
	if v, err := strconv.Atoi(os.Getenv("KUP_HANDOVERS")); err == nil && v > 0 {
		n = v
	}
	for i := 1; i <= n; i++ {
		waitHandoverSocket(t, cur)
		next := h.daemon()
		waitLog(t, next, "Took the predecessor's connections")
		// The successor's first dials take its first ports: the ones
		// the held connections were made from.
		for j := range 40 {
			if body := h.Curl("client", "http://10.96.0.10/"); !seenOK(peerOf(body), "10.251.19.20") {
				t.Fatalf("handover %d, new connection %d: %q", i, j, body)
			}
		}
		_ = cur.Cmd.Process.Signal(syscall.SIGTERM)
		if err := cur.Cmd.Wait(); err != nil {
			t.Fatalf("handover %d: the old daemon: %v", i, err)
		}
		for _, c := range held {
			pod, peer, err := c.k.ask()
			if err != nil || pod != c.pod || peer != c.sees {
				t.Fatalf("handover %d: %s (%s, seeing %s) answered %q seeing %q, %v\nthe old daemon:\n%s\nthe successor:\n%s",
					i, c.name, c.pod, c.sees, pod, peer, err, tail(cur.Output(), 3000), tail(next.Output(), 3000))
			}
		}
		cur = next
	}
	if sent, err := stream.end(); err != nil {
		t.Errorf("the echo stream across %d handovers: %v", n, err)
	} else {
		t.Logf("echo stream: %d MB both ways", sent>>20)
	}
	udp4.end(t)
	udp6.end(t)
	tries, fails, errs := ld.end()
	t.Logf("%d handovers, %d held connections kept; load: %d connections, %d failed", n, len(held), tries, fails)
	if fails > 0 {
		t.Errorf("%d of %d new connections failed: %v", fails, tries, errs)
	}
}

// echoStream pushes bytes through an echo Service from the client pod and
// reads them back at the same time, until end: a connection in the middle
// of a transfer in both directions at any moment.
type echoStream struct {
	c    net.Conn
	stop chan struct{}
	sent atomic.Int64
	werr chan error
	rerr chan error
}

func startEchoStream(t *testing.T, l *Lab, addr string) *echoStream {
	t.Helper()
	var c net.Conn
	waitFor(t, "the echo Service", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		var err error
		c, err = cluster.DialContextIn(l.NS("client"))(ctx, "tcp", addr)
		if err == nil && echo(c, "first") == nil {
			return true
		}
		if c != nil {
			c.Close()
		}
		return false
	})
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Time{})
	e := &echoStream{c: c, stop: make(chan struct{}), werr: make(chan error, 1), rerr: make(chan error, 1)}
	chunk := make([]byte, 32<<10)
	for i := range chunk {
		chunk[i] = byte(i * 13)
	}
	go func() {
		for {
			select {
			case <-e.stop:
				e.werr <- c.(*net.TCPConn).CloseWrite()
				return
			default:
			}
			_ = c.SetWriteDeadline(time.Now().Add(10 * time.Second))
			if _, err := c.Write(chunk); err != nil {
				e.werr <- err
				return
			}
			e.sent.Add(int64(len(chunk)))
			time.Sleep(time.Millisecond) // ~30 MB/s at most: the stream spans every handover
		}
	}()
	go func() {
		buf := make([]byte, 64<<10)
		var got int64
		for {
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
			n, err := c.Read(buf)
			for i := range n {
				if buf[i] != chunk[(got+int64(i))%int64(len(chunk))] {
					e.rerr <- fmt.Errorf("byte %d differs", got+int64(i))
					return
				}
			}
			got += int64(n)
			if err == io.EOF {
				if got != e.sent.Load() {
					err = fmt.Errorf("echoed %d bytes of %d", got, e.sent.Load())
				} else {
					err = nil
				}
				e.rerr <- err
				return
			}
			if err != nil {
				e.rerr <- fmt.Errorf("after %d bytes: %w", got, err)
				return
			}
		}
	}()
	return e
}

// end stops the writer, sends the FIN and waits for every byte to come
// back, then the echo's FIN.
func (e *echoStream) end() (int64, error) {
	close(e.stop)
	if err := <-e.werr; err != nil {
		return e.sent.Load(), fmt.Errorf("writing: %w", err)
	}
	return e.sent.Load(), <-e.rerr
}
