package proxy

import (
	"errors"
	"fmt"
	"hash/fnv"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
)

// portAllocator hands out ports from a PortRange: the key's preferred port
// (a hash of its name), else the next free one after it, wrapping.
//
// With no range configured it scans the kernel's own range
// (ip_local_port_range, minus ip_local_reserved_ports) instead of binding
// port 0: the kernel's search for a free port walks its bind table and costs
// 1–1.6 ms per listener once ~7000 ports are taken (15 µs for a named port),
// which made 10k ClusterIP services take seconds to open.
type portAllocator struct {
	r    config.PortRange
	mu   sync.Mutex
	used map[usedPort]bool
	// The kernel's range and reserved ports, read at first use when r is
	// empty; kernel stays nil when they could not be read (port 0 then).
	kernel       *config.PortRange
	kernelResv   map[int]bool
	kernelLoaded bool
	warn         func(error) // told once when the kernel's range cannot be read
}

// usedPort is a port taken by one of our sockets: TCP and UDP, IPv4 and IPv6
// (v6-only sockets) are separate port spaces.
type usedPort struct {
	proto config.Protocol
	is6   bool
	port  int
}

// Where the kernel keeps its ephemeral port range (per network namespace).
var (
	localPortRangeFile    = "/proc/sys/net/ipv4/ip_local_port_range"
	localReservedPortFile = "/proc/sys/net/ipv4/ip_local_reserved_ports"
)

// loadKernelRange reads the kernel's local port range and reserved ports.
func loadKernelRange() (config.PortRange, map[int]bool, error) {
	b, err := os.ReadFile(localPortRangeFile)
	if err != nil {
		return config.PortRange{}, nil, err
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return config.PortRange{}, nil, fmt.Errorf("%s: unexpected %q", localPortRangeFile, b)
	}
	r, err := config.ParsePortRange(f[0] + "-" + f[1])
	if err != nil || r.Size == 0 {
		return config.PortRange{}, nil, fmt.Errorf("%s: %q: %v", localPortRangeFile, b, err)
	}
	resv := map[int]bool{}
	if b, err := os.ReadFile(localReservedPortFile); err == nil {
		if resv, err = parseReserved(b); err != nil {
			return config.PortRange{}, nil, err
		}
	}
	return r, resv, nil
}

// UnreservedEphemeral reports whether ports of r inside the kernel's
// ephemeral range (returned) are not in ip_local_reserved_ports: the node's
// own outgoing connections may then take them from the listeners.
func UnreservedEphemeral(r config.PortRange) (ephemeral config.PortRange, unreserved bool, err error) {
	ephemeral, resv, err := loadKernelRange()
	if err != nil {
		return ephemeral, false, err
	}
	for p := max(r.Base, ephemeral.Base); p < min(r.Base+r.Size, ephemeral.Base+ephemeral.Size); p++ {
		if !resv[p] {
			return ephemeral, true, nil
		}
	}
	return ephemeral, false, nil
}

// CanReservePorts reports whether ip_local_reserved_ports may be written
// here (not in a container with a read-only /proc/sys, say).
func CanReservePorts() bool {
	return sock.Writable(localReservedPortFile)
}

// parseReserved reads ip_local_reserved_ports' list ("a-b,c").
func parseReserved(b []byte) (map[int]bool, error) {
	resv := map[int]bool{}
	for _, part := range strings.Split(strings.TrimSpace(string(b)), ",") {
		if part == "" {
			continue
		}
		pr, err := config.ParsePortRange(part)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", localReservedPortFile, err)
		}
		for p := pr.Base; p < pr.Base+pr.Size; p++ {
			resv[p] = true
		}
	}
	return resv, nil
}

// ErrPortsExhausted is returned when every port of --proxy-port-range is taken.
var ErrPortsExhausted = errors.New("no free port left in --proxy-port-range")

