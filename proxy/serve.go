package proxy

import (
	"fmt"
	"slices"
	"time"

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
	for _, ps := range p.serve {
		view = r.serve(view, p, ps, retaken)
	}
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

// serve makes sure a frontend serves ps.sp for each of its keys (opening
// the ones missing, or taking the one retaken), has it take what p decided,
// and appends them to view.
func (r *reconciler) serve(view []config.Frontend, p *syncPlan, ps portServe, retaken map[frontendKey]*frontend) []config.Frontend {
	sp := ps.sp
	for _, ks := range ps.keys {
		key := ks.key
		failed := config.Frontend{Service: sp, Kind: key.Kind, Family: key.Family, Protocol: sp.Protocol}
		fe := r.frontends[key]
		if fe == nil {
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
		if ks.update { // always for a frontend just opened or retaken
			if err := r.update(fe, sp, ks); err != nil {
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

// update has fe serve sp as ks says: its settings, its balancer's
// endpoints, its UDP flows off endpoints that left, and refusing while no
// endpoint can serve.
func (r *reconciler) update(fe *frontend, sp *config.ServicePort, ks keyServe) error {
	fe.proxyProto.Store(sp.ProxyProtocol)
	fe.sourcePolicy.Store(ks.source)
	fe.bal.Update(ks.eps, sp.AffinityTimeout, ks.outlier, sp.Scheduler)
	if st, ok := r.inheritedPicks[fe.key.String()]; ok {
		// A predecessor's pick state (pickstate.go), once the endpoints are set.
		delete(r.inheritedPicks, fe.key.String())
		fe.bal.importState(st)
	}
	fe.noLocal.Store(ks.noLocal)
	if fe.udp != nil && ks.serving != nil {
		fe.udp.endFlowsOff(ks.serving)
	}
	return r.refuseUnless(fe, len(ks.eps) > 0)
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
