package dataplane

// Live TCP connections transferred to a successor (after Release): each pair's
// two copies are detached (sock.Conn.Detach) and stop at their next pause,
// when everything they read has been written on; the pair's two sockets
// then go to the successor with what its record says, and the successor
// starts the copies again. Nothing is in flight at that moment, so not a
// byte is lost or doubled. A half-closed pair (one direction ended by a
// FIN, passed on) goes too: its ended direction's watch for that peer's
// reset stops like a copy and goes on in the successor. A pair whose
// direction ends during its detach, or ended by a reset, stays: the detach
// is taken back and the pair finishes here, as a pair whose copy is held
// up by a peer that does not read stays until it pauses.
//
// Who owns what: a pair being detached is its copies' until both stopped;
// then transferPair gives it to the dataplane's sink (Transfer's loop), which
// sends it and closes this process's descriptors, or gives it back to its
// copies when the successor is gone.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
)

// connState is what a successor needs of a transferred TCP connection
// or UDP flow: one record for both, the fields of the other protocol left
// zero. It is the wire format between releases: fields are added, never
// renamed.
type connState struct {
	Frontend    string         `json:"frontend"` // Key.String()
	Client      netip.AddrPort `json:"client"`
	Endpoint    netip.AddrPort `json:"endpoint"`
	Reason      balance.Reason `json:"reason"`
	BackendSees netip.Addr     `json:"backendSees,omitzero"` // invalid: the node's address
	Start       time.Time      `json:"start"`
	Up          int64          `json:"up"`
	Down        int64          `json:"down"`

	// A TCP connection's: where the client was going, the dial attempt
	// that reached the endpoint, and each direction whose source sent
	// its FIN, passed on (the successor watches that peer for a reset).
	OrigDst    netip.AddrPort `json:"origDst,omitzero"`
	Attempt    int            `json:"attempt,omitempty"`
	UpClosed   bool           `json:"upClosed,omitempty"`
	DownClosed bool           `json:"downClosed,omitempty"`

	// A UDP flow's: the address its datagrams arrived on, when the
	// client last sent (Unix ns).
	Local    netip.Addr `json:"local,omitzero"`
	LastSeen int64      `json:"lastSeen,omitempty"`
	// FlowSees is BackendSees under the name a UDP flow's record gave it
	// before the two records were one: written for, and read from, a
	// daemon of that release (drop it in the release after).
	FlowSees netip.Addr `json:"sees,omitzero"`
}

// detachState is a pair's detach for a transfer, under way.
type detachState struct {
	mu        sync.Mutex
	requested bool
	cancelled bool // a direction ended: the pair stays here
	stopped   int  // directions whose Copy (or reset watch) returned ErrDetached
}

// detachedPair is a pair whose copies both stopped, ready to go.
type detachedPair struct {
	c     *connRecord
	state connState
}

// requestDetach has both directions stop at their next pause: a copy
// when nothing is in flight, a direction that passed its source's FIN on
// in its watch for that peer's reset. Not while a direction is ending or
// has ended otherwise (the pair finishes here).
func (pr *tcpPair) requestDetach() bool {
	pr.detach.mu.Lock()
	ended := int(pr.ended.Load())
	halfClosed := pr.up.closed || pr.down.closed
	if pr.detach.requested || ended == 2 || (ended == 1 && !halfClosed) {
		pr.detach.mu.Unlock()
		return false
	}
	pr.detach.requested = true
	pr.detach.mu.Unlock()
	pr.client.Detach()
	pr.backend.Detach()
	return true
}

// halfClosed marks h as watching for its peer's reset (its copy ended by
// a FIN passed on): the pair may go to a successor half-closed.
func (h *halfCopy) halfClosed() {
	h.pr.detach.mu.Lock()
	h.closed = true
	h.pr.detach.mu.Unlock()
}

// next is what runs h again after a detach taken back: its copy, or its
// watch. Called with the detach lock held.
func (h *halfCopy) next() func() {
	if h.closed {
		return h.watchPeerReset
	}
	return h.run
}

// stopped is a direction's Copy, or reset watch, returning ErrDetached.
func (h *halfCopy) stopped() {
	pr := h.pr
	pr.detach.mu.Lock()
	if pr.detach.cancelled {
		next := h.next()
		pr.detach.mu.Unlock()
		h.src.Undetach()
		h.f.dp.copiers.Go(next)
		return
	}
	pr.detach.stopped++
	both := pr.detach.stopped == 2
	pr.detach.mu.Unlock()
	if both {
		h.f.transferPair(h.c, pr)
	}
}

