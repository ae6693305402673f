package dataplane

// UDP flows transferred to a successor. At Release each UDP server stops its
// read loop and detaches its flows: a flow's reply goroutine stops at its
// next read, leaving the socket to its endpoint open and what the endpoint
// sends meanwhile queued in it. Transfer sends those sockets first, one
// batch (empty when there are none), with what the flow table knows of
// each (client, the address its datagrams arrived on, endpoint, the
// address the backend sees). The successor puts each flow in its table
// and only then reads its frontend sockets, which hold the clients'
// datagrams of the pause: a client on one source port keeps its endpoint
// and its conntrack source NAT, and loses nothing.
//
// Who owns what: a detached flow is its reply goroutine's until that
// exits (fl.stopped); then the dataplane's (detachedFlows) until Transfer
// sent it and closed this process's socket. In the successor a taken
// flow is its UDP server's, as one it opened.

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
)

// udpFlowName is a transferred UDP flow's socket name.
const udpFlowName = "udp flow"

// detachFlows stops the read loop and takes every flow out of the table,
// its reply goroutine stopped and its socket open: the flows that can be
// transferred (one that ended meanwhile is not).
func (u *udpServer) detachFlows() []*udpFlow {
	u.stopReading()
	u.flows.mu.Lock()
	all := make([]*udpFlow, 0, len(u.flows.flows))
	for _, fl := range u.flows.flows {
		all = append(all, fl)
	}
	for _, fl := range all {
		u.flows.removeLocked(fl)
		u.m.get().udpActive.Dec()
	}
	u.flows.mu.Unlock()
	for _, fl := range all {
		fl.detached.Store(true)
		_ = fl.backend.SetReadDeadline(time.Now()) // wakes its reply goroutine
	}
	out := all[:0]
	for _, fl := range all {
		<-fl.stopped
		if fl.transferable {
			out = append(out, fl)
		}
	}
	return out
}

// detachedFlow is a detached flow and its server.
type detachedFlow struct {
	u  *udpServer
	fl *udpFlow
}

// socket is hf's flow socket (a duplicate) and state, for the successor.
func (hf detachedFlow) socket() (handover.Socket, error) {
	fl := hf.fl
	meta, err := json.Marshal(connState{Frontend: hf.u.key.String(), Client: fl.client, Local: fl.local, Endpoint: fl.endpoint,
		Reason: fl.reason, BackendSees: fl.sees, FlowSees: fl.sees, Start: fl.start, LastSeen: fl.lastSeen.Load(), Up: fl.up.Load(), Down: fl.down.Load()})
	if err != nil {
		return handover.Socket{}, err
	}
	f, err := sock.UDPFile(fl.backend)
	if err != nil {
		return handover.Socket{}, err
	}
	return handover.Socket{Name: udpFlowName, Proto: "udp", Addr: fl.endpoint.String(), Meta: meta, File: f}, nil
}

// end ends a detached flow here: its socket closed, its source NAT given
// back unless the successor has it, its line in the connection log.
func (hf detachedFlow) end(cause Cause, release bool) {
	fl, u := hf.fl, hf.u
	fl.cause.CompareAndSwap(uint32(causeNone), uint32(cause))
	fl.backend.Close()
	if release {
		fl.release()
	}
	u.logEnd(endLine{protocol: config.UDP, client: fl.client, endpoint: fl.endpoint, reason: fl.reason,
		up: fl.up.Load(), down: fl.down.Load(), start: fl.start, cause: Cause(fl.cause.Load()), backendSees: seesName(fl.sees)})
}

// OpenUDPGate lets the UDP read loops run: the predecessor's flows are in the
// tables, or will not come.
func (d *Dataplane) OpenUDPGate() {
	if d.udpGate != nil {
		d.openUDP.Do(func() { close(d.udpGate) })
	}
}

// DetachUDPFlows detaches the flows of every UDP server of frontends, for
// Transfer.
func (d *Dataplane) DetachUDPFlows(frontends []*Frontend) {
	var flows []detachedFlow
	for _, fe := range frontends {
		if fe.udp == nil || fe.udp.sk == nil {
			continue
		}
		for _, fl := range fe.udp.detachFlows() {
			flows = append(flows, detachedFlow{u: fe.udp, fl: fl})
		}
	}
	d.mu.Lock()
	d.detachedFlows = flows
	d.mu.Unlock()
}

// sendFlows sends the detached flows in one batch (empty when there are
// none: the successor reads its UDP sockets once it has it), and ends them
// here. A flow that cannot be sent ends here, as at a shutdown.
func (d *Dataplane) sendFlows(send func([]handover.Socket) error) (int, error) {
	d.mu.Lock()
	flows := d.detachedFlows
	d.detachedFlows = nil
	d.mu.Unlock()
	socks := make([]handover.Socket, 0, len(flows))
	var sent []detachedFlow
	for _, hf := range flows {
		s, err := hf.socket()
		if err != nil {
			hf.end(CauseShutdown, true)
			continue
		}
		socks = append(socks, s)
		sent = append(sent, hf)
	}
	err := send(socks)
	for _, s := range socks {
		s.File.Close()
	}
	for _, hf := range sent {
		if err != nil {
			hf.end(CauseShutdown, true)
		} else {
			hf.end(CauseTransferred, false)
		}
	}
	if err != nil {
		return 0, fmt.Errorf("UDP flows: %w", err)
	}
	return len(sent), nil
}

// takeFlow puts a flow a predecessor transferred in its frontend's table
// and starts its reply goroutine.
func (d *Dataplane) takeFlow(byName map[string]*Frontend, s handover.Socket) error {
	var st connState
	if err := json.Unmarshal(s.Meta, &st); err != nil {
		return fmt.Errorf("UDP flow state: %w", err)
	}
	if !st.BackendSees.IsValid() {
		st.BackendSees = st.FlowSees // a predecessor of the release before
	}
	fe := byName[st.Frontend]
	if fe == nil || fe.udp == nil {
		return fmt.Errorf("%s: no such UDP frontend here", st.Frontend)
	}
	u := fe.udp
	c, err := sock.FileUDP(s.File)
	if err != nil {
		return err
	}
	out, err := sock.NewSender(c, config.Family(st.Endpoint.Addr()))
	if err != nil {
		c.Close()
		return err
	}
	nat := d.source.NATFor(st.Client.Addr().Unmap())
	fl := &udpFlow{client: st.Client, local: st.Local, endpoint: st.Endpoint, reason: st.Reason, backend: c, out: out,
		sees: st.BackendSees, start: st.Start}
	fl.release = sock.HoldUDPFrom(c, st.Endpoint, nat, st.BackendSees)
	fl.lastSeen.Store(st.LastSeen)
	fl.up.Store(st.Up)
	fl.down.Store(st.Down)
	fe.bal.Transferred(st.Endpoint)
	if in, ok := u.insert(fl); !ok {
		c.Close()
		fl.release()
		fe.bal.Done(st.Endpoint)
		if in == nil {
			return fmt.Errorf("%s: not serving", st.Frontend)
		}
		return fmt.Errorf("%s: the flow of %s exists already", st.Frontend, st.Client)
	}
	return nil
}
