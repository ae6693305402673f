package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

// diffClient is one place connections start from: a pod on a node, a node
// itself (where hostNetwork pods live: in this lab they share the node's
// network namespace, so they are one kind of client), or outside the
// cluster (kupc-net, which routes to the nodes).
type diffClient struct {
	name  string // pod@node1, node1, outside
	netns string // under /var/run/netns
	ip    string
	node  int // 0 outside
}

// target is one address of a shape's port, as a client dials it.
type target struct {
	kind  string // cluster-ip, node-port@nodeN, external-ip, lb-ip
	addr  string // host:port
	proto v1.Protocol
	port  string // the Service port's name
}

// observation is what one client saw at one address of one port.
type observation struct {
	Client    string   `json:"client"`
	Target    string   `json:"target"` // kind/port-name/protocol
	Outcome   string   `json:"outcome"`
	Endpoints []string `json:"endpoints,omitempty"` // who answered, as a set
	Sticky    bool     `json:"sticky,omitempty"`    // every answer from one endpoint, over two or more
	Sources   []string `json:"sources,omitempty"`   // what the endpoints saw as the client, classified
	Tries     int      `json:"tries"`
	Failures  []string `json:"failures,omitempty"` // the first few failed tries, as the client saw them
}

func (o observation) key() string { return o.Client + " → " + o.Target }

// labView is what the observer knows of the lab: who is who.
type labView struct {
	clients []diffClient
	podIPs  map[string]string // pool pod → address
	names   map[string]string // address → what it is (client, node1, a pool pod...)
}

// classify names an address an endpoint saw as its client. A node's
// addresses count as one (kube-proxy's masquerade takes the outgoing
// interface's, the bridge's for a local pod; ours dials from the node's),
// and a node client seen by any of its node's addresses is the client.
func (v *labView) classify(c diffClient, ip string) string {
	if ip == c.ip {
		return "client"
	}
	n, ok := v.names[ip]
	if !ok {
		return "other:" + ip
	}
	n = strings.TrimSuffix(n, "-bridge")
	if c.node != 0 && !strings.HasPrefix(c.name, "pod@") && n == nodeName(c.node) {
		return "client"
	}
	return n
}

// tryResult is one connection's result.
type tryResult struct {
	outcome  string // connected, refused, timeout, reset
	endpoint string
	source   string
	err      error
}

const diffTimeout = time.Second

// try makes one connection (or one UDP exchange from a new socket) and
// asks the endpoint who it is and whom it sees.
func try(c diffClient, t target) tryResult {
	ctx, cancel := context.WithTimeout(context.Background(), diffTimeout)
	defer cancel()
	network := "tcp"
	if t.proto == v1.ProtocolUDP {
		network = "udp"
	}
	var conn net.Conn
	var err error
	if network == "udp" {
		conn, err = dialUDPFromUnusedPort(ctx, c.netns, t.addr)
	} else {
		conn, err = cluster.DialContextIn(c.netns)(ctx, network, t.addr)
	}
	if err != nil {
		return tryResult{outcome: failure(err), err: err}
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(diffTimeout))
	var host, seen string
	if network == "udp" {
		host, err = udpAsk(conn, "hostname")
		if err == nil {
			seen, err = udpAsk(conn, "clientip")
		}
	} else {
		br := bufio.NewReader(conn)
		host, err = httpAsk(conn, br, "/hostname")
		if err == nil {
			seen, err = httpAsk(conn, br, "/clientip")
		}
	}
	if err != nil {
		return tryResult{outcome: failure(err), err: fmt.Errorf("%s: %w", conn.LocalAddr(), err)}
	}
	ip, _, splitErr := net.SplitHostPort(strings.TrimSpace(seen))
	if splitErr != nil {
		ip = strings.TrimSpace(seen)
	}
	return tryResult{outcome: "connected", endpoint: strings.TrimSpace(host), source: ip}
}

// UDP tries send from ports below the kernel's ephemeral range, each
// port once per pass through udpSourcePorts: a port the kernel hands out
// again would meet the flow an earlier try left (its conntrack entry, or
// ours), whose endpoint was chosen before the shape's last edit, and the
// run would compare two proxies' leftovers rather than their answers. A
// pass takes minutes, far longer than either proxy keeps an idle flow.
const (
	udpSourcePortFirst = 20000
	udpSourcePorts     = 10000 // below the lab's node ports (30000-32767)
)

