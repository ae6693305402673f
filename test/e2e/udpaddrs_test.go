package e2e

import (
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

// One client port, two addresses of one UDP Service port: its cluster IP
// and its node port. Each is a flow of its own, answered from the address
// it was sent to. (Found by make differential: the kernel hands a node's
// freed UDP port out again within seconds, and a flow keyed by the client
// alone answered the node port's datagrams from the cluster IP, which the
// client's connected socket drops.) From the node itself and from a pod.
func TestUDPOneClientPortTwoAddresses(t *testing.T) {
	cl := newClusterLab(t)
	cl.service(t, &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: "dns"}, Spec: v1.ServiceSpec{
		Type: v1.ServiceTypeNodePort, ClusterIP: "10.96.7.10", Selector: map[string]string{"app": "dns"},
		Ports: []v1.ServicePort{{Name: "dns", Port: 53, Protocol: v1.ProtocolUDP, TargetPort: intstr.FromInt32(8080), NodePort: 30057}}}})
	cl.pod(t, "dns-1", "10.251.19.12", "node", "dns")
	clusterIP := netip.MustParseAddrPort("10.96.7.10:53")
	nodePort := netip.MustParseAddrPort("192.168.50.1:30057")
	// No datagram before the rules: one sent to the cluster IP before its
	// REDIRECT exists leaves a conntrack entry without NAT that every retry
	// from the same port keeps alive, and without conntrack netlink
	// (KUP_E2E_KERNEL=basic) nothing can delete it.
	waitFor(t, "the cluster IP's rules", func() bool {
		out, _ := cl.Exec("node", "iptables-save", "-t", "nat")
		return strings.Contains(out, "-d 10.96.7.10/32")
	})
	for _, from := range []string{"node", "client"} {
		t.Run(from, func(t *testing.T) {
			var c *net.UDPConn
			if err := cluster.InNetns(cl.NS(from), func() error {
				var err error
				c, err = net.ListenUDP("udp4", &net.UDPAddr{Port: 45500})
				return err
			}); err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			ask := func(to netip.AddrPort) (netip.AddrPort, error) {
				if _, err := c.WriteToUDPAddrPort([]byte("who"), to); err != nil {
					return netip.AddrPort{}, err
				}
				_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
				buf := make([]byte, 512)
				_, src, err := c.ReadFromUDPAddrPort(buf)
				return netip.AddrPortFrom(src.Addr().Unmap(), src.Port()), err
			}
			waitFor(t, "the cluster IP answering", func() bool { _, err := ask(clusterIP); return err == nil })
			for i, to := range []netip.AddrPort{nodePort, clusterIP, nodePort} {
				src, err := ask(to)
				if err != nil {
					t.Fatalf("datagram %d to %v from %s:45500: %v", i, to, from, err)
				}
				if src != to {
					t.Fatalf("datagram %d to %v from %s:45500 answered from %v", i, to, from, src)
				}
			}
		})
	}
}