// endAndCancelDetach counts direction h's end and takes a detach back:
// the other direction, if it stopped already, runs on. Both under the
// detach lock, so that requestDetach, which checks the count under it,
// never starts a detach of a pair one of whose directions is ending (its
// other direction would stop and wait for a partner that never comes). It
// reports whether h is the last direction to end.
func (h *halfCopy) endAndCancelDetach() (last bool) {
	pr := h.pr
	pr.detach.mu.Lock()
	last = pr.ended.Add(1) == 2
	if !pr.detach.requested || pr.detach.cancelled {
		pr.detach.mu.Unlock()
		return last
	}
	pr.detach.cancelled = true
	other := &pr.up
	if other == h {
		other = &pr.down
	}
	restart := pr.detach.stopped == 1
	next := other.next()
	pr.detach.stopped = 0
	pr.detach.mu.Unlock()
	if restart {
		other.src.Undetach()
		h.f.dp.copiers.Go(next)
	}
	return last
}

// resumeDetached gives a stopped pair back to its directions.
func (pr *tcpPair) resumeDetached(f *Frontend) {
	pr.detach.mu.Lock()
	pr.detach.requested, pr.detach.cancelled, pr.detach.stopped = false, false, 0
	up, down := pr.up.next(), pr.down.next()
	pr.detach.mu.Unlock()
	pr.client.Undetach()
	pr.backend.Undetach()
	f.dp.copiers.Go(down)
	f.dp.copiers.Go(up)
}

// transferPair gives a stopped pair to the dataplane's sink, or back to its
// directions when there is none.
func (fe *Frontend) transferPair(c *connRecord, pr *tcpPair) {
	st := c.state()
	pr.detach.mu.Lock()
	st.UpClosed, st.DownClosed = pr.up.closed, pr.down.closed
	pr.detach.mu.Unlock()
	sink := fe.dp.transferSink.Load()
	if sink == nil || !(*sink)(&detachedPair{c: c, state: st}) {
		pr.resumeDetached(fe)
	}
}

// state is what a successor needs of c.
func (c *connRecord) state() connState {
	c.mu.Lock()
	defer c.mu.Unlock()
	return connState{Frontend: c.fe.key.String(), Client: c.Client, OrigDst: c.OrigDst, Endpoint: c.Endpoint,
		Reason: c.Reason, Attempt: c.Attempt, BackendSees: c.BackendSees, Start: c.Start, Up: c.up.Load(), Down: c.down.Load()}
}

// pairsPerBatch bounds one message of pairs (two descriptors each).
const pairsPerBatch = 90

// pairSink is where stopped pairs wait for Transfer's loop. A pair waits
// (on its copier, which blocks no one else) for room in ready; once the
// sink stops, every pair waiting or arriving goes back to its copies.
type pairSink struct {
	ready   chan *detachedPair
	stopc   chan struct{}
	mu      sync.RWMutex // held for reading by put: stop waits for them
	stopped bool
}

func newPairSink(room int) *pairSink {
	return &pairSink{ready: make(chan *detachedPair, room), stopc: make(chan struct{})}
}

// put offers hp to Transfer's loop; false: the sink stopped, hp is its
// copies' again.
func (s *pairSink) put(hp *detachedPair) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.stopped {
		return false
	}
	select {
	case s.ready <- hp:
		return true
	case <-s.stopc:
		return false
	}
}

// stop gives every pair still waiting back to its copies.
func (s *pairSink) stop() {
	close(s.stopc)
	s.mu.Lock()
	s.stopped = true
	s.mu.Unlock()
	for {
		select {
		case hp := <-s.ready:
			hp.c.pair.resumeDetached(hp.c.fe)
		default:
			return
		}
	}
}

// sendPairs sends batch and closes this process's descriptors of it; when
// send fails the pairs go back to their copies.
func sendPairs(batch []*detachedPair, send func([]handover.Socket) error) error {
	socks, err := pairSockets(batch)
	if err == nil {
		err = send(socks)
	}
	for _, s := range socks {
		s.File.Close()
	}
	if err != nil {
		for _, hp := range batch {
			hp.c.pair.resumeDetached(hp.c.fe)
		}
		return err
	}
	for _, hp := range batch {
		hp.c.transferred()
	}
	return nil
}

// pairSockets are the sockets of batch: client then backend, the state on
// the client's.
func pairSockets(batch []*detachedPair) ([]handover.Socket, error) {
	socks := make([]handover.Socket, 0, 2*len(batch))
	for _, hp := range batch {
		meta, err := json.Marshal(hp.state)
		if err != nil {
			return socks, err
		}
		cf, err := hp.c.pair.client.File()
		if err != nil {
			return socks, err
		}
		socks = append(socks, handover.Socket{Name: "conn client", Proto: "tcp", Addr: hp.state.Client.String(), Meta: meta, File: cf})
		bf, err := hp.c.pair.backend.File()
		if err != nil {
			return socks, err
		}
		socks = append(socks, handover.Socket{Name: "conn backend", Proto: "tcp", Addr: hp.state.Endpoint.String(), File: bf})
	}
	return socks, nil
}

