// Package ports hands out the listeners' ports: from the proxy port range,
// or from the kernel's local port range minus its reserved ports when no
// range is set, each Service port's preferred one first; and it reserves the
// range in the kernel so that no other socket of the node takes its ports.
//
// It owns which ports our sockets hold; the caller owns the sockets (it
// binds them in the callback Take gives each port to). It imports config's
// plain data and the kernel layer's sysctls.
package ports

import (
	"errors"
	"fmt"
	"hash/fnv"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// Allocator hands out ports from a PortRange: the key's preferred port (a
// hash of its name), else the next free one after it, wrapping.
//
// With no range configured it scans the kernel's own range
// (ip_local_port_range, minus ip_local_reserved_ports) instead of binding
// port 0: the kernel's search for a free port walks its bind table, which
// grows with every listener (docs/benchmarks.md, rule programming).
type Allocator struct {
	r       config.PortRange
	sysctls kernel.Sysctls
	warn    func(error) // told once when the kernel's range cannot be read

	mu   sync.Mutex // guards the fields below
	used map[usedPort]bool
	// The kernel's range and reserved ports, read at first use when r is
	// empty; kernel stays nil when they could not be read (port 0 then).
	kernel       *config.PortRange
	kernelResv   map[int]bool
	kernelLoaded bool
}

// Space is a port space: TCP and UDP, IPv4 and IPv6 (our IPv6 sockets are
// v6-only) are separate.
type Space struct {
	UDP, IPv6 bool
}

// SpaceOf is the space of a socket of proto bound to ip.
func SpaceOf(proto config.Protocol, ip netip.Addr) Space {
	return Space{UDP: proto == config.UDP, IPv6: ip.Is6() && !ip.Is4In6()}
}

// usedPort is a port of a space taken by one of our sockets.
type usedPort struct {
	space Space
	port  int
}

// New returns an allocator of r (the kernel's local port range when r is
// empty). warn is told, once, when the kernel's range cannot be read.
func New(r config.PortRange, warn func(error)) *Allocator {
	return &Allocator{r: r, warn: warn}
}

// NewIn is New reading the kernel's settings from sysctls (tests).
func NewIn(r config.PortRange, sysctls kernel.Sysctls, warn func(error)) *Allocator {
	return &Allocator{r: r, sysctls: sysctls, warn: warn}
}

// Range is the allocator's configured range (empty: the kernel's).
func (a *Allocator) Range() config.PortRange { return a.r }

// ErrExhausted is returned when every port of the configured range is taken.
var ErrExhausted = errors.New("no free port left in the proxy port range")

// Take gives bind ports of space s, the one key prefers first (see
// Preferred), until bind succeeds or fails otherwise than with EADDRINUSE
// (another process holds that port). With no range and the kernel's
// unreadable it calls bind(0) once. release gives the port back; call it
// once the socket is closed.
func (a *Allocator) Take(s Space, key string, bind func(port int) error) (release func(), err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	r, reserved := a.r, map[int]bool(nil)
	if r.Size == 0 {
		if !a.kernelLoaded {
			a.kernelLoaded = true
			kr, resv, err := kernelRange(a.sysctls)
			switch {
			case err == nil:
				a.kernel, a.kernelResv = &kr, resv
			case a.warn != nil:
				a.warn(err)
			}
		}
		if a.kernel == nil {
			return func() {}, bind(0)
		}
		r, reserved = *a.kernel, a.kernelResv
	}
	if a.used == nil {
		a.used = make(map[usedPort]bool)
	}
	// From the key's preferred port upwards: the same Services opened in
	// the same order (a bulk sync opens them sorted) get the same ports,
	// so that a restart finds its rules installed as it wants them.
	pref := Preferred(r, key) - r.Base
	for i := 0; i < r.Size; i++ {
		p := r.Base + (pref+i)%r.Size
		u := usedPort{s, p}
		if a.used[u] || reserved[p] {
			continue
		}
		err := bind(p)
		if errors.Is(err, syscall.EADDRINUSE) {
			continue // another process holds it; the port was never ours
		}
		if err != nil {
			return nil, err
		}
		a.used[u] = true
		return func() { a.release(u) }, nil
	}
	if a.r.Size == 0 {
		return nil, fmt.Errorf("no free port left in the kernel's local port range %s", r)
	}
	return nil, ErrExhausted
}

// Hold marks port taken, for a socket this process did not bind (one a
// predecessor lent), and returns its release.
func (a *Allocator) Hold(s Space, port int) (release func()) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.used == nil {
		a.used = make(map[usedPort]bool)
	}
	u := usedPort{s, port}
	a.used[u] = true
	return func() { a.release(u) }
}

