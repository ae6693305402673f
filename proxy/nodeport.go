package proxy

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// nodePortKey names a NodePort socket: one per protocol, family and port.
type nodePortKey struct {
	Protocol config.Protocol
	Family   int
	Port     int
}

// nodePortHold is a socket bound to a NodePort on every address, so that no
// other process can take the port while the Service uses it. It is bound but
// never listening: traffic reaches the proxy through the redirect, and a
// connection that slips past the rules is refused rather than left hanging.
type nodePortHold struct {
	fd  int
	err error // why the port could not be held; the NodePort is then not served
}

func holdNodePort(k nodePortKey) *nodePortHold {
	domain, addr := unix.AF_INET, unix.Sockaddr(&unix.SockaddrInet4{Port: k.Port})
	if k.Family == 6 {
		domain, addr = unix.AF_INET6, &unix.SockaddrInet6{Port: k.Port}
	}
	typ := unix.SOCK_STREAM
	if k.Protocol == config.UDP {
		typ = unix.SOCK_DGRAM
	}
	fd, err := unix.Socket(domain, typ|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return &nodePortHold{fd: -1, err: fmt.Errorf("NodePort %d/%s: socket: %w", k.Port, k.Protocol, err)}
	}
	if k.Family == 6 {
		_ = unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 1)
	}
	if err := unix.Bind(fd, addr); err != nil {
		unix.Close(fd)
		return &nodePortHold{fd: -1, err: fmt.Errorf("NodePort %d/%s is already in use by another process on this node: %w", k.Port, k.Protocol, err)}
	}
	return &nodePortHold{fd: fd}
}

func (h *nodePortHold) close() {
	if h.fd >= 0 {
		unix.Close(h.fd)
		h.fd = -1
	}
}

// syncNodePorts holds every NodePort the frontends need and releases the rest.
// Owned by the sync goroutine.
func (p *Proxier) syncNodePorts(desired map[frontendKey]*config.ServicePort) {
	want := map[nodePortKey]bool{}
	for key, sp := range desired {
		if sp.NodePort != 0 && key.Kind != KindInternal {
			want[nodePortKey{sp.Protocol, key.Family, sp.NodePort}] = true
		}
	}
	for k, h := range p.nodePorts {
		if !want[k] || h.err != nil { // failed holds are retried every sync
			h.close()
			delete(p.nodePorts, k)
		}
	}
	for k := range want {
		if _, ok := p.nodePorts[k]; !ok {
			h := holdNodePort(k)
			if h.err != nil {
				p.cfg.log().WithError(h.err).Error("NodePort not served")
			}
			p.nodePorts[k] = h
		}
	}
}

func (p *Proxier) nodePortErr(key frontendKey, sp *config.ServicePort) error {
	if sp.NodePort == 0 || key.Kind == KindInternal {
		return nil
	}
	if h := p.nodePorts[nodePortKey{sp.Protocol, key.Family, sp.NodePort}]; h != nil {
		return h.err
	}
	return nil
}