var nextUDPSourcePort atomic.Uint32

func dialUDPFromUnusedPort(ctx context.Context, netns, addr string) (net.Conn, error) {
	var lastErr error
	const tries = 16
	for range tries {
		port := udpSourcePortFirst + int(nextUDPSourcePort.Add(1)%udpSourcePorts)
		var c net.Conn
		err := cluster.InNetns(netns, func() error {
			var err error
			c, err = (&net.Dialer{LocalAddr: &net.UDPAddr{Port: port}}).DialContext(ctx, "udp", addr)
			return err
		})
		if !errors.Is(err, syscall.EADDRINUSE) {
			return c, err
		}
		lastErr = err // a node's listener or another client holds it: the next one
	}
	return nil, fmt.Errorf("no free UDP source port in %d tries: %w", tries, lastErr)
}

func udpAsk(c net.Conn, q string) (string, error) {
	if _, err := c.Write([]byte(q)); err != nil {
		return "", err
	}
	buf := make([]byte, 512)
	n, err := c.Read(buf)
	return string(buf[:n]), err
}

func httpAsk(c net.Conn, br *bufio.Reader, path string) (string, error) {
	if _, err := fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: differential\r\n\r\n", path); err != nil {
		return "", err
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("HTTP %d", resp.StatusCode)
	}
	return string(b), nil
}

// failure names a failed connection the way a user tells them apart.
func failure(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return "unreachable"
	case errors.Is(err, syscall.EPERM), errors.Is(err, syscall.EACCES):
		// A rule of this node's output path rejected it: the sender is told
		// at once, without a packet.
		return "rejected"
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, syscall.EPIPE):
		return "reset"
	}
	return "error:" + err.Error()
}

// observe makes up to tries connections from c to t, one after another,
// and sums them up. Failures end it early: two that are all it saw, or
// four among answers (a timeout costs a second each).
func (v *labView) observe(c diffClient, t target, tries int) observation {
	o := observation{Client: c.name, Target: t.kind + "/" + t.port + "/" + string(t.proto)}
	o.add(v, c, t, tries)
	return o
}

// add makes more tries into o.
func (o *observation) add(v *labView, c diffClient, t target, tries int) {
	outcomes := map[string]int{}
	for k := range strings.SplitSeq(o.Outcome, "+") {
		if k != "" {
			outcomes[k] = 1
		}
	}
	eps, srcs := toSet(o.Endpoints), toSet(o.Sources)
	answers, failed := 0, 0
	for i := 0; i < tries; i++ {
		r := try(c, t)
		o.Tries++
		outcomes[r.outcome]++
		if r.outcome != "connected" {
			failed++
			if len(o.Failures) < 3 {
				o.Failures = append(o.Failures, fmt.Sprintf("try %d at %s: %v", o.Tries, time.Now().Format("15:04:05.000"), r.err))
			}
			if failed >= 2 && len(outcomes) == 1 || failed >= 4 {
				break // the outcome is known; more failures only cost their timeouts
			}
			continue
		}
		answers++
		eps[r.endpoint] = true
		srcs[v.classify(c, r.source)] = true
	}
	o.Outcome = strings.Join(sortedKeys(outcomes), "+")
	o.Endpoints, o.Sources = sortedKeys(eps), sortedKeys(srcs)
	o.Sticky = answers >= 2 && len(eps) == 1
}

func toSet(v []string) map[string]bool {
	m := map[string]bool{}
	for _, x := range v {
		m[x] = true
	}
	return m
}

func sortedKeys[V any](m map[string]V) []string { return slices.Sorted(maps.Keys(m)) }

// healthCheck asks node i's healthCheckNodePort from outside, as a cloud
// load balancer does: the status and how many local endpoints it counts.
func healthCheck(i int, port int32) string {
	ctx, cancel := context.WithTimeout(context.Background(), diffTimeout)
	defer cancel()
	hc := &http.Client{Transport: &http.Transport{DialContext: cluster.DialContextIn(netNS), DisableKeepAlives: true}}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://%s/", net.JoinHostPort(nodeAddr(i), strconv.Itoa(int(port)))), nil)
	resp, err := hc.Do(req)
	if err != nil {
		return failure(err)
	}
	defer resp.Body.Close()
	var body struct {
		LocalEndpoints int `json:"localEndpoints"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&body)
	return fmt.Sprintf("HTTP %d, localEndpoints %d", resp.StatusCode, body.LocalEndpoints)
}
