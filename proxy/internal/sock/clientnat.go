package sock

// The client's own address on a backend connection, by conntrack. Before a
// dial connects, it creates the conntrack entry of its own connection (the
// node's address and the port it bound, to the endpoint) with a source NAT
// to the client's address. The backend sees the client. Its replies,
// addressed to the client, meet the same entry wherever they enter this
// node (routed from another node, or bridged from a local pod through
// br_netfilter, as kube-proxy's DNAT needs too), and are turned back into
// replies to the dial's socket. No mark, no policy routing, no
// IP_TRANSPARENT: one netlink request per connection, and per packet only
// the NAT conntrack does for kube-proxy's DNAT.
//
// The entry must be created before the first packet: conntrack only looks
// for NAT rules when it sees a connection's first packet, and then finds
// the entry already there, with the NAT done.

import (
	"errors"
	"net/netip"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// ClientNAT creates conntrack entries with a source NAT through netlink
// sockets of its own (package kernel's Conntrack).
type ClientNAT struct {
	ct     *kernel.Conntrack
	ports  *sourcePorts // nil: ports the kernel picks (sourceports.go)
	routes routeCache
}

// NewClientNAT opens n netlink sockets (at least one). Its dials bind
// local ports first..first+count-1, a range the kernel's automatic choice
// of ports never takes (sourceports.go); count 0 leaves the ports to the
// kernel.
func NewClientNAT(n int, first, count int) (*ClientNAT, error) {
	ct, err := kernel.OpenConntrack(n)
	if err != nil {
		return nil, err
	}
	c := &ClientNAT{ct: ct}
	if count > 0 {
		c.ports = &sourcePorts{base: first, size: count}
	}
	return c, nil
}

// Close closes the netlink sockets once no dial uses them; dials after it
// fail.
func (c *ClientNAT) Close() { c.ct.Close() }

// Probe creates and deletes the entry of a connection between two
// documentation addresses of family 4 or 6 (nothing is sent): it
// fails where the kernel lacks a piece the source NAT needs
// (nf_conntrack_netlink, NAT for the family).
func (c *ClientNAT) Probe(family int) error {
	local, remote, client := netip.MustParseAddrPort("192.0.2.1:9"), netip.MustParseAddrPort("192.0.2.2:9"), netip.MustParseAddr("192.0.2.3")
	if family == 6 {
		local, remote, client = netip.MustParseAddrPort("[2001:db8::1]:9"), netip.MustParseAddrPort("[2001:db8::2]:9"), netip.MustParseAddr("2001:db8::3")
	}
	if err := c.claim(unix.IPPROTO_TCP, local, remote, netip.AddrPortFrom(client, 9)); err != nil && !errors.Is(err, syscall.EEXIST) {
		return err
	}
	return c.release(unix.IPPROTO_TCP, local, remote)
}

// claim creates the entry of the connection from local to remote with a
// source NAT to client: its address, and its port unless that is 0 (then
// local's stays). EEXIST: an entry with one of its two tuples is still
// there (an earlier connection's, in TIME_WAIT; see deleteIfOver).
func (c *ClientNAT) claim(proto uint8, local, remote, client netip.AddrPort) error {
	return c.ct.CreateNAT(proto, local, remote, client)
}

// deleteIfOver deletes the TCP entry whose tuple t goes from src to dst if
// its connection is over; kernel.ErrEntryLive if it is not: a connection
// still open or closing, which would lose its NAT with its entry (another
// socket's: a predecessor's connection, or one transferred from it). nil
// if there is none.
func (c *ClientNAT) deleteIfOver(t kernel.Tuple, src, dst netip.AddrPort) error {
	return c.ct.DeleteIfOver(t, src, dst)
}

// tcpState is the TCP state of the entry whose tuple t goes from src to
// dst (ENOENT: none).
func (c *ClientNAT) tcpState(t kernel.Tuple, src, dst netip.AddrPort) (int, error) {
	return c.ct.TCPState(t, src, dst)
}

// natted says whether the TCP entry of the connection from local to remote
// still replies to client.
func (c *ClientNAT) natted(local, remote netip.AddrPort, client netip.Addr) (bool, error) {
	return c.ct.RepliesTo(local, remote, client)
}

// dropEarlier deletes the entry of an earlier connection (or flow) from
// local to remote, found by a claim for a new one: a TCP entry only once
// its connection is over (kernel.ErrEntryLive if not), a UDP one always.
func (c *ClientNAT) dropEarlier(proto uint8, local, remote netip.AddrPort) error {
	if proto == unix.IPPROTO_TCP {
		return c.deleteIfOver(kernel.Original, local, remote)
	}
	if err := c.release(proto, local, remote); err != nil && !errors.Is(err, syscall.ENOENT) {
		return err
	}
	return nil
}

// release deletes the entry of the connection from local to remote (after
// a dial that failed: no packet of it will come again).
func (c *ClientNAT) release(proto uint8, local, remote netip.AddrPort) error {
	return c.ct.Delete(proto, local, remote)
}
