package proxy

// The reconciler carries a sync's plan out on the frontends here, forward
// and each step once:
//
//	carryOut         close what must go first, retake NodePorts held elsewhere
//	  → servePort    per port of the plan, per key: the frontend (opened by
//	                 the dataplane, for one that is missing), then
//	  → ServeAs      what the plan decided for it (package dataplane)
//	  then removed frontends stop; out comes the ruleWrite (rulewriter.go)
//	written          once the rule writer is done: replaced frontends stop,
//	                 closed ones give their ports back

import (
	"fmt"
	"runtime"
	"slices"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
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
	r.dp.LetGo(p.closeNow) // their successors bind the NodePorts they had
	for _, fe := range p.closeNow {
		fe.Stop()
	}
	r.lines.closed = append(r.lines.closed, p.closeNow...)
	stale := slices.Clone(p.stale)
	retaken := map[dataplane.Key]*dataplane.Frontend{}
	for _, key := range p.retake {
		if nf := r.retakeNodePort(key, p.st.Ports[key.Name]); nf != nil {
			stale = append(stale, r.frontends[key])
			r.mu.Lock()
			delete(r.frontends, key)
			r.mu.Unlock()
			retaken[key] = nf
		}
	}
	kept = len(r.frontends)
	r.zone = p.st.Zone
	view := p.view
	for _, ps := range p.serve {
		view = r.servePort(view, p, ps, retaken)
	}
	for _, fe := range p.gone {
		fe.Stop()
	}
	r.lines.closed = append(r.lines.closed, p.gone...)
	w = &ruleWrite{view: view, verify: p.verify, release: slices.Concat(p.closeNow, p.gone), stale: stale, start: start, state: p.st}
	if p.changed != nil {
		w.changed, w.fresh = p.changed, view[p.unchanged:]
	}
	return w, kept
}

// retakeNodePort opens a new frontend for key that holds sp's NodePort, or
// returns nil (quietly: it is tried again every sync) while the port is
// still taken.
func (r *reconciler) retakeNodePort(key dataplane.Key, sp *config.ServicePort) *dataplane.Frontend {
	nf, err := r.dp.Open(key, sp)
	if err != nil {
		return nil
	}
	if nf.NodePortErr() != nil {
		nf.Discard()
		return nil
	}
	nf.Log().WithField("nodePort", sp.NodePort).Info("NodePort taken back")
	return nf
}

// servePort makes sure a frontend serves ps.sp for each of its keys (opening
// the ones missing, or taking the one retaken), has it take what p decided,
// and appends them to view.
func (r *reconciler) servePort(view []config.Frontend, p *syncPlan, ps portServe, retaken map[dataplane.Key]*dataplane.Frontend) []config.Frontend {
	sp := ps.sp
	for _, ks := range ps.keys {
		key := ks.key
		failed := config.Frontend{Service: sp, Kind: key.Kind, Family: key.Family, Protocol: sp.Protocol}
		fe := r.frontends[key]
		if fe == nil {
			if fe = retaken[key]; fe == nil {
				var err error
				if fe, err = r.openFrontend(key, sp, p.st.Node); err != nil {
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
			if err := fe.ServeAs(sp, ks.Serve); err != nil {
				// Its listener could not be opened again (another
				// process took its port meanwhile): it leaves the live
				// set, the sync goroutine opens a new one later, and its
				// port goes back once the rules no longer point at it.
				fe.Log().WithError(err).Error("Cannot open listener; service port not served, retrying")
				r.mu.Lock()
				delete(r.frontends, key)
				r.mu.Unlock()
				fe.Stop()
				r.lines.closed = append(r.lines.closed, fe)
				r.unreleased = append(r.unreleased, fe)
				failed.Err = err
				view = append(view, failed)
				continue
			}
		}
		fe.SetSpec(sp)
		view = append(view, config.Frontend{Service: sp, Kind: key.Kind, Family: key.Family, Protocol: sp.Protocol, Listen: fe.Listen(),
			NodePortErr: fe.NodePortErr()})
	}
	return view
}

// openFrontend opens key's listener and says what went wrong: the listener (the
// sync goroutine retries) or its NodePort (also an Event on the Service).
func (r *reconciler) openFrontend(key dataplane.Key, sp *config.ServicePort, node string) (*dataplane.Frontend, error) {
	fe, err := r.dp.Open(key, sp)
	if err != nil {
		r.cfg.log().WithField("service", key.Name.String()).WithError(err).Error("Cannot open listener; service port not served, retrying")
		return nil, err
	}
	if fe.NodePortErr() != nil {
		fe.Log().Error(fe.NodePortErr())
		if r.cfg.Events != nil {
			r.cfg.Events(sp, "NodePortConflict", fmt.Sprintf("%s (node %s)", fe.NodePortErr(), node))
		}
	}
	return fe, nil
}

// written finishes w on the sync goroutine once its rules are written (err
// nil) or failed: replaced listeners stop, and after a success the ports of
// every frontend closed before it go back to the allocator.
func (r *reconciler) written(w *ruleWrite) {
	for _, fe := range w.stale {
		fe.Stop()
	}
	r.lines.closed = append(r.lines.closed, w.stale...)
	r.unreleased = append(append(r.unreleased, w.release...), w.stale...)
	if w.err == nil {
		for _, fe := range r.unreleased {
			fe.Release()
		}
		clear(r.unreleased)
		r.unreleased = r.unreleased[:0]
	}
	r.lines.flush(r.cfg.log())
	if w.bulk {
		// A bulk sync (a start, a restore of many Services) and its rule
		// write leave much garbage; collected later, it would land on the
		// next small change, whose sync then shares the CPU with the mark
		// phase. Collect it now.
		start := time.Now()
		runtime.GC()
		r.cfg.log().WithField("took", time.Since(start).String()).Debug("Collected a bulk sync's garbage")
	}
}

// closeAll stops every frontend and gives its port back (at shutdown: the
// rules still point at the closed ports, so a new connection is refused at
// once instead of timing out).
func (r *reconciler) closeAll() {
	r.mu.Lock()
	all := r.frontends
	r.frontends = make(map[dataplane.Key]*dataplane.Frontend)
	r.view, r.sorted = nil, nil
	r.mu.Unlock()
	for _, fe := range all {
		fe.Stop()
		fe.Release()
		r.lines.closed = append(r.lines.closed, fe)
	}
	r.lines.flush(r.cfg.log())
}
