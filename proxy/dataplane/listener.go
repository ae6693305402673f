package dataplane

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
)

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

// refuseIf has fe's port refuse connections while no endpoint can serve it
// (refuse), and its listener accept again once one can. Refusing, the
// listener is closed and a socket that refuses holds its port
// (sock.RefusePort): a TCP SYN gets a reset, a UDP datagram an ICMP port
// unreachable, from the first packet and whatever address the rules
// redirected from, at no cost per packet, as kube-proxy's REJECT does.
// Established connections go on. Without a socket on the port the kernel
// would answer the same, but another process could take the port meanwhile.
func (fe *Frontend) refuseIf(refuse bool) error {
	if refuse == (fe.refusing != nil) {
		return nil
	}
	if refuse && fe.dp.letGo != nil && (fe.tcp != nil || fe.udp != nil) && fe.opened.port == 0 {
		fe.dp.letGo([]SocketKey{fe.SocketKey()}) // the keeper's duplicate would keep the port listening
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
		return fe.dp.startServing(fe, ln)
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
func (fe *Frontend) clearPort() {
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
