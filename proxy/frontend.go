package proxy

import (
	"fmt"
	"net/netip"
	"sync/atomic"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
)

type frontendKey struct {
	Name   config.ServicePortName
	Kind   config.Kind
	Family int
}

// keyOf is the key of the listener behind f.
func keyOf(f config.Frontend) frontendKey { return frontendKey{f.Service.Name, f.Kind, f.Family} }

// String names a listener: service port, kind and family.
func (k frontendKey) String() string { return fmt.Sprintf("%s/%s/%d", k.Name, k.Kind, k.Family) }

// frontend is a live listener with its balancer, serving one key: a TCP
// server or a UDP server, never both. It is created by the dataplane and
// closed by the reconciler; its connections and flows belong to its server.
type frontend struct {
	dp          *dataplane
	key         frontendKey
	protocol    config.Protocol     // fixed: another protocol is another frontend
	spec        *config.ServicePort // the sync goroutine's: connections never read it
	bal         *EndpointBalancer
	listen      netip.AddrPort
	nodePortErr error      // the NodePort could not be taken
	onNodePort  bool       // the listener sits on the NodePort itself
	hold        *sock.Hold // holds the NodePort when the listener is elsewhere, or nil
	release     func()

	// proxyProto is the PROXY protocol version of the spec (a string),
	// read by connection goroutines while the sync goroutine may change it.
	proxyProto atomic.Value
	// sourcePolicy decides whose address the backends see (source.go);
	// replaced by the sync goroutine, read by connection goroutines.
	sourcePolicy atomic.Pointer[sourcePolicy]

	m   *feMetrics
	tcp *tcpServer // one of tcp and udp is set
	udp *udpServer
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

// bindFor returns the address listeners of a family bind to, given
// --bind-address b.
func bindFor(b netip.Addr, family int) netip.Addr {
	if b.IsValid() && !b.IsUnspecified() && config.Family(b) == family {
		return b
	}
	if family == 6 {
		return netip.IPv6Unspecified()
	}
	return netip.IPv4Unspecified()
}

// log is the frontend's logger, made when something is said: a fields
// map kept per frontend cost 6 MB at 10 000 Services.
func (fe *frontend) log() logrus.FieldLogger {
	return fe.dp.cfg.log().WithFields(logrus.Fields{
		"service": fe.key.Name.String(), "protocol": fe.protocol, "family": fe.key.Family, "kind": fe.key.Kind, "listen": fe.listen.Port(),
	})
}

// debug writes one of the frontend's debug lines, without making its logger
// when debug lines are off: some come per connection or per datagram.
func (fe *frontend) debug(fields logrus.Fields, err error, msg string) {
	if !debugEnabled(fe.dp.cfg.log()) {
		return
	}
	l := fe.log().WithFields(fields)
	if err != nil {
		l = l.WithError(err)
	}
	l.Debug(msg)
}

// stop stops accepting; established TCP connections go on (they belong to
// the connection table), UDP flows end with the socket. The port stays
// taken in the allocator until release.
func (fe *frontend) stop() {
	fe.dp.budget.listeners.Add(-1)
	if fe.hold != nil {
		fe.dp.budget.listeners.Add(-1)
	}
	fe.closeListener()
	fe.refusing.Close()
	fe.refusing = nil
	fe.hold.Close()
}

// closeListener closes the listener, unless the frontend refuses (it is
// closed then).
func (fe *frontend) closeListener() {
	switch {
	case fe.refusing != nil:
	case fe.tcp != nil:
		fe.tcp.ln.Close()
	case fe.udp != nil:
		fe.udp.close()
	}
}

// refuse closes the listener and holds its port with a socket that refuses
// (sock.RefusePort): a TCP SYN gets a reset, a UDP datagram an ICMP port
// unreachable, from the first packet and whatever address the rules
// redirected from, at no cost per packet. Established connections go on.
// Without a socket on the port the kernel would answer the same, but
// another process could take the port meanwhile.
func (fe *frontend) refuse() error {
	if fe.refusing != nil {
		return nil
	}
	fe.closeListener()
	h, err := sock.RefusePort(fe.protocol == config.UDP, fe.listen)
	if err != nil {
		return fmt.Errorf("holding %s while no endpoint serves: %w", fe.listen, err)
	}
	fe.refusing = h
	fe.refused.Store(true)
	return nil
}

// serveAgain opens the listener again on its port, once an endpoint can
// serve.
func (fe *frontend) serveAgain() error {
	if fe.refusing == nil {
		return nil
	}
	fe.refusing.Close()
	fe.refusing = nil
	fe.refused.Store(false)
	ln, err := listenOn(fe.protocol, fe.listen)
	if err != nil {
		return err
	}
	return fe.dp.serve(fe, ln)
}

// discard closes a frontend that never served (a NodePort retake that
// failed), quietly, and gives its port back.
func (fe *frontend) discard() {
	fe.stop()
	fe.release()
}
