package e2e

import (
	"fmt"
	"os"
	"strconv"
	"syscall"
	"testing"
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
	writeManifest(t, h.manifest, webManifest()+localService())
	h.args = append(append(h.args, detectionArgs...), "--connection-log", "all")
	cur := h.daemon()
	waitFor(t, "the ClusterIP", func() bool { return h.Curl("client", "http://10.96.0.10/") != "" })
	waitFor(t, "the Local externalIP", func() bool { return h.Curl("ext", "http://203.0.113.13/") != "" })

	var held []*heldConn
	hold := func(name, ns, addr, sees string) {
		k := dialKeepAliveIn(t, h.Lab, ns, addr)
		pod, peer, err := k.ask()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if peer != sees {
			t.Fatalf("%s: the backend sees %s, want %s", name, peer, sees)
		}
		held = append(held, &heldConn{name: name, k: k, pod: pod, sees: sees})
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

	ld := startLoad(h.Lab, "10.96.0.10:80")
	n := 10
	if v, err := strconv.Atoi(os.Getenv("KUP_HANDOVERS")); err == nil && v > 0 {
		n = v
	}
	for i := 1; i <= n; i++ {
		next := h.daemon()
		waitLog(t, next, "Adopted the predecessor's connections")
		// The successor's first dials take its first ports: the ones
		// the held connections were made from.
		for j := range 40 {
			if body := h.Curl("client", "http://10.96.0.10/"); peerOf(body) != "10.251.19.20" {
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
	tries, fails, errs := ld.end()
	t.Logf("%d handovers, %d held connections kept; load: %d connections, %d failed", n, len(held), tries, fails)
	if fails > 0 {
		t.Errorf("%d of %d new connections failed: %v", fails, tries, errs)
	}
}
