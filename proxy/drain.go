package proxy

// Drains set by hand (the admin socket's /debug/drain): an endpoint takes
// no new picks on any listener of its service port while its connections
// go on.

import (
	"errors"
	"net/netip"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
)

// ErrUnknownEndpoint is Drain's answer for a service port or endpoint that
// no listener serves.
var ErrUnknownEndpoint = errors.New("no listener of this service port has this endpoint")

// Drain stops (drained) or resumes new picks of endpoint ep on every listener
// of the service port name, while the connections to it go on. It returns how
// many are still open. The drain lasts while the endpoint stays in the
// Service; a listener opened anew (its Service's addresses changed) starts
// without it.
func (p *Proxier) Drain(name config.ServicePortName, ep netip.AddrPort, drained bool) (active int, err error) {
	found := false
	p.rec.eachLive(func(fe *dataplane.Frontend) {
		if fe.Key().Name != name || !fe.Balancer().SetDrained(ep, drained) {
			return
		}
		found = true
		for _, h := range fe.Balancer().Health() {
			if h.Endpoint == ep {
				active += h.Active
			}
		}
	})
	if !found {
		return 0, ErrUnknownEndpoint
	}
	p.cfg.log().WithFields(logrus.Fields{"service": name.String(), "endpoint": ep, "drained": drained, "active": active}).Info("Endpoint drain set by hand")
	return active, nil
}
