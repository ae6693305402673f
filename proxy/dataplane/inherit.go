package dataplane

// The sockets a predecessor lent (a handover's, or a keeper's after a
// crash), and the names they go by: the dataplane's until a frontend
// takes one (Open), closed after the first rule write if none does.

import (
	"net/netip"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
)

// Socket roles: a frontend's listener on a port of the range, or on its
// NodePort.
const (
	roleRange    = "range"
	roleNodePort = "nodeport"
)

// SocketKey names a frontend's listening socket, in a handover and to a
// keeper, without building its name string.
type SocketKey struct {
	Key  Key
	role string
}

// Name is the socket's name: "frontend <key> <role>".
func (k SocketKey) Name() string { return "frontend " + k.Key.String() + " " + k.role }

// RangeSocket is the key of the listener of key on a port of the range.
func RangeSocket(key Key) SocketKey { return SocketKey{key, roleRange} }

// SocketKey names fe's listening socket.
func (fe *Frontend) SocketKey() SocketKey {
	if fe.onNodePort {
		return SocketKey{fe.key, roleNodePort}
	}
	return SocketKey{fe.key, roleRange}
}

// ListeningSocket is fe's listening socket as a handover or a keeper sends
// it: named, its Open duplicating it at the moment it is sent (the socket
// itself captured here, so that a later sync cannot swap it), and id, the
// socket object, which changes when fe's port is bound anew. false while
// its port refuses or it has no socket.
func (fe *Frontend) ListeningSocket() (s handover.Socket, id any, ok bool) {
	s = handover.Socket{Name: fe.SocketKey().Name(), Proto: strings.ToLower(string(fe.protocol)), Addr: fe.listen.String()}
	switch {
	case fe.refusing != nil:
		return s, nil, false
	case fe.tcp != nil:
		s.Open = fe.tcp.ln.File
		return s, fe.tcp.ln, true
	case fe.udp != nil:
		conn := fe.udp.sk.conn
		s.Open = func() (*os.File, error) { return sock.UDPFile(conn) }
		return s, conn, true
	}
	return s, nil, false
}

// inherited are the sockets a predecessor lent, by name, until a
// frontend takes one.
type inherited struct {
	mu    sync.Mutex
	socks map[string]handover.Socket
}

// take returns the inherited socket named for key and role if it is of
// proto and bound to ip, as a listener; false when there is none.
func (in *inherited) take(key Key, role string, proto config.Protocol, ip netip.Addr) (listener, bool) {
	in.mu.Lock()
	s, ok := in.socks[SocketKey{key, role}.Name()]
	if ok {
		delete(in.socks, SocketKey{key, role}.Name())
	}
	in.mu.Unlock()
	if !ok {
		return listener{}, false
	}
	defer s.File.Close()
	ap, err := netip.ParseAddrPort(s.Addr)
	if err != nil || s.Proto != strings.ToLower(string(proto)) || ap.Addr() != ip {
		return listener{}, false // another bind address or protocol now: a new socket
	}
	switch proto {
	case config.TCP:
		ln, err := sock.FileListener(s.File)
		if err != nil {
			return listener{}, false
		}
		return listener{tcp: ln, port: int(ap.Port())}, true
	case config.UDP:
		c, err := sock.FileUDP(s.File)
		if err != nil {
			return listener{}, false
		}
		return listener{udp: c, port: int(ap.Port())}, true
	}
	return listener{}, false
}

// closeRest closes the sockets no frontend took: Services gone meanwhile.
func (in *inherited) closeRest() int {
	in.mu.Lock()
	defer in.mu.Unlock()
	n := len(in.socks)
	for _, s := range in.socks {
		s.File.Close()
	}
	clear(in.socks)
	return n
}

// Inherit gives the dataplane the frontends' sockets a predecessor lent
// (before Start); sockets whose names are not a frontend's are left out
// (the caller's). The UDP read loops wait until OpenUDPGate, or
// udpGateLimit at most, for the predecessor's flows.
func (d *Dataplane) Inherit(socks []handover.Socket) {
	in := &inherited{socks: make(map[string]handover.Socket)}
	for _, s := range socks {
		if strings.HasPrefix(s.Name, "frontend ") {
			in.socks[s.Name] = s
		}
	}
	d.inherited = in
	d.udpGate = make(chan struct{})
	time.AfterFunc(udpGateLimit, d.OpenUDPGate)
}

// udpGateLimit bounds how long a successor's UDP frontends wait for the
// predecessor's flows.
const udpGateLimit = 10 * time.Second

// CloseInherited closes the inherited sockets no frontend took (Services
// gone meanwhile) and says how many.
func (d *Dataplane) CloseInherited() int {
	if d.inherited == nil {
		return 0
	}
	return d.inherited.closeRest()
}
