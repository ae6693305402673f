package proxy

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
)

// Kind says which addresses a frontend answers on.
type Kind string

const (
	// KindAll: ClusterIPs and the external addresses share one listener
	// (internal and external traffic policies select the same endpoints).
	KindAll Kind = "all"
	// KindInternal: ClusterIPs only.
	KindInternal Kind = "internal"
	// KindExternal: NodePort, externalIPs and LoadBalancer IPs only.
	KindExternal Kind = "external"
)

// Kinds lists every Kind.
var Kinds = [...]Kind{KindAll, KindInternal, KindExternal}

type frontendKey struct {
	Name   config.ServicePortName
	Kind   Kind
	Family int
}

// Frontend is one listener and what it answers on, as plain data: Rules
// receive these. The live listener behind it is the Proxier's.
type Frontend struct {
	Service  *config.ServicePort
	Kind     Kind
	Family   int
	Protocol config.Protocol
	Listen   netip.AddrPort // where the listener is bound (port is the proxy port)
	// Err is set when the listener could not be opened; Rules skip it.
	Err error
	// NodePortErr is set when the NodePort could not be held (another
	// process has it); Rules skip the NodePort but serve the rest.
	NodePortErr error
}

// OnNodePort reports whether the listener sits on the Service's NodePort:
// traffic to the NodePort then reaches it without any rule, and it is meant
// to be reachable from anywhere.
func (f Frontend) OnNodePort() bool {
	return f.Service.NodePort != 0 && int(f.Listen.Port()) == f.Service.NodePort
}

func (f Frontend) key() frontendKey { return frontendKey{f.Service.Name, f.Kind, f.Family} }

// String names a listener: service port, kind and family.
func (k frontendKey) String() string { return fmt.Sprintf("%s/%s/%d", k.Name, k.Kind, k.Family) }

// frontend is a live listener with its balancer. It is created and closed by
// the sync goroutine; its serve goroutine and connections belong to it.
type frontend struct {
	p           *Proxier
	key         frontendKey
	spec        *config.ServicePort
	bal         Balancer
	listen      netip.AddrPort
	nodePortErr error      // the NodePort could not be taken
	hold        *sock.Hold // holds the NodePort when the listener is elsewhere, or nil
	release     func()

	// proxyProto is the PROXY protocol version of the spec (a string),
	// read by connection goroutines while the sync goroutine may change it.
	proxyProto atomic.Value

	m      *feMetrics
	ctx    context.Context // cancelled when the proxier shuts down
	tcp    *sock.Listener
	udpSk  *udpSocket
	udp    udpFlows
	served sync.WaitGroup
}

// localOnly says whether the frontend's traffic policy is Local.
func (k frontendKey) localOnly(sp *config.ServicePort) bool {
	switch k.Kind {
	case KindInternal:
		return sp.InternalLocal
	case KindExternal:
		return sp.ExternalLocal
	}
	return sp.InternalLocal // KindAll: both policies agree
}

