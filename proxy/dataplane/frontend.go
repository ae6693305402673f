package dataplane

// A Frontend is one live listener with its balancer: opened by the
// Dataplane (Open), told what to serve by the sync goroutine (ServeAs),
// stopped by it, its port given back once the rules no longer point at it
// (Release).

import (
	"fmt"
	"net/netip"
	"sync/atomic"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/clientaddr"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
)

// Key names a frontend: one service port's listener of one kind and family.
type Key struct {
	Name   config.ServicePortName
	Kind   config.Kind
	Family int
}

// KeyOf is the key of the listener behind f.
func KeyOf(f config.Frontend) Key { return Key{f.Service.Name, f.Kind, f.Family} }

// String names a listener: service port, kind and family.
func (k Key) String() string { return fmt.Sprintf("%s/%s/%d", k.Name, k.Kind, k.Family) }

// Frontend is a live listener with its balancer, serving one key: a TCP
// server or a UDP server, never both. It is created by the dataplane and
// closed by the reconciler; its connections and flows belong to its server.
type Frontend struct {
	dp          *Dataplane
	key         Key
	protocol    config.Protocol     // fixed: another protocol is another frontend
	spec        *config.ServicePort // the sync goroutine's: connections never read it
	bal         *balance.Balancer
	listen      netip.AddrPort
	nodePortErr error      // the NodePort could not be taken
	onNodePort  bool       // the listener sits on the NodePort itself
	hold        *sock.Hold // holds the NodePort when the listener is elsewhere, or nil
	releasePort func()

	// proxyProto is the PROXY protocol version of the spec (a string),
	// read by connection goroutines while the sync goroutine may change it.
	proxyProto atomic.Value
	// sourcePolicy decides whose address the backends see (package clientaddr);
	// replaced by the sync goroutine, read by connection goroutines.
	sourcePolicy atomic.Pointer[clientaddr.Policy]

	m *feMetrics
	// opened is the listener dataplane.open made, until the first serveAs
	// has the balancer hold the endpoints and serves on it: an inherited
	// socket already has connections waiting (a handover's, a crash's),
	// which must not meet a balancer without endpoints.
	opened listener
	tcp    *tcpServer // one of tcp and udp is set once serving
	udp    *udpServer
	// refusing holds the port while no endpoint can serve: the listener
	// is closed and a socket that refuses sits on its port (refuse), so a
	// client is refused at connect as kube-proxy's REJECT does. The sync
	// goroutine's; refused tells other goroutines.
	refusing *sock.Hold
	refused  atomic.Bool
	// noLocal says which Local policies of the port find no endpoint on
	// this node while the cluster has some (noLocalInternal,
	// noLocalExternal), for kube-proxy's metric; set by the sync goroutine.
	noLocal atomic.Uint32
}

// tcpServer is a frontend's TCP listener; the accept loop is the
// dataplane's, the connections are in its connection table (conns.go).
type tcpServer struct {
	ln *sock.Listener
}

// log is the frontend's logger, made when something is said: a fields map
// kept per frontend would cost memory for every Service.
func (fe *Frontend) log() logrus.FieldLogger {
	return fe.dp.cfg.log().WithFields(logrus.Fields{
		"service": fe.key.Name.String(), "protocol": fe.protocol, "family": fe.key.Family, "kind": fe.key.Kind, "listen": fe.listen.Port(),
	})
}

// debug writes one of the frontend's debug lines, without making its logger
// when debug lines are off: some come per connection or per datagram.
func (fe *Frontend) debug(fields logrus.Fields, err error, msg string) {
	if !DebugEnabled(fe.dp.cfg.log()) {
		return
	}
	l := fe.log().WithFields(fields)
	if err != nil {
		l = l.WithError(err)
	}
	l.Debug(msg)
}

// Serve is what a sync decided a frontend takes.
type Serve struct {
	Endpoints []netip.AddrPort // its balancer's
	NoLocal   uint32           // its Local policies with no endpoint on this node (proxy's noLocalPolicies)
	Source    *clientaddr.Policy
	Outlier   balance.OutlierConfig
	// Serving are the endpoints a UDP frontend keeps its flows to; nil
	// keeps them all (a new frontend has none).
	Serving map[netip.AddrPort]bool
	// Picks are a predecessor's pick state (nil: none).
	Picks *balance.PickState
}