// listen opens a listener (TCP) or packet socket (UDP) on ip with a port from
// the range (the kernel's local port range when empty): the one key names
// first (see preferredPort), else the next free one. release gives the port
// back; it must be called once the socket is closed.
func (a *portAllocator) listen(proto config.Protocol, ip netip.Addr, key string) (ln listener, release func(), err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	r, reserved := a.r, map[int]bool(nil)
	if r.Size == 0 {
		if !a.kernelLoaded {
			a.kernelLoaded = true
			kr, resv, err := loadKernelRange()
			switch {
			case err == nil:
				a.kernel, a.kernelResv = &kr, resv
			case a.warn != nil:
				a.warn(err)
			}
		}
		if a.kernel == nil {
			ln, err = listenOn(proto, netip.AddrPortFrom(ip, 0))
			return ln, func() {}, err
		}
		r, reserved = *a.kernel, a.kernelResv
	}
	if a.used == nil {
		a.used = make(map[usedPort]bool)
	}
	// From the key's preferred port upwards: the same Services opened in
	// the same order (a bulk sync opens them sorted) get the same ports,
	// so that a restart finds its rules installed as it wants them.
	pref := preferredPort(r, key) - r.Base
	for i := 0; i < r.Size; i++ {
		p := r.Base + (pref+i)%r.Size
		u := usedPort{proto, ip.Is6() && !ip.Is4In6(), p}
		if a.used[u] || reserved[p] {
			continue
		}
		ln, err = listenOn(proto, netip.AddrPortFrom(ip, uint16(p)))
		if errors.Is(err, syscall.EADDRINUSE) {
			continue // another process holds it; the port was never ours
		}
		if err != nil {
			return listener{}, nil, err
		}
		a.used[u] = true
		return ln, func() { a.release(u) }, nil
	}
	if a.r.Size == 0 {
		return listener{}, nil, fmt.Errorf("no free port left in the kernel's local port range %s", r)
	}
	return listener{}, nil, ErrPortsExhausted
}

// adopt marks port, of a socket a predecessor handed over, taken and
// returns its release.
func (a *portAllocator) adopt(proto config.Protocol, ip netip.Addr, port int) (release func()) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.used == nil {
		a.used = make(map[usedPort]bool)
	}
	u := usedPort{proto, ip.Is6() && !ip.Is4In6(), port}
	a.used[u] = true
	return func() { a.release(u) }
}

// preferredPort is the port of r that a listener named key tries first: the
// same after a restart and after a quick remove and re-add, so that the
// conntrack entries of UDP clients that keep their source port still point at
// it, and a rule sync after a restart changes nothing.
func preferredPort(r config.PortRange, key string) int {
	h := fnv.New32a()
	h.Write([]byte(key))
	return r.Base + int(h.Sum32()%uint32(r.Size))
}

func (a *portAllocator) release(u usedPort) {
	a.mu.Lock()
	delete(a.used, u)
	a.mu.Unlock()
}

// ReservePorts adds r to the kernel's ip_local_reserved_ports (of this
// network namespace), so that no outgoing connection or bind(0) of the node
// takes a port of the range: the proxy ports are guarded by one rule for the
// whole range, which must not catch anybody else's sockets. Ports already
// bound are not affected. It reports whether the list changed.
func ReservePorts(r config.PortRange) (bool, error) { return editReserved(r, true) }

// UnreservePorts takes r out of ip_local_reserved_ports (--cleanup).
func UnreservePorts(r config.PortRange) (bool, error) { return editReserved(r, false) }

// editReserved sets (or clears) r in ip_local_reserved_ports and reports
// whether the list changed.
func editReserved(r config.PortRange, reserve bool) (bool, error) {
	b, err := os.ReadFile(localReservedPortFile)
	if err != nil {
		return false, fmt.Errorf("reading reserved ports: %w", err)
	}
	resv, err := parseReserved(b)
	if err != nil {
		return false, err
	}
	before := formatReserved(resv)
	for p := r.Base; p < r.Base+r.Size; p++ {
		resv[p] = reserve
	}
	after := formatReserved(resv)
	if after == before {
		return false, nil
	}
	if after == "" {
		after = "\n" // an empty write is refused; a newline clears the list
	}
	if err := os.WriteFile(localReservedPortFile, []byte(after), 0o644); err != nil {
		return false, fmt.Errorf("writing %s: %w", localReservedPortFile, err)
	}
	return true, nil
}