// frontendKeys appends the keys of the listeners sp needs to keys, without
// allocating when keys has room: one per family, or two when internal and
// external traffic policies differ (they select different endpoints, and a
// UDP datagram cannot tell which address it was sent to once redirected).
// It is the one enumeration of a Service port's frontends.
func frontendKeys(keys []frontendKey, name config.ServicePortName, sp *config.ServicePort) []frontendKey {
	split := sp.HasExternal() && sp.InternalLocal != sp.ExternalLocal
	for _, fam := range sp.Families() {
		if split {
			keys = append(keys, frontendKey{Name: name, Kind: KindInternal, Family: fam}, frontendKey{Name: name, Kind: KindExternal, Family: fam})
		} else {
			keys = append(keys, frontendKey{Name: name, Kind: KindAll, Family: fam})
		}
	}
	return keys
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

// open starts a listener for key. The port goes back to the allocator on
// every failure path.
func (p *Proxier) open(key frontendKey, sp *config.ServicePort) (*frontend, error) {
	proto := "tcp"
	if sp.Protocol == config.UDP {
		proto = "udp"
	}
	bind := bindFor(p.cfg.BindAddress, key.Family)
	var ln any // *sock.Listener or *net.UDPConn
	var port int
	var nodePortErr error
	release := func() {}
	var hold *sock.Hold
	if sp.NodePort != 0 && key.Kind != KindInternal {
		var err error
		if p.cfg.NodePortsRestricted {
			hold, err = sock.HoldPort(sp.Protocol == config.UDP, netip.AddrPortFrom(bind, uint16(sp.NodePort)))
		} else {
			// The listener itself sits on the NodePort: it holds the port
			// against other processes, costs no extra descriptor, and
			// serves even a connection that reaches it without a redirect.
			ln, port, err = listenOn(proto, netip.AddrPortFrom(bind, uint16(sp.NodePort)))
		}
		if err != nil {
			// Logged by the caller: a retry that fails again stays quiet.
			nodePortErr = fmt.Errorf("NodePort %d/%s is already in use by another process on this node (%w); serving the other addresses only, retrying", sp.NodePort, sp.Protocol, err)
		}
	}
	if ln == nil {
		var err error
		if ln, port, release, err = p.alloc.listen(proto, bind, key.String()); err != nil {
			if sock.IsFileLimit(err) {
				p.budget.ranOut()
			}
			hold.Close()
			return nil, err
		}
	}
	p.budget.listeners.Add(1)
	if hold != nil {
		p.budget.listeners.Add(1)
	}
	fe := &frontend{
		p: p, key: key, spec: sp, bal: newBalancer(sp), m: newFEMetrics(key.Name.String(), sp.Protocol),
		listen:      netip.AddrPortFrom(bind, uint16(port)),
		nodePortErr: nodePortErr,
		hold:        hold,
		release:     release,
		ctx:         p.ctx,
	}
	switch s := ln.(type) {
	case *sock.Listener:
		fe.tcp = s
		if err := fe.serveTCP(s); err != nil {
			fe.discard()
			return nil, fmt.Errorf("serving %s: %w", fe.listen, err)
		}
	case *net.UDPConn:
		us := &udpSocket{conn: s, family: key.Family}
		fe.udpSk = us
		fe.udp.budget = p.budget
		p.budget.addUDP(fe)
		fe.served.Add(1)
		go func() { defer fe.served.Done(); fe.serveUDP(us) }()
	}
	fe.proxyProto.Store(sp.ProxyProtocol)
	return fe, nil
}

// log is the frontend's logger, made when something is said: a fields
// map kept per frontend cost 6 MB at 10 000 Services.
func (fe *frontend) log() logrus.FieldLogger {
	return fe.p.cfg.log().WithFields(logrus.Fields{
		"service": fe.key.Name.String(), "protocol": fe.spec.Protocol, "family": fe.key.Family, "kind": fe.key.Kind, "listen": fe.listen.Port(),
	})
}

// debug writes one of the frontend's debug lines, without making its logger
// when debug lines are off: some come per connection or per datagram.
func (fe *frontend) debug(fields logrus.Fields, err error, msg string) {
	if !debugEnabled(fe.p.cfg.log()) {
		return
	}
	l := fe.log().WithFields(fields)
	if err != nil {
		l = l.WithError(err)
	}
	l.Debug(msg)
}

// holdsNodePort reports whether the frontend holds the service's NodePort,
// as its listener or as a socket that only keeps others off it.
func (fe *frontend) holdsNodePort() bool {
	return fe.hold != nil || (fe.spec.NodePort != 0 && int(fe.listen.Port()) == fe.spec.NodePort)
}

// close stops the frontend and gives its port back: for a frontend no
// rule points at.
func (fe *frontend) close() {
	fe.stop()
	fe.release()
}

// stop stops accepting; established TCP connections go on (they belong to
// the connection table), UDP flows end with the socket. The port stays
// taken in the allocator until release.
func (fe *frontend) stop() {
	fe.shut()
	fe.p.lines.closed = append(fe.p.lines.closed, fe)
}

// discard closes a frontend that never served (a NodePort retake that
// failed), quietly, and gives its port back.
func (fe *frontend) discard() {
	fe.shut()
	fe.release()
}

func (fe *frontend) shut() {
	fe.p.budget.listeners.Add(-1)
	if fe.hold != nil {
		fe.p.budget.listeners.Add(-1)
	}
	if fe.tcp != nil {
		fe.tcp.Close()
	}
	if fe.udpSk != nil {
		fe.udpSk.conn.Close()
	}
	fe.served.Wait()
	if fe.udpSk != nil {
		fe.p.budget.removeUDP(fe)
		fe.closeFlows()
	}
	fe.hold.Close()
}

// warnAnnotations warns once about each of sp's annotations that has a value
// the proxy does not know, when the value is new (prev is nil for a listener
// just opened): a sync that changes nothing else says nothing again.
func warnAnnotations(log logrus.FieldLogger, prev, sp *config.ServicePort) {
	if prev == nil {
		prev = &config.ServicePort{}
	}
	if sp.ProxyProtocol != prev.ProxyProtocol && !KnownProxyProtocol(sp.ProxyProtocol) {
		log.WithField("annotation", config.AnnotationProxyProtocol).WithField("value", sp.ProxyProtocol).
			Warn("Unknown PROXY protocol version (want v1 or v2); no header is sent")
	}
	if sp.Scheduler != prev.Scheduler && !KnownScheduler(sp.Scheduler) {
		log.WithField("annotation", config.AnnotationScheduler).WithField("value", sp.Scheduler).
			Warn("Unknown scheduler (want rr, lc, sh or random); using rr")
	}
	if v := sp.OutlierDetection; v != prev.OutlierDetection && v != "" && v != "on" && v != "off" {
		log.WithField("annotation", config.AnnotationOutlierDetection).WithField("value", v).
			Warn("Unknown value (want \"on\" or \"off\"); outlier detection stays on")
	}
}