// ServeAs has fe serve sp as s says: its settings, its balancer's
// endpoints (and a predecessor's picks, once they are set), its UDP flows
// off endpoints that left, the listener it was opened with served, and its
// port refusing while no endpoint can serve (listener.go), in that order:
// the balancer holds the endpoints before a listener that was opened, or
// refused, accepts. On the sync goroutine.
func (fe *Frontend) ServeAs(sp *config.ServicePort, s Serve) error {
	fe.proxyProto.Store(sp.ProxyProtocol)
	fe.sourcePolicy.Store(s.Source)
	fe.noLocal.Store(s.NoLocal)
	fe.bal.Update(s.Endpoints, sp.AffinityTimeout, s.Outlier, sp.Scheduler)
	if s.Picks != nil {
		fe.bal.ImportPicks(*s.Picks)
	}
	if fe.udp != nil && s.Serving != nil {
		fe.udp.endFlowsOff(s.Serving)
	}
	if ln := fe.opened; ln.port != 0 && len(s.Endpoints) > 0 { // without endpoints refuseIf closes it
		fe.opened = listener{}
		if err := fe.dp.startServing(fe, ln); err != nil {
			return err
		}
	}
	return fe.refuseIf(len(s.Endpoints) == 0)
}

// Stop stops accepting; established TCP connections go on (they belong to
// the connection table), UDP flows end with the socket. The port stays
// taken in the allocator until release.
func (fe *Frontend) Stop() {
	fe.dp.budget.listeners.Add(-1)
	if fe.hold != nil {
		fe.dp.budget.listeners.Add(-1)
	}
	fe.clearPort()
	fe.hold.Close()
}

// Discard closes a frontend that never served (a NodePort retake that
// failed), quietly, and gives its port back.
func (fe *Frontend) Discard() {
	fe.Stop()
	fe.Release()
}

// source is the Source of a dial to ep for a connection from client to
// dst (invalid: not known, a UDP flow's), and whether the client's address
// is wanted (a Source that cannot give it is a fallback).
func (fe *Frontend) source(client, dst, ep netip.AddrPort) (sock.Source, bool) {
	return fe.dp.source.Source(fe.sourcePolicy.Load(), client, dst, ep)
}

// Key is the key fe serves.
func (fe *Frontend) Key() Key { return fe.key }

// Listen is the address fe listens on (its port the proxy port the rules
// redirect to).
func (fe *Frontend) Listen() netip.AddrPort { return fe.listen }

// NodePortErr is why fe could not take its NodePort, or nil.
func (fe *Frontend) NodePortErr() error { return fe.nodePortErr }

// Spec is the service port fe serves as of the last sync; the sync
// goroutine's (connections never read it).
func (fe *Frontend) Spec() *config.ServicePort { return fe.spec }

// SetSpec records the service port fe serves. On the sync goroutine.
func (fe *Frontend) SetSpec(sp *config.ServicePort) { fe.spec = sp }

// HoldsNodePort says whether fe holds its Service's NodePort: a socket
// that holds it, or its listener on it.
func (fe *Frontend) HoldsNodePort() bool {
	return fe.hold != nil || (fe.spec.NodePort != 0 && int(fe.listen.Port()) == fe.spec.NodePort)
}

// Balancer is fe's balancer.
func (fe *Frontend) Balancer() *balance.Balancer { return fe.bal }

// Refusing says whether fe's port refuses (no endpoint can serve).
func (fe *Frontend) Refusing() bool { return fe.refused.Load() }

// NoLocal is what ServeAs was last told of fe's Local policies.
func (fe *Frontend) NoLocal() uint32 { return fe.noLocal.Load() }

// UDPFlows counts a UDP frontend's live and evicted flows (0 for TCP).
func (fe *Frontend) UDPFlows() (active int, evicted uint64) {
	if fe.udp == nil {
		return 0, 0
	}
	return fe.udp.counts()
}

// Log is fe's logger.
func (fe *Frontend) Log() logrus.FieldLogger { return fe.log() }

// Release gives fe's port back to the allocator, once fe is stopped and
// no rule points at the port any more. On the sync goroutine.
func (fe *Frontend) Release() { fe.releasePort() }

// Service is fe's service port's name as its metrics' service label says
// it ("namespace/name:port"), made once.
func (fe *Frontend) Service() string { return fe.m.service }
