package sock

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Socket buffer sizes. A client sends in bursts faster than one read loop
// drains at times, and the kernel's default receive buffer drops them, so
// the frontend socket asks for more. A per-flow socket queues one client's
// replies while its goroutine waits for a CPU, and a scheduler's pause must
// not overflow it. A buffer is a limit, not memory taken up front, and the
// kernel's udp_mem bounds all of them together.
const (
	udpListenerBuffer = 4 << 20
	udpFlowBuffer     = 4 << 20
)

// ListenUDP opens a frontend socket on ap (port 0: the kernel picks one)
// that reports the local address each datagram arrived on (IP_PKTINFO or
// IPV6_RECVPKTINFO), with large buffers.
func ListenUDP(ap netip.AddrPort) (*net.UDPConn, error) {
	network := "udp4"
	if familyOf(ap) == 6 {
		network = "udp6"
	}
	c, err := net.ListenUDP(network, net.UDPAddrFromAddrPort(ap))
	if err != nil {
		return nil, err
	}
	setBuffers(c, udpListenerBuffer)
	level, opt := unix.IPPROTO_IP, unix.IP_PKTINFO
	if familyOf(ap) == 6 {
		level, opt = unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO
	}
	if err := setInt(c, level, opt, 1); err != nil {
		c.Close()
		return nil, fmt.Errorf("enable IP_PKTINFO: %w", err)
	}
	return c, nil
}

// DialUDP opens a socket connected to ep: one flow's socket to its
// endpoint. Errors the kernel learns from ICMP (ECONNREFUSED for a dead
// port, EHOSTUNREACH, ENETUNREACH) come back from its next read or send.
func DialUDP(ep netip.AddrPort) (*net.UDPConn, error) {
	c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(ep))
	if err != nil {
		return nil, err
	}
	setBuffers(c, udpFlowBuffer)
	return c, nil
}

// DialUDPFrom is DialUDP from src, as DialTCPFrom: the backend sees the
// client's address (and its port where no other flow holds it) where it
// can, the node's where it cannot, never a failed socket. release gives
// back what src took (the conntrack entry, the port): the caller calls it
// once, after closing the socket. The conntrack entry lives as long as
// conntrack keeps a UDP entry (nf_conntrack_udp_timeout_stream once
// answered); a flow idle past that goes on from the node's address.
func DialUDPFrom(ep netip.AddrPort, src Source) (_ *net.UDPConn, _ Dialed, release func(), _ error) {
	if !src.Client.IsValid() {
		c, err := DialUDP(ep)
		return c, Dialed{}, func() {}, err
	}
	family := familyOf(ep)
	opErr := func(call string, err error) error {
		return &net.OpError{Op: "dial", Net: "udp", Addr: net.UDPAddrFromAddrPort(ep), Err: os.NewSyscallError(call, err)}
	}
	fd, err := unix.Socket(domain(family), unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, Dialed{}, nil, opErr("socket", err)
	}
	b, err := bindSource(fd, ep, src, unix.IPPROTO_UDP)
	if err != nil {
		b.Dialed = Dialed{SourceErr: err} // from the node's address, on the port bound if any
	}
	release = func() { b.undo(src.NAT, unix.IPPROTO_UDP, ep) }
	var sa unix.RawSockaddrInet6
	n := putSockaddr(&sa, ep, family)
	if _, _, errno := unix.RawSyscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&sa)), uintptr(n)); errno != 0 {
		unix.Close(fd)
		release()
		return nil, b.Dialed, nil, opErr("connect", errno)
	}
	f := os.NewFile(uintptr(fd), "udp")
	fc, err := net.FileConn(f) // a duplicate of fd, on Go's poller
	f.Close()
	if err != nil {
		release()
		return nil, b.Dialed, nil, err
	}
	c := fc.(*net.UDPConn)
	setBuffers(c, udpFlowBuffer)
	return c, b.Dialed, release, nil
}

// setBuffers sets both buffers of c to size: SO_RCVBUFFORCE and
// SO_SNDBUFFORCE with CAP_NET_ADMIN (which the daemon has to program
// iptables), else the plain options, which the kernel caps at
// net.core.rmem_max / wmem_max.
func setBuffers(c *net.UDPConn, size int) {
	for _, o := range [][2]int{{unix.SO_RCVBUFFORCE, unix.SO_RCVBUF}, {unix.SO_SNDBUFFORCE, unix.SO_SNDBUF}} {
		if setInt(c, unix.SOL_SOCKET, o[0], size) != nil {
			_ = setInt(c, unix.SOL_SOCKET, o[1], size)
		}
	}
}

// setInt sets an integer socket option on c.
func setInt(c *net.UDPConn, level, opt, value int) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := raw.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), level, opt, value) }); err != nil {
		return err
	}
	return os.NewSyscallError("setsockopt", serr)
}

// The UDP path's reads and sends are RawSyscalls, for the reason the TCP
// copy's are (copy.go): as Syscalls they kept the runtime's monitor
// thread polling and moving Ps between threads. The sockets are non-blocking: the calls never
// block, and waiting is left to Go's poller (deadlines apply).

// Sender sends datagrams on one UDP socket with sendmsg(2): to a
// destination from a given source address (IP_PKTINFO or IPV6_PKTINFO), or,
// given neither, on a connected socket. It holds the message being sent, so
// each goroutine that sends has its own; its wait callback is bound once, so
// a datagram costs no allocation.
type Sender struct {
	raw    syscall.RawConn
	family int
	try    func(fd uintptr) bool // s.attempt
	hdr    unix.Msghdr
	iov    unix.Iovec
	iovs   [batchSize]unix.Iovec // a GSO send's datagrams (batch.go)
	name   unix.RawSockaddrInet6 // or an Inet4 one in its first bytes
	oob    [8]uint64             // an IP_PKTINFO or IPV6_PKTINFO control message, and UDP_SEGMENT's, aligned
	errno  syscall.Errno         // of the last attempt
	// gsoRefused: datagrams of this size or larger are not sent with GSO
	// (the kernel refused a GSO send of this size).
	gsoRefused int
}

