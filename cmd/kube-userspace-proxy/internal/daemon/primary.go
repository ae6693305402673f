package daemon

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// primaryAddrs are the node's primary addresses for --nodeport-addresses
// primary, one per family, as single-address prefixes: kube-proxy's
// choice, the Node's first InternalIP of each family (else ExternalIP).
// Without a cluster (--manifests) they are the source addresses of the
// default routes. Waits up to wait for the Node to exist.
func primaryAddrs(ctx context.Context, client kubernetes.Interface, node string, wait time.Duration) ([]netip.Prefix, error) {
	if client == nil {
		return defaultRouteAddrs()
	}
	deadline := time.Now().Add(wait)
	for {
		n, err := client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err == nil {
			if p := nodeAddrs(n); len(p) > 0 {
				return p, nil
			}
			err = fmt.Errorf("node %s lists no InternalIP or ExternalIP", node)
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("--nodeport-addresses primary: %w", err)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

func nodeAddrs(n *v1.Node) []netip.Prefix {
	var out []netip.Prefix
	for _, kind := range []v1.NodeAddressType{v1.NodeInternalIP, v1.NodeExternalIP} {
		for _, a := range n.Status.Addresses {
			ip, err := netip.ParseAddr(a.Address)
			if a.Type != kind || err != nil || hasFamily(out, ip.Is4()) {
				continue
			}
			out = append(out, netip.PrefixFrom(ip, ip.BitLen()))
		}
	}
	return out
}

func hasFamily(ps []netip.Prefix, v4 bool) bool {
	for _, p := range ps {
		if p.Addr().Is4() == v4 {
			return true
		}
	}
	return false
}

// defaultRouteAddrs asks the kernel which source address a packet to the
// documentation prefixes would leave from (a UDP connect sends nothing).
func defaultRouteAddrs() ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, dst := range []string{"192.0.2.1:9", "[2001:db8::1]:9"} {
		c, err := net.Dial("udp", dst)
		if err != nil {
			continue // no default route of that family
		}
		ip := c.LocalAddr().(*net.UDPAddr).AddrPort().Addr().Unmap()
		c.Close()
		out = append(out, netip.PrefixFrom(ip, ip.BitLen()))
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("--nodeport-addresses primary: this node has no default route, so no primary address")
	}
	return out, nil
}