// transferred ends c here: its sockets are the successor's now (closing
// ours sends nothing), its record says so.
func (c *connRecord) transferred() {
	pr, f := &c.pair, c.fe
	pr.client.Close()
	pr.backend.Close()
	f.bal.Done(c.endpoint())
	c.finish(f, pr.up.n, pr.down.n, CauseTransferred)
	f.dp.conns.remove(c)
}

func (c *connRecord) isPaired() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.paired
}

// Transfer sends every live UDP flow and TCP connection to the successor
// through send,
// after the frontends closed (Proxier.Release), until none is left (nil) or ctx ends (the ones left
// drain here). A connection ends in this process without a byte lost:
// transferred whole, or not at all.
func (d *Dataplane) Transfer(ctx context.Context, send func([]handover.Socket) error) error {
	// The UDP flows first: the successor reads its UDP sockets once it
	// has them.
	if n, err := d.sendFlows(send); err != nil {
		return err
	} else if n > 0 {
		d.cfg.log().WithField("flows", n).Info("UDP flows transferred")
	}
	sink := newPairSink(4 * pairsPerBatch)
	put := sink.put
	d.transferSink.Store(&put)
	defer func() {
		d.transferSink.Store(nil)
		sink.stop()
	}()

	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	handed := 0
	for {
		for _, c := range d.conns.all() {
			if c.isPaired() {
				c.pair.requestDetach()
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case hp := <-sink.ready:
			batch := []*detachedPair{hp}
			for more := true; more && len(batch) < pairsPerBatch; {
				select {
				case hp := <-sink.ready:
					batch = append(batch, hp)
				default:
					more = false
				}
			}
			if err := sendPairs(batch, send); err != nil {
				return fmt.Errorf("after %d connections: %w", handed, err)
			}
			handed += len(batch)
			continue
		case <-tick.C:
		}
		if d.conns.count() == 0 {
			d.cfg.log().WithField("connections", handed).Info("Every connection transferred")
			return nil
		}
	}
}

// TakeTransfer takes connections a predecessor transferred (UDP flows and
// pairs of sockets, as Transfer sends them) and copies them on. A connection of a
// Service this daemon does not serve (none of byName, the live frontends
// by their key's String) is closed.
func (d *Dataplane) TakeTransfer(byName map[string]*Frontend, socks []handover.Socket) (taken int, err error) {
	var errs []string
	var pairs []handover.Socket
	for _, s := range socks {
		if s.Name != udpFlowName {
			pairs = append(pairs, s)
		} else if err := d.takeFlow(byName, s); err != nil {
			errs = append(errs, err.Error())
		} else {
			taken++
		}
	}
	for i := 0; i+1 < len(pairs); i += 2 {
		if err := d.takePair(byName, pairs[i], pairs[i+1]); err != nil {
			errs = append(errs, err.Error())
			continue
		}
		taken++
	}
	for _, s := range socks {
		s.File.Close()
	}
	if len(errs) > 0 {
		return taken, fmt.Errorf("%d connections not taken: %s", len(errs), strings.Join(errs, "; "))
	}
	return taken, nil
}

func (d *Dataplane) takePair(byName map[string]*Frontend, cs, bs handover.Socket) error {
	var st connState
	if err := json.Unmarshal(cs.Meta, &st); err != nil {
		return fmt.Errorf("connection state: %w", err)
	}
	fe := byName[st.Frontend]
	if fe == nil || fe.protocol != config.TCP {
		return fmt.Errorf("%s: no such TCP frontend here", st.Frontend)
	}
	client, err := sock.FileConn(cs.File)
	if err != nil {
		return err
	}
	backend, err := sock.FileConn(bs.File)
	if err != nil {
		client.Close()
		return err
	}
	backend.HoldSourcePort(d.source.NATFor(st.Endpoint.Addr().Unmap()))
	d.budget.admitTCP() // counted even over the budget: it is open already
	c := d.conns.add(fe, st.Client)
	c.Start = st.Start
	c.up.Store(st.Up)
	c.down.Store(st.Down)
	c.setOrigDst(st.OrigDst)
	c.setBackend(st.Endpoint, st.Reason, st.Attempt)
	c.setDialed(0, st.BackendSees)
	fe.bal.Transferred(st.Endpoint)
	pr := c.setPair(client, backend)
	fe.halves(c, pr)
	for _, h := range []struct {
		*halfCopy
		closed bool
	}{{&pr.up, st.UpClosed}, {&pr.down, st.DownClosed}} {
		if !h.closed {
			fe.dp.copiers.Go(h.run)
			continue
		}
		// Half-closed in the predecessor: the FIN was passed on there.
		pr.ended.Add(1)
		pr.setCause(h.eofCause)
		fe.dp.copiers.Go(h.watchPeerReset)
	}
	return nil
}