// NewSender returns a sender on c, whose family (4 or 6) gives the layout of
// destination and source addresses.
func NewSender(c *net.UDPConn, family int) (*Sender, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	s := &Sender{raw: raw, family: family, gsoRefused: maxDatagram + 1}
	s.try = s.attempt
	return s, nil
}

// Send sends b to to (or to the connected peer when to is not valid) from
// the local address src (the kernel's choice when src is not valid).
func (s *Sender) Send(b []byte, src netip.Addr, to netip.AddrPort) error {
	s.hdr = unix.Msghdr{}
	if len(b) > 0 {
		s.iov.Base = &b[0]
	}
	s.iov.SetLen(len(b))
	s.hdr.Iov = &s.iov
	s.hdr.SetIovlen(1)
	if to.IsValid() {
		s.hdr.Name = (*byte)(unsafe.Pointer(&s.name))
		s.hdr.Namelen = putSockaddr(&s.name, to, s.family)
	}
	if src.IsValid() {
		s.hdr.Control = (*byte)(unsafe.Pointer(&s.oob))
		s.hdr.SetControllen(s.pktinfo(src))
	}
	err := s.raw.Write(s.try)
	s.iov.Base, s.hdr = nil, unix.Msghdr{} // hold no buffer between datagrams
	if err != nil {
		return err
	}
	if s.errno != 0 {
		return &net.OpError{Op: "write", Net: "udp", Err: os.NewSyscallError("sendmsg", s.errno)}
	}
	return nil
}

// attempt is one sendmsg; it returns false (wait for writability) on EAGAIN.
func (s *Sender) attempt(fd uintptr) bool {
	_, s.errno = msgCall(unix.SYS_SENDMSG, fd, &s.hdr)
	return s.errno != unix.EAGAIN
}

// pktinfo writes the control message that sets the source address into
// s.oob and returns its length.
func (s *Sender) pktinfo(src netip.Addr) int {
	h := (*unix.Cmsghdr)(unsafe.Pointer(&s.oob))
	data := unsafe.Add(unsafe.Pointer(&s.oob), unix.CmsgLen(0))
	if s.family == 4 {
		h.Level, h.Type = unix.IPPROTO_IP, unix.IP_PKTINFO
		h.SetLen(unix.CmsgLen(unix.SizeofInet4Pktinfo))
		*(*unix.Inet4Pktinfo)(data) = unix.Inet4Pktinfo{Spec_dst: src.Unmap().As4()}
		return unix.CmsgSpace(unix.SizeofInet4Pktinfo)
	}
	h.Level, h.Type = unix.IPPROTO_IPV6, unix.IPV6_PKTINFO
	h.SetLen(unix.CmsgLen(unix.SizeofInet6Pktinfo))
	*(*unix.Inet6Pktinfo)(data) = unix.Inet6Pktinfo{Addr: src.As16()}
	return unix.CmsgSpace(unix.SizeofInet6Pktinfo)
}

// Receiver reads datagrams from one UDP socket with recvmmsg(2), on the
// frontend socket with the sender's address and the local address each
// datagram arrived on (IP_PKTINFO or IPV6_PKTINFO, which the socket must
// have enabled). One per goroutine.
type Receiver struct {
	raw      syscall.RawConn
	addrs    bool                  // ask for the sender's and the local address
	tryBatch func(fd uintptr) bool // r.attemptBatch, bound once: a wait costs no allocation
	batch    *Batch                // borrowed by attemptBatch for Next
	errno    syscall.Errno         // of the last attemptBatch
}

// NewReceiver returns a receiver on c; with addrs it reports each datagram's
// sender and local address (c must come from ListenUDP).
func NewReceiver(c *net.UDPConn, addrs bool) (*Receiver, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	r := &Receiver{raw: raw, addrs: addrs}
	r.tryBatch = r.attemptBatch
	return r, nil
}

// DatagramFailure names an error of a flow's endpoint socket, in the words
// of the UDP endpoint error metric: "refused" (ICMP port unreachable),
// "unreachable" (ICMP host or network unreachable), or "error" (anything
// else: not the endpoint's doing).
func DatagramFailure(err error) string {
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH), errors.Is(err, syscall.EHOSTDOWN):
		return "unreachable"
	}
	return "error"
}

// HoldUDPFrom is DialUDPFrom's release for c, a flow socket to ep that a
// predecessor dialed and transferred, whose backend sees sees (invalid:
// the node's address): the port c is bound to is taken from nat's range
// (when in it) until release, and the conntrack entry of a source NAT (sees
// is not c's own address) is deleted then. nat may be nil (no source NAT
// for the family).
func HoldUDPFrom(c *net.UDPConn, ep netip.AddrPort, nat *ClientNAT, sees netip.Addr) (release func()) {
	local := c.LocalAddr().(*net.UDPAddr).AddrPort()
	local = netip.AddrPortFrom(local.Addr().Unmap(), local.Port())
	natted := sees.IsValid() && sees.Unmap() != local.Addr()
	var b boundSource
	if nat != nil {
		if nat.ports != nil && nat.ports.claim(local.Addr(), local.Port()) {
			b.putPort = func() { nat.ports.put(local.Addr(), local.Port()) }
		}
		if natted {
			b.local = local
		}
	}
	return func() { b.undo(nat, unix.IPPROTO_UDP, ep) }
}