func (a *Allocator) release(u usedPort) {
	a.mu.Lock()
	delete(a.used, u)
	a.mu.Unlock()
}

// Preferred is the port of r that a listener named key tries first: the
// same after a restart and after a quick remove and re-add, so that the
// conntrack entries of UDP clients that keep their source port still point
// at it, and a rule sync after a restart changes nothing.
func Preferred(r config.PortRange, key string) int {
	h := fnv.New32a()
	h.Write([]byte(key))
	return r.Base + int(h.Sum32()%uint32(r.Size))
}

// The kernel's ephemeral port range and its reserved ports (per network
// namespace).
const (
	localPortRange    = "net.ipv4.ip_local_port_range"
	localReservedPort = "net.ipv4.ip_local_reserved_ports"
)

// kernelRange reads the kernel's local port range and reserved ports.
func kernelRange(sysctls kernel.Sysctls) (config.PortRange, map[int]bool, error) {
	v, err := sysctls.Read(localPortRange)
	if err != nil {
		return config.PortRange{}, nil, err
	}
	f := strings.Fields(v)
	if len(f) != 2 {
		return config.PortRange{}, nil, fmt.Errorf("%s: unexpected %q", localPortRange, v)
	}
	r, err := config.ParsePortRange(f[0] + "-" + f[1])
	if err != nil || r.Size == 0 {
		return config.PortRange{}, nil, fmt.Errorf("%s: %q: %v", localPortRange, v, err)
	}
	resv := map[int]bool{}
	if v, err := sysctls.Read(localReservedPort); err == nil {
		if resv, err = parseReserved(v); err != nil {
			return config.PortRange{}, nil, err
		}
	}
	return r, resv, nil
}

// UnreservedEphemeral reports whether ports of r inside the kernel's
// ephemeral range (returned) are not in ip_local_reserved_ports: the node's
// own outgoing connections may then take them from the listeners.
func UnreservedEphemeral(r config.PortRange) (ephemeral config.PortRange, unreserved bool, err error) {
	return unreservedEphemeral(kernel.ProcSys, r)
}

func unreservedEphemeral(sysctls kernel.Sysctls, r config.PortRange) (ephemeral config.PortRange, unreserved bool, err error) {
	ephemeral, resv, err := kernelRange(sysctls)
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

// CanReserve reports whether ip_local_reserved_ports may be written here
// (not in a container with a read-only /proc/sys, say).
func CanReserve() bool { return kernel.ProcSys.Writable(localReservedPort) }

// parseReserved reads ip_local_reserved_ports' list ("a-b,c").
func parseReserved(v string) (map[int]bool, error) {
	resv := map[int]bool{}
	for _, part := range strings.Split(strings.TrimSpace(v), ",") {
		if part == "" {
			continue
		}
		pr, err := config.ParsePortRange(part)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", localReservedPort, err)
		}
		for p := pr.Base; p < pr.Base+pr.Size; p++ {
			resv[p] = true
		}
	}
	return resv, nil
}

// Reserve adds r to the kernel's ip_local_reserved_ports (of this network
// namespace), so that no outgoing connection or bind(0) of the node takes a
// port of the range: the proxy ports are guarded by one rule for the whole
// range, which must not catch anybody else's sockets. Ports already bound
// are not affected. It reports whether the list changed.
func Reserve(r config.PortRange) (bool, error) { return editReserved(kernel.ProcSys, r, true) }

// Unreserve takes r out of ip_local_reserved_ports.
func Unreserve(r config.PortRange) (bool, error) { return editReserved(kernel.ProcSys, r, false) }

// editReserved sets (or clears) r in ip_local_reserved_ports and reports
// whether the list changed.
func editReserved(sysctls kernel.Sysctls, r config.PortRange, reserve bool) (bool, error) {
	v, err := sysctls.Read(localReservedPort)
	if err != nil {
		return false, fmt.Errorf("reading reserved ports: %w", err)
	}
	resv, err := parseReserved(v)
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
	if _, err := sysctls.Set(localReservedPort, after); err != nil {
		return false, fmt.Errorf("writing reserved ports: %w", err)
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