// formatReserved renders a port set the way the kernel prints it: "a-b,c".
func formatReserved(resv map[int]bool) string {
	var parts []string
	for p := 0; p <= 65535; p++ {
		if !resv[p] {
			continue
		}
		q := p
		for q+1 <= 65535 && resv[q+1] {
			q++
		}
		if q == p {
			parts = append(parts, strconv.Itoa(p))
		} else {
			parts = append(parts, fmt.Sprintf("%d-%d", p, q))
		}
		p = q
	}
	return strings.Join(parts, ",")
}

// listener is a socket a frontend serves on: a TCP listener or a UDP
// frontend socket, and its port.
type listener struct {
	tcp  *sock.Listener
	udp  *net.UDPConn // from sock.ListenUDP
	port int          // 0: none was opened
}

// close closes the socket.
func (l listener) close() {
	if l.tcp != nil {
		l.tcp.Close()
	}
	if l.udp != nil {
		l.udp.Close()
	}
}

// listenOn opens a listener of proto on ap.
func listenOn(proto config.Protocol, ap netip.AddrPort) (listener, error) {
	switch proto {
	case config.TCP:
		ln, err := sock.ListenTCP(ap)
		if err != nil {
			return listener{}, fmt.Errorf("listen tcp %s: %w", ap, err)
		}
		return listener{tcp: ln, port: int(ln.Addr().Port())}, nil
	case config.UDP:
		c, err := sock.ListenUDP(ap)
		if err != nil {
			return listener{}, fmt.Errorf("listen udp %s: %w", ap, err)
		}
		return listener{udp: c, port: c.LocalAddr().(*net.UDPAddr).Port}, nil
	}
	return listener{}, fmt.Errorf("unknown protocol %q", proto)
}

// RaiseFileLimit sets the soft RLIMIT_NOFILE to the hard limit and returns
// it: every proxied TCP connection holds two sockets, and the default soft
// limit of 1024 would cap the proxy at a few hundred connections.
func RaiseFileLimit() (uint64, error) { return sock.RaiseFileLimit() }

// refuseIf has fe's port refuse connections while no endpoint can serve it
// (refuse), and its listener accept again once one can. Refusing, the
// listener is closed and a socket that refuses holds its port
// (sock.RefusePort): a TCP SYN gets a reset, a UDP datagram an ICMP port
// unreachable, from the first packet and whatever address the rules
// redirected from, at no cost per packet, as kube-proxy's REJECT does.
// Established connections go on. Without a socket on the port the kernel
// would answer the same, but another process could take the port meanwhile.
func (fe *frontend) refuseIf(refuse bool) error {
	if refuse == (fe.refusing != nil) {
		return nil
	}
	if refuse && fe.dp.letGo != nil && (fe.tcp != nil || fe.udp != nil) && fe.opened.port == 0 {
		fe.dp.letGo([]keptKey{fe.keptKey()}) // the keeper's duplicate would keep the port listening
	}
	fe.clearPort()
	if !refuse {
		var ln listener
		err := fe.dp.bindAnew(func() (err error) {
			ln, err = listenOn(fe.protocol, fe.listen)
			return err
		})
		if err != nil {
			return err
		}
		return fe.dp.serve(fe, ln)
	}
	var h *sock.Hold
	err := fe.dp.bindAnew(func() (err error) {
		h, err = sock.RefusePort(fe.protocol == config.UDP, fe.listen)
		return err
	})
	if err != nil {
		return fmt.Errorf("holding %s while no endpoint serves: %w", fe.listen, err)
	}
	fe.refusing = h
	fe.refused.Store(true)
	return nil
}

// clearPort closes what is on fe's port: the listener it was opened with
// and does not serve yet, the socket that refuses for it, or its listener.
func (fe *frontend) clearPort() {
	switch {
	case fe.opened.port != 0:
		fe.opened.close()
		fe.opened = listener{}
	case fe.refusing != nil:
		fe.refusing.Close()
		fe.refusing = nil
		fe.refused.Store(false)
	case fe.tcp != nil:
		fe.tcp.ln.Close()
	case fe.udp != nil:
		fe.udp.close()
	}
}
