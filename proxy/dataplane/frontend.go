package proxy

// A frontend is one live listener; the reconciler carries a sync's plan out
// on the frontends here, forward and each step once:
//
//	carryOut         close what must go first, retake NodePorts held elsewhere
//	  → serve        per port of the plan, per key: the frontend (open:
//	                 dataplane.go, for one that is missing), then
//	  → serveAs      what the plan decided for it: settings, the balancer's
//	                 endpoints and a predecessor's picks (package balance), UDP
//	                 flows off endpoints that left (udpflows.go), its port
//	                 refusing while no endpoint serves (listener.go)
//	  then removed frontends stop; out comes the ruleWrite (rulewriter.go)
//	written          once the rule writer is done: replaced frontends stop,
//	                 closed ones give their ports back

import (
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/clientaddr"
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
	bal         *balance.Balancer
	listen      netip.AddrPort
	nodePortErr error      // the NodePort could not be taken
	onNodePort  bool       // the listener sits on the NodePort itself
	hold        *sock.Hold // holds the NodePort when the listener is elsewhere, or nil
	release     func()

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
	if r.dp.letGo != nil && len(p.closeNow) > 0 {
		keys := make([]keptKey, len(p.closeNow))
		for i, fe := range p.closeNow {
			keys[i] = fe.keptKey()
		}
		r.dp.letGo(keys) // their successors bind the NodePorts they had
	}
	for _, fe := range p.closeNow {
		fe.stop()
	}
	r.lines.closed = append(r.lines.closed, p.closeNow...)
	stale := slices.Clone(p.stale)
	retaken := map[frontendKey]*frontend{}
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
		view = r.serve(view, p, ps, retaken)
	}
	for _, fe := range p.gone {
		fe.stop()
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
			if err := fe.serveAs(sp, ks); err != nil {
				// Its listener could not be opened again (another
				// process took its port meanwhile): it leaves the live
				// set, the sync goroutine opens a new one later, and its
				// port goes back once the rules no longer point at it.
				fe.log().WithError(err).Error("Cannot open listener; service port not served, retrying")
				r.mu.Lock()
				delete(r.frontends, key)
				r.mu.Unlock()
				fe.stop()
				r.lines.closed = append(r.lines.closed, fe)
				r.unreleased = append(r.unreleased, fe)
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

// serveAs has fe serve sp as the plan decided (ks): its settings, its
// balancer's endpoints (and a predecessor's picks, once they are set), its
// UDP flows off endpoints that left, the listener it was opened with
// served, and its port refusing while no endpoint can serve (listener.go),
// in that order: the balancer holds the endpoints before a listener that
// was opened, or refused, accepts.
func (fe *frontend) serveAs(sp *config.ServicePort, ks keyServe) error {
	fe.proxyProto.Store(sp.ProxyProtocol)
	fe.sourcePolicy.Store(ks.source)
	fe.noLocal.Store(ks.noLocal)
	fe.bal.Update(ks.eps, sp.AffinityTimeout, ks.outlier, sp.Scheduler)
	if ks.picks != nil {
		fe.bal.ImportPicks(*ks.picks)
	}
	if fe.udp != nil && ks.serving != nil {
		fe.udp.endFlowsOff(ks.serving)
	}
	if ln := fe.opened; ln.port != 0 && len(ks.eps) > 0 { // without endpoints refuseIf closes it
		fe.opened = listener{}
		if err := fe.dp.serve(fe, ln); err != nil {
			return err
		}
	}
	return fe.refuseIf(len(ks.eps) == 0)
}

// stop stops accepting; established TCP connections go on (they belong to
// the connection table), UDP flows end with the socket. The port stays
// taken in the allocator until release.
func (fe *frontend) stop() {
	fe.dp.budget.listeners.Add(-1)
	if fe.hold != nil {
		fe.dp.budget.listeners.Add(-1)
	}
	fe.clearPort()
	fe.hold.Close()
}

// discard closes a frontend that never served (a NodePort retake that
// failed), quietly, and gives its port back.
func (fe *frontend) discard() {
	fe.stop()
	fe.release()
}

// written finishes w on the sync goroutine once its rules are written (err
// nil) or failed: replaced listeners stop, and after a success the ports of
// every frontend closed before it go back to the allocator.
func (r *reconciler) written(w *ruleWrite) {
	for _, fe := range w.stale {
		fe.stop()
	}
	r.lines.closed = append(r.lines.closed, w.stale...)
	r.unreleased = append(append(r.unreleased, w.release...), w.stale...)
	if w.err == nil {
		for _, fe := range r.unreleased {
			fe.release()
		}
		clear(r.unreleased)
		r.unreleased = r.unreleased[:0]
	}
	r.lines.flush(r.cfg.log())
	if w.bulk {
		// A bulk sync (a start, a restore of many Services) and its rule
		// write leave tens of MB of garbage; collected later, it would land
		// on the next small change, whose sync then shares the CPU with the
		// mark phase (at 10k: +15-25 ms, in ~40 % of the changes measured
		// right after a load; at 1k, +5 ms in every one). Collect it now.
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
	r.frontends = make(map[frontendKey]*frontend)
	r.view, r.sorted = nil, nil
	r.mu.Unlock()
	for _, fe := range all {
		fe.stop()
		fe.release()
		r.lines.closed = append(r.lines.closed, fe)
	}
	r.lines.flush(r.cfg.log())
}

// source is the Source of a dial to ep for a connection from client to
// dst (invalid: not known, a UDP flow's), and whether the client's address
// is wanted (a Source that cannot give it is a fallback).
func (f *frontend) source(client, dst, ep netip.AddrPort) (sock.Source, bool) {
	return f.dp.source.Source(f.sourcePolicy.Load(), client, dst, ep)
}
