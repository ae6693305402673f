package proxy

import (
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// carryOut does p to the frontends, in the order that refuses or drops
// nothing it need not: the frontends closing leave the live set, those that
// hold a NodePort their successors need stop, NodePorts held elsewhere are
// tried again, every port of p.serve is served (new listeners opened,
// balancers given their endpoints), and only then do removed frontends stop,
// so that no port freed here goes to a new frontend. It returns the rule
// write that makes the rules match, and how many frontends were kept.
func (r *reconciler) carryOut(p *syncPlan, start time.Time) (w *ruleWrite, kept int) {
	r.mu.Lock()
	for key := range p.closing {
		delete(r.frontends, key)
	}
	r.mu.Unlock()
	for _, fe := range p.closeNow {
		r.stop(fe)
	}
	stale := slices.Clone(p.stale)
	retaken := map[frontendKey]*frontend{}
	for _, key := range p.retake {
		if nf := r.retakeNodePort(key, p.st.Ports[key.Name]); nf != nil {
			stale = append(stale, r.frontends[key])
			r.forget(key)
			retaken[key] = nf
		}
	}
	kept = len(r.frontends)
	r.zone = p.st.Zone
	view := p.view
	for _, sp := range p.serve {
		view = r.serve(view, p, sp, retaken)
	}
	r.countFailures(view)
	for _, fe := range p.gone {
		r.stop(fe)
	}
	w = &ruleWrite{view: view, verify: p.verify, release: slices.Concat(p.closeNow, p.gone), stale: stale, start: start, state: p.st}
	if p.changed != nil {
		w.changed, w.fresh = p.changed, view[p.unchanged:]
	}
	return w, kept
}

// forget takes key's frontend out of the live set.
func (r *reconciler) forget(key frontendKey) {
	r.mu.Lock()
	delete(r.frontends, key)
	r.mu.Unlock()
}

// stop stops fe accepting, for the log of closed listeners.
func (r *reconciler) stop(fe *frontend) {
	fe.stop()
	r.lines.closed = append(r.lines.closed, fe)
}

// retakeNodePort opens a new frontend for key that holds sp's NodePort, or
// returns nil (quietly: it is tried again every sync) while the port is
// still taken.
func (r *reconciler) retakeNodePort(key frontendKey, sp *config.ServicePort) *frontend {
	nf, err := r.dp.open(key, sp)
	if err != nil {
		return nil
	}
	if nf.nodePortErr != nil {
		nf.discard()
		return nil
	}
	nf.log().WithField("nodePort", sp.NodePort).Info("NodePort taken back")
	return nf
}

// serve makes sure a frontend serves sp for each of its keys (opening the
// ones missing, or taking the one retaken) and appends them to view.
func (r *reconciler) serve(view []config.Frontend, p *syncPlan, sp *config.ServicePort, retaken map[frontendKey]*frontend) []config.Frontend {
	for _, key := range p.keys(sp, r.cfg.serves) {
		failed := config.Frontend{Service: sp, Kind: key.Kind, Family: key.Family, Protocol: sp.Protocol}
		fe := r.frontends[key]
		opened := fe == nil
		if opened {
			if fe = retaken[key]; fe == nil {
				var err error
				if fe, err = r.open(key, sp, p.st.Node); err != nil {
					failed.Err = err
					view = append(view, failed)
					continue
				}
			}
			r.lines.opened = append(r.lines.opened, fe)
			r.mu.Lock()
			r.frontends[key] = fe
			r.mu.Unlock()
		}
		if opened || p.rezone || config.ComparePorts(fe.spec, sp) != config.PortSame {
			prev := fe.spec
			if opened {
				prev = nil
			}
			if err := r.update(fe, prev, sp, p.st); err != nil {
				failed.Err = err
				view = append(view, failed)
				continue
			}
		}
		fe.spec = sp
		view = append(view, config.Frontend{Service: sp, Kind: key.Kind, Family: key.Family, Protocol: sp.Protocol, Listen: fe.listen,
			NodePortErr: fe.nodePortErr})
	}
	return view
}

// open opens key's listener and says what went wrong: the listener (the
// sync goroutine retries) or its NodePort (also an Event on the Service).
func (r *reconciler) open(key frontendKey, sp *config.ServicePort, node string) (*frontend, error) {
	fe, err := r.dp.open(key, sp)
	if err != nil {
		r.cfg.log().WithField("service", key.Name.String()).WithError(err).Error("Cannot open listener; service port not served, retrying")
		return nil, err
	}
	if fe.nodePortErr != nil {
		fe.log().Error(fe.nodePortErr)
		if r.cfg.Events != nil {
			r.cfg.Events(sp, "NodePortConflict", fmt.Sprintf("%s (node %s)", fe.nodePortErr, node))
		}
	}
	return fe, nil
}

// update has fe serve sp (prev: what it served, nil when just opened): its
// settings, its balancer's endpoints, its UDP flows off endpoints that left,
// and refusing while no endpoint can serve.
func (r *reconciler) update(fe *frontend, prev, sp *config.ServicePort, st *config.State) error {
	key := fe.key
	warnAnnotations(fe.log(), prev, sp)
	fe.proxyProto.Store(sp.ProxyProtocol)
	fe.sourcePolicy.Store(newSourcePolicy(r.cfg, key, sp))
	eps := config.UsableEndpoints(sp.Endpoints, key.Family, key.localOnly(sp), st.Node, st.Zone)
	fe.bal.Update(eps, sp.AffinityTimeout, r.cfg.outlierFor(sp), sp.Scheduler)
	fe.noLocal.Store(noLocalPolicies(key, sp, len(eps), st.Node, st.Zone))
	if fe.udp != nil && prev != nil {
		fe.udp.endFlowsOff(servingEndpoints(sp))
	}
	return r.refuseUnless(fe, len(eps) > 0)
}

// refuseUnless has fe refuse connections while no endpoint can serve it,
// and serve again once one can. A listener that cannot be opened again
// (another process took its port meanwhile) leaves the live set: the sync
// goroutine opens a new one later, and its port goes back once the rules no
// longer point at it.
func (r *reconciler) refuseUnless(fe *frontend, serving bool) error {
	var err error
	if serving {
		err = fe.serveAgain()
	} else {
		err = fe.refuse()
	}
	if err == nil {
		return nil
	}
	fe.log().WithError(err).Error("Cannot open listener; service port not served, retrying")
	r.forget(fe.key)
	r.stop(fe)
	r.unreleased = append(r.unreleased, fe)
	return err
}

// servingEndpoints are the addresses of sp's endpoints that serve, ready or
// terminating.
func servingEndpoints(sp *config.ServicePort) map[netip.AddrPort]bool {
	set := make(map[netip.AddrPort]bool, len(sp.Endpoints))
	for _, ep := range sp.Endpoints {
		if ep.Ready || ep.Serving {
			set[ep.Addr] = true
		}
	}
	return set
}

const (
	noLocalInternal = 1 << iota
	noLocalExternal
)

// noLocalPolicies are the Local policies of sp that key's frontend serves
// without a local endpoint (usable: its endpoints) while the cluster has
// some, as kube-proxy counts them.
func noLocalPolicies(key frontendKey, sp *config.ServicePort, usable int, node, zone string) uint32 {
	if !key.localOnly(sp) || usable > 0 || len(config.UsableEndpoints(sp.Endpoints, key.Family, false, node, zone)) == 0 {
		return 0
	}
	var m uint32
	if key.Kind.ClusterIPs() && sp.InternalLocal {
		m |= noLocalInternal
	}
	if key.Kind.External() && sp.ExternalLocal && sp.HasExternal() {
		m |= noLocalExternal
	}
	return m
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
	if v := sp.BackendSource; v != prev.BackendSource && v != "" && v != string(BackendSourceAuto) && v != string(BackendSourceNode) {
		log.WithField("annotation", config.AnnotationBackendSource).WithField("value", v).
			Warn("Unknown value (want \"auto\" or \"node\"); using auto")
	}
	if v := sp.OutlierDetection; v != prev.OutlierDetection && v != "" && v != "on" && v != "off" {
		log.WithField("annotation", config.AnnotationOutlierDetection).WithField("value", v).
			Warn("Unknown value (want \"on\" or \"off\"); outlier detection stays on")
	}
}

// countFailures counts the frontends of view that could not open their
// listener or NodePort: the sync goroutine tries them again.
func (r *reconciler) countFailures(view []config.Frontend) {
	r.failing, r.listenFailures, r.failingNames = 0, 0, r.failingNames[:0]
	for _, fe := range view {
		if fe.Err != nil {
			r.listenFailures++
		}
		if fe.Err != nil || fe.NodePortErr != nil {
			r.failing++
			r.failingNames = append(r.failingNames, fe.Service.Name)
		}
	}
	listenerFailures.Set(float64(r.listenFailures))
	nodePortConflicts.Set(float64(r.failing - r.listenFailures))
}
