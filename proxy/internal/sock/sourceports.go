package sock

// The local ports of source-NATed dials. Such a dial must know its port
// before it connects (the conntrack entry names it), so it binds one
// itself. A port the kernel picks for bind(addr, 0) is one no other socket
// has bound, TIME_WAIT included, and while that TIME_WAIT lasts (60 s) the
// kernel's own choice of a port for any other connection on the node skips
// it: at a few hundred connections a second that a client closes first,
// every port of the node would be in TIME_WAIT and no process on it could
// connect anywhere. So the ports come from a range the kernel's automatic
// choice never takes, the proxy port range (reserved from the ephemeral
// range, or outside it), handed out in turn: one live dial per address and
// port, bound with SO_REUSEADDR so that earlier connections' TIME_WAIT does
// not stand in the way (connect then refuses only the very connection still
// in TIME_WAIT, and the dial takes the next port).

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// sourcePorts hands out the ports of a range to dials from each local
// address, each to one live socket at a time, in turn.
type sourcePorts struct {
	base, size int
	mu         sync.Mutex
	byAddr     map[netip.Addr]*portSet
}

// portSet is one local address's ports of the range: taken ones, and where
// the next search starts.
type portSet struct {
	taken []uint64
	next  int
}

// take is a free port of the range for a dial from addr, the one after the
// last taken where free, so that a port comes round again only after every
// other one has.
func (s *sourcePorts) take(addr netip.Addr) (uint16, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	set := s.byAddr[addr]
	if set == nil {
		if s.byAddr == nil {
			s.byAddr = make(map[netip.Addr]*portSet)
		}
		set = &portSet{taken: make([]uint64, (s.size+63)/64)}
		s.byAddr[addr] = set
	}
	for i := range s.size {
		p := (set.next + i) % s.size
		if set.taken[p/64]&(1<<(p%64)) == 0 {
			set.taken[p/64] |= 1 << (p % 64)
			set.next = (p + 1) % s.size
			return uint16(s.base + p), true
		}
	}
	return 0, false
}

// put gives back a port take handed out.
func (s *sourcePorts) put(addr netip.Addr, port uint16) {
	p := int(port) - s.base
	s.mu.Lock()
	if set := s.byAddr[addr]; set != nil && p >= 0 && p < s.size {
		set.taken[p/64] &^= 1 << (p % 64)
	}
	s.mu.Unlock()
}

// errNoSourcePort says every port of the range is bound by a live dial or
// a listener: the dial goes out from the node's address instead.
var errNoSourcePort = errors.New("every port of the proxy port range is in use from this address")

// bindSourcePort binds fd to a port of the range on from, or with no range
// to one the kernel picks. The returned release gives the port back once
// the socket is closed. reuse (TCP) binds with SO_REUSEADDR, past earlier
// connections' TIME_WAIT; a UDP socket never does, as two UDP sockets with
// it may share a port.
func (c *ClientNAT) bindSourcePort(fd int, from netip.Addr, reuse bool) (netip.AddrPort, func(), error) {
	if c.ports == nil {
		if err := bindTo(fd, netip.AddrPortFrom(from, 0)); err != nil {
			return netip.AddrPort{}, nil, err
		}
		local, err := localAddr(fd)
		return local, func() {}, err
	}
	if reuse {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
			return netip.AddrPort{}, nil, fmt.Errorf("setsockopt SO_REUSEADDR: %w", err)
		}
	}
	// A port can be busy only with one of our listeners (the range is
	// ours): a few tries find a free one unless listeners fill the range.
	for range 64 {
		port, ok := c.ports.take(from)
		if !ok {
			break
		}
		local := netip.AddrPortFrom(from, port)
		err := bindTo(fd, local)
		if errors.Is(err, syscall.EADDRINUSE) {
			c.ports.put(from, port)
			continue
		}
		if err != nil {
			c.ports.put(from, port)
			return netip.AddrPort{}, nil, err
		}
		return local, func() { c.ports.put(from, port) }, nil
	}
	return netip.AddrPort{}, nil, fmt.Errorf("%w (%s)", errNoSourcePort, from)
}

// routeCache remembers the node's address on the route to each endpoint
// for a while: looking it up (a socket, a connect, a getsockname and a
// close) cost as much as the rest of a source-NATed dial. Any address of
// the node would do for the socket's side of the conntrack entry; the one
// on the route is taken so that what the tools show reads as the node's
// connection, and the short lifetime follows a change of the routes.
type routeCache struct {
	mu      sync.Mutex
	entries map[netip.Addr]cachedRoute
}

type cachedRoute struct {
	from    netip.Addr
	expires time.Time
}

const (
	routeCacheTTL  = 5 * time.Second
	routeCacheSize = 4096 // beyond it the cache starts afresh: a bound, and rare
)

// from is the node's address on the route to ep.
func (c *routeCache) from(ep netip.AddrPort) (netip.Addr, error) {
	now := time.Now()
	c.mu.Lock()
	r, ok := c.entries[ep.Addr()]
	c.mu.Unlock()
	if ok && now.Before(r.expires) {
		return r.from, nil
	}
	from, err := routeSource(ep)
	if err != nil {
		return netip.Addr{}, err
	}
	c.mu.Lock()
	if c.entries == nil || len(c.entries) >= routeCacheSize {
		c.entries = make(map[netip.Addr]cachedRoute)
	}
	c.entries[ep.Addr()] = cachedRoute{from, now.Add(routeCacheTTL)}
	c.mu.Unlock()
	return from, nil
}

// forget drops ep's entry: its address could not be bound (gone from the
// node).
func (c *routeCache) forget(ep netip.AddrPort) {
	c.mu.Lock()
	delete(c.entries, ep.Addr())
	c.mu.Unlock()
}

// claim marks port of addr taken, for a socket a predecessor bound to it;
// false when it is outside the range or taken already.
func (s *sourcePorts) claim(addr netip.Addr, port uint16) bool {
	p := int(port) - s.base
	if p < 0 || p >= s.size {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.byAddr == nil {
		s.byAddr = make(map[netip.Addr]*portSet)
	}
	set := s.byAddr[addr]
	if set == nil {
		set = &portSet{taken: make([]uint64, (s.size+63)/64)}
		s.byAddr[addr] = set
	}
	if set.taken[p/64]&(1<<(p%64)) != 0 {
		return false
	}
	set.taken[p/64] |= 1 << (p % 64)
	return true
}
