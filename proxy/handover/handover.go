// Package handover passes a running daemon's sockets to its successor on
// the same node, so that an upgrade or restart refuses no connection: the
// listening sockets stay open in the kernel the whole time, first shared,
// then the successor's alone.
//
// The exchange, over a unix SOCK_SEQPACKET socket in a root-only folder
// (each message one JSON object; descriptors ride on the messages that
// list them, SCM_RIGHTS):
//
//	successor                        running daemon
//	hello {versions, profile} →
//	                          ←      offer {version, pid, count} | refuse {reason, pid, differences}
//	                          ←      sockets {sockets} + descriptors, until count
//	                          ←      end
//	freeze                    →      (stops changing anything the successor took)
//	                          ←      frozen {count}, state {data} × count
//	                                 (the giver's state beyond the sockets)
//	   (the successor syncs: it serves on the sockets it took and writes its rules)
//	serving                   →      (closes its copies, serves nothing more)
//	                          ←      released
//	                          ←      conns {sockets} + descriptors, in
//	                                 batches (the UDP flows first), until done
//
// Only a true successor takes over: the running daemon refuses one whose
// profile (how it would serve the node: the daemon's settings, named by
// the daemon) differs from its own, before it lends anything, and names
// each difference; such a successor must not start (Take's
// *MismatchError). A successor that sends no profile (an older version)
// is taken as a true one.
//
// Until the running daemon is told "serving" it keeps serving: both accept
// on the shared sockets meanwhile, each connection has one owner. If the
// exchange breaks before that (either side killed), the running daemon
// goes on as before and the successor, if alive, starts plainly; a broken
// exchange after "serving" leaves the successor the only one serving.
//
// Who owns what: Serve's goroutine owns the listening unix socket and one
// exchange at a time; a Predecessor (Take) owns its connection and the
// descriptors it received until the caller takes them (Socket.File).
//
// It knows sockets, not proxies: it imports the kernel layer (package
// kernel: SCM_RIGHTS, peer credentials) and nothing else of this project.
package handover

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// Version is the exchange's version; a successor and a running daemon
// hand over only when they share one.
const Version = 1

// Profile is how a daemon serves its node, setting by setting (its
// names and values are the daemon's): a successor takes over only from a
// running daemon with the same profile.
type Profile map[string]string

// differences lists, sorted, the settings in which successor's profile
// differs from running's, each as "name: the running daemon's X, this
// one's Y".
func (running Profile) differences(successor Profile) []string {
	var out []string
	seen := map[string]bool{}
	for _, m := range []Profile{running, successor} {
		for name := range m {
			if seen[name] {
				continue
			}
			seen[name] = true
			r, rok := running[name]
			s, sok := successor[name]
			if r == s && rok == sok {
				continue
			}
			out = append(out, fmt.Sprintf("%s: the running daemon's %s, this one's %s", name, said(r, rok), said(s, sok)))
		}
	}
	slices.Sort(out)
	return out
}

func said(v string, ok bool) string {
	if !ok {
		return "unsaid"
	}
	return strconv.Quote(v)
}

// Socket is one socket handed over.
type Socket struct {
	// Name says what serves on it: the giver's and the taker's code agree
	// on names ("http healthz", a frontend's key and role).
	Name  string `json:"name"`
	Proto string `json:"proto"` // "tcp" or "udp"
	Addr  string `json:"addr"`  // the address it is bound to (a connection's: its peer)
	// Meta is what the giver tells of the socket beyond that (a
	// connection's state), opaque to this package.
	Meta json.RawMessage `json:"meta,omitempty"`
	// File is the descriptor: the taker's own once received. A giver
	// gives Open instead, which makes a duplicate just before it is sent
	// (closed after): a daemon near its descriptor limit could not hold a
	// duplicate of every listener at once.
	File *os.File                 `json:"-"`
	Open func() (*os.File, error) `json:"-"`
}

// msgType is a message's type. The strings are the wire format: a daemon
// hands over to one of another release, so they never change.
type msgType string

// The exchange's messages (the package comment draws their order).
const (
	msgHello    msgType = "hello"    // successor: versions, profile
	msgOffer    msgType = "offer"    // running daemon: version, pid, count of sockets
	msgRefuse   msgType = "refuse"   // running daemon: reason, differences
	msgSockets  msgType = "sockets"  // running daemon: listening sockets, with descriptors
	msgEnd      msgType = "end"      // running daemon: every socket sent
	msgFreeze   msgType = "freeze"   // successor: stop changing what I took
	msgFrozen   msgType = "frozen"   // running daemon: count of state pieces
	msgState    msgType = "state"    // running daemon: a piece of the pick state
	msgServing  msgType = "serving"  // successor: my rules are written
	msgReleased msgType = "released" // running daemon: I serve nothing more
	msgConns    msgType = "conns"    // running daemon: transferred connections and flows, with descriptors
	msgDone     msgType = "done"     // running daemon: every connection transferred
)

// A worker's messages to its keeper (keeper.go).
const (
	msgKeep           msgType = "keep"
	msgDrop           msgType = "drop"
	msgAlive          msgType = "alive"
	msgPicks          msgType = "picks"
	msgWorkerReleased msgType = "handed-over"
)

// message is one message of the exchange.
type message struct {
	Type     msgType `json:"type"`
	Versions []int   `json:"versions,omitempty"`
	Version  int     `json:"version,omitempty"`
	PID      int     `json:"pid,omitempty"`
	Count    int     `json:"count,omitempty"`
	Reason   string  `json:"reason,omitempty"`
	// NetNS is the sender's network namespace (hello, offer): listeners
	// and connections only make sense in the namespace they live in.
	NetNS uint64 `json:"netns,omitempty"`
	// Profile is the successor's (hello); Differences are the running
	// daemon's reasons to refuse it.
	Profile     Profile  `json:"profile,omitempty"`
	Differences []string `json:"differences,omitempty"`
	// Names are the sockets a worker dropped (keeper.go).
	Names []string `json:"names,omitempty"`
	// Data is a piece of the giver's state beyond the sockets ("state",
	// Count of them after "frozen").
	Data    []byte   `json:"data,omitempty"`
	Sockets []Socket `json:"sockets,omitempty"`
}

// perMessage bounds the descriptors of one message (the kernel's limit for
// SCM_RIGHTS is 253).
const perMessage = 200

// maxMessage bounds one message: perMessage sockets with long names fit.
const maxMessage = 256 << 10

// stepTimeout bounds each step of the exchange but the wait for the
// successor's first sync (its source may take long to answer).
const stepTimeout = 10 * time.Second

// transferAfterStop bounds the transfer of live connections once this daemon
// is told to stop: thousands take under a second (docs/benchmarks.md,
// Handover); what is left then drains here.
const transferAfterStop = 10 * time.Second

// Listen opens the handover socket at path: its folder made root-only, a
// stale socket of a previous daemon replaced, the socket itself 0600.
func Listen(path string) (*net.UnixListener, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("handover socket folder %s: %w", dir, err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("handover socket folder %s: %w", dir, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("replacing %s: %w", path, err)
	}
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("handover socket: %w", err)
	}
	// The successor replaces the path with its own socket: ours must not
	// remove that when it closes.
	ln.SetUnlinkOnClose(false)
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("handover socket %s: %w", path, err)
	}
	return ln, nil
}

// Giver is the running daemon's side of an exchange.
type Giver interface {
	// Lend returns duplicates of the sockets to hand over; the daemon
	// goes on serving on its own.
	Lend(ctx context.Context) ([]Socket, error)
	// Freeze stops every change to what was lent (no sync, no rule
	// write) until Release or Thaw, and returns the state the successor
	// needs beyond the sockets (opaque here: the pick state).
	Freeze(ctx context.Context) (json.RawMessage, error)
	// Thaw: the successor went away before it served; go on as before.
	Thaw()
	// Release: the successor serves. Stop serving, close the lent
	// sockets' originals, never take anything back.
	Release(successorPID int)
	// Transfer sends the live connections, in batches (each socket's Meta
	// its state), until none is left or ctx ends; what send could not
	// take stays the giver's.
	Transfer(ctx context.Context, send func([]Socket) error) error
}

// Serve hands over to successors that connect to ln until one has taken
// over (then it returns, having closed ln) or ctx ends. It refuses peers
// that are neither root nor this process's user, successors in another
// network namespace (two namespaces' daemons given one socket path),
// successors that speak no version it knows, and successors whose profile
// is not own (this daemon's; nil: any, for a keeper); the exchange of one
// successor at a time.
func Serve(ctx context.Context, ln *net.UnixListener, g Giver, own Profile, log logrus.FieldLogger) <-chan struct{} {
	done := make(chan struct{})
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	go func() {
		defer close(done)
		defer stop()
		defer ln.Close()
		for {
			c, err := ln.AcceptUnix()
			if err != nil {
				if ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
					log.WithError(err).Error("Handover socket failed")
				}
				return
			}
			if give(ctx, c, g, own, log) {
				return
			}
		}
	}()
	return done
}

// GiveTo serves the exchange to one worker of a keeper on c, a connection
// made otherwise (keeper.go), and reports whether it took the sockets;
// c is closed.
func GiveTo(ctx context.Context, c *net.UnixConn, g Giver, log logrus.FieldLogger) bool {
	return give(ctx, c, g, nil, log)
}

// give serves one successor on c and reports whether it took over.
func give(ctx context.Context, c *net.UnixConn, g Giver, own Profile, log logrus.FieldLogger) bool {
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer func() { stop() }()
	p, err := peerOf(c)
	if err != nil {
		log.WithError(err).Warn("Handover refused: the peer's credentials are unreadable")
		return false
	}
	log = log.WithField("successor", p.String())
	_ = c.SetDeadline(time.Now().Add(stepTimeout))
	hello, _, err := receive(c)
	if p.uid != 0 && p.uid != uint32(os.Geteuid()) {
		log.Warn("Handover refused: the peer is neither root nor this daemon's user")
		_ = send(c, message{Type: msgRefuse, Reason: "not root"}, nil)
		return false
	}
	if err != nil || hello.Type != msgHello {
		log.WithError(err).WithField("message", hello.Type).Warn("Handover refused: no hello from the peer")
		return false
	}
	if !slices.Contains(hello.Versions, Version) {
		log.WithField("versions", fmt.Sprint(hello.Versions)).WithField("ours", Version).
			Warn("Handover refused: the successor speaks no version of ours; it starts on its own, we go on until stopped")
		_ = send(c, message{Type: msgRefuse, Reason: fmt.Sprintf("version %d only", Version), Version: Version}, nil)
		return false
	}
	if ours, err := kernel.NetNS(); err != nil || hello.NetNS != ours {
		log.WithError(err).WithFields(logrus.Fields{"theirs": hello.NetNS, "ours": ours}).
			Warn("Handover refused: the successor runs in another network namespace (give each namespace's daemon its own --handover-socket)")
		_ = send(c, message{Type: msgRefuse, Reason: reasonOtherNetNS}, nil)
		return false
	}
	if own == nil {
		// A keeper (keeper.go): it serves nothing itself; its worker
		// takes back what it kept.
	} else if hello.Profile == nil {
		log.Info("The successor says nothing of how it serves (an older version): taken as a true successor")
	} else if diff := own.differences(hello.Profile); len(diff) > 0 {
		log.WithFields(logrus.Fields{"command": p.command(), "differences": strings.Join(diff, "; ")}).
			Warn("Handover refused: the successor would serve this node otherwise (a daemon started by hand beside this one?); it does not start, we serve on")
		_ = send(c, message{Type: msgRefuse, Reason: reasonMismatch, PID: os.Getpid(), Differences: diff}, nil)
		return false
	}
	start := time.Now()
	socks, err := g.Lend(ctx)
	if err != nil {
		log.WithError(err).Error("Handover refused: cannot lend the sockets")
		_ = send(c, message{Type: msgRefuse, Reason: err.Error()}, nil)
		return false
	}
	sent := sendSockets(c, socks)
	if sent != nil {
		log.WithError(sent).Warn("Handover broke off while sending the sockets; serving on")
		return false
	}
	// The successor now starts its source and syncs once it has the
	// whole picture, which can take long: no deadline but ctx and the peer.
	_ = c.SetDeadline(time.Time{})
	m, _, err := receive(c)
	if err != nil || m.Type != msgFreeze {
		log.WithError(err).WithField("message", m.Type).Warn("Handover broke off before the successor synced; serving on")
		return false
	}
	state, err := g.Freeze(ctx)
	if err != nil {
		log.WithError(err).Warn("Handover broke off: cannot freeze; serving on")
		return false
	}
	thaw := true
	defer func() {
		if thaw {
			g.Thaw()
		}
	}()
	if err := sendState(c, state); err != nil {
		log.WithError(err).Warn("Handover broke off; serving on")
		return false
	}
	m, _, err = receive(c)
	if err != nil || m.Type != msgServing {
		log.WithError(err).WithField("message", m.Type).Warn("Handover broke off during the successor's first sync; serving on")
		return false
	}
	// From here on the successor serves and our connections are its to
	// take: a stop (SIGTERM, as a rollout sends once the successor is
	// ready) must not break off their transfer, or it would cut every one
	// of them. The transfer goes on, for at most transferAfterStop after a
	// stop; the shutdown waits for it (serve.go).
	if !stop() {
		log.Warn("Stopped during the handover, before the successor took over: our connections drain here")
		return false
	}
	thaw = false
	transferCtx, breakOff := context.WithCancel(context.WithoutCancel(ctx))
	defer breakOff()
	stopLate := context.AfterFunc(ctx, func() { time.AfterFunc(transferAfterStop, breakOff) })
	defer stopLate()
	stop = context.AfterFunc(transferCtx, func() { c.Close() })
	g.Release(int(p.pid))
	_ = c.SetDeadline(time.Now().Add(stepTimeout))
	if err := send(c, message{Type: msgReleased}, nil); err != nil {
		log.WithError(err).Warn("The successor left before the handover's end; our connections drain here")
		return true
	}
	log.WithFields(logrus.Fields{"sockets": len(socks), "took": time.Since(start).Round(time.Microsecond).String()}).
		Info("Handed over to the successor; serving nothing more")
	_ = c.SetDeadline(time.Time{})
	err = g.Transfer(transferCtx, func(conns []Socket) error {
		fds := make([]int, len(conns))
		for i, s := range conns {
			fds[i] = int(s.File.Fd())
		}
		_ = c.SetWriteDeadline(time.Now().Add(stepTimeout))
		return send(c, message{Type: msgConns, Sockets: conns}, fds)
	})
	if err != nil {
		log.WithError(err).Warn("Connections not handed over drain here")
		return true
	}
	_ = send(c, message{Type: msgDone}, nil)
	return true
}

// sendSockets sends the offer, socks in "sockets" messages (openSend),
// and the end.
func sendSockets(c *net.UnixConn, socks []Socket) error {
	ns, err := kernel.NetNS()
	if err != nil {
		return err
	}
	if err := send(c, message{Type: msgOffer, Version: Version, PID: os.Getpid(), Count: len(socks), NetNS: ns}, nil); err != nil {
		return err
	}
	if err := openSend(c, msgSockets, socks); err != nil {
		return err
	}
	return send(c, message{Type: msgEnd}, nil)
}

// openSend sends socks in messages of type typ, perMessage sockets each,
// each socket opened just before and its duplicate closed after: one that
// cannot be opened, closed meanwhile, is left out.
func openSend(c *net.UnixConn, typ msgType, socks []Socket) error {
	for chunk := range slices.Chunk(socks, perMessage) {
		var fds []int
		var files []*os.File
		var sending []Socket
		for _, s := range chunk {
			f, err := s.Open()
			if err != nil {
				continue
			}
			files = append(files, f)
			// Fd keeps the file non-blocking: os.NewFile saw it so.
			fds = append(fds, int(f.Fd()))
			sending = append(sending, s)
		}
		var err error
		if len(sending) > 0 {
			err = send(c, message{Type: typ, Sockets: sending}, fds)
		}
		closeAll(files)
		if err != nil {
			return err
		}
	}
	return nil
}

// ErrRefused is Take's error when the running daemon would not hand over.
var ErrRefused = errors.New("the running daemon refused the handover")

// ErrOtherNetNS is Take's error when the daemon on the socket serves
// another network namespace: its sockets are not ours to take, and its
// handover socket is not ours to replace.
var ErrOtherNetNS = errors.New("the daemon on the handover socket serves another network namespace")

const reasonOtherNetNS = "another network namespace"

// reasonMismatch refuses a successor whose profile differs.
const reasonMismatch = "serves otherwise"

// MismatchError is Take's error when the running daemon (PID) serves the
// node otherwise than this one would: it handed nothing over and serves
// on. Differences name each setting, as Profile's differences do.
type MismatchError struct {
	PID         int
	Differences []string
}

func (e *MismatchError) Error() string {
	return fmt.Sprintf("the running daemon (pid %d) serves this node otherwise: %s", e.PID, strings.Join(e.Differences, "; "))
}

// Unwrap makes a MismatchError an ErrRefused.
func (e *MismatchError) Unwrap() error { return ErrRefused }

// Predecessor is a running daemon that is handing over to this one.
type Predecessor struct {
	c   *net.UnixConn
	PID int
	// Sockets are what it handed over; the caller owns their Files.
	Sockets []Socket
}

// Take asks the daemon on path for its sockets, telling it how this one
// would serve (profile). With none there (no socket, nobody listening) it
// returns nil, nil: a plain start. A *MismatchError means the running
// daemon serves otherwise and must be left alone; any other error means a
// plain start; the caller says so.
func Take(ctx context.Context, path string, profile Profile) (*Predecessor, error) {
	var d net.Dialer
	dctx, cancel := context.WithTimeout(ctx, stepTimeout)
	defer cancel()
	nc, err := d.DialContext(dctx, "unixpacket", path)
	if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("handover socket %s: %w", path, err)
	}
	return TakeFrom(ctx, nc.(*net.UnixConn), profile)
}

// TakeFrom is Take on c, a connection to the giver made otherwise (a
// keeper's socket pair, keeper.go); c is the Predecessor's, or closed.
func TakeFrom(ctx context.Context, c *net.UnixConn, profile Profile) (*Predecessor, error) {
	path := "of the keeper"
	if a := c.RemoteAddr(); a != nil && a.String() != "" {
		path = a.String()
	}
	p := &Predecessor{c: c}
	ok := false
	defer func() {
		if !ok {
			for _, s := range p.Sockets {
				s.File.Close()
			}
			p.Close()
		}
	}()
	cred, err := peerOf(c)
	if err != nil {
		return nil, fmt.Errorf("handover socket %s: %w", path, err)
	}
	if cred.uid != 0 && cred.uid != uint32(os.Geteuid()) {
		return nil, fmt.Errorf("handover socket %s: served by %s, neither root nor us", path, cred)
	}
	ns, err := kernel.NetNS()
	if err != nil {
		return nil, fmt.Errorf("handover: %w", err)
	}
	_ = c.SetDeadline(time.Now().Add(stepTimeout))
	if err := send(c, message{Type: msgHello, Versions: []int{Version}, PID: os.Getpid(), NetNS: ns, Profile: profile}, nil); err != nil {
		return nil, fmt.Errorf("handover: %w", err)
	}
	offer, _, err := receive(c)
	switch {
	case err != nil:
		return nil, fmt.Errorf("handover: %w", err)
	case offer.Type == msgRefuse && offer.Reason == reasonOtherNetNS,
		offer.Type == msgOffer && offer.NetNS != ns:
		return nil, fmt.Errorf("%w (socket %s)", ErrOtherNetNS, path)
	case offer.Type == msgRefuse && offer.Reason == reasonMismatch:
		return nil, &MismatchError{PID: offer.PID, Differences: offer.Differences}
	case offer.Type == msgRefuse:
		return nil, fmt.Errorf("%w: %s", ErrRefused, offer.Reason)
	case offer.Type != msgOffer || offer.Version != Version:
		return nil, fmt.Errorf("handover: unexpected %q version %d", offer.Type, offer.Version)
	}
	p.PID = offer.PID
	for {
		m, files, err := receive(c)
		if err != nil {
			return nil, fmt.Errorf("handover: after %d of %d sockets: %w", len(p.Sockets), offer.Count, err)
		}
		if m.Type == msgEnd {
			break
		}
		if m.Type != msgSockets || len(files) != len(m.Sockets) {
			closeAll(files)
			return nil, fmt.Errorf("handover: %q with %d descriptors for %d sockets", m.Type, len(files), len(m.Sockets))
		}
		for i := range m.Sockets {
			m.Sockets[i].File = files[i]
		}
		p.Sockets = append(p.Sockets, m.Sockets...)
	}
	_ = c.SetDeadline(time.Time{})
	ok = true
	return p, nil
}

// Freeze tells the predecessor that this daemon syncs now: it stops
// changing anything until Serving (or until this connection ends). It
// returns the predecessor's state beyond the sockets.
func (p *Predecessor) Freeze(ctx context.Context) (json.RawMessage, error) {
	m, err := p.step(ctx, msgFreeze, msgFrozen)
	if err != nil {
		return nil, err
	}
	var state []byte
	for i := 0; i < m.Count; i++ {
		piece, _, err := receive(p.c)
		if err != nil {
			return nil, fmt.Errorf("handover state: %w", err)
		}
		if piece.Type != msgState {
			return nil, fmt.Errorf("handover state: answered %q", piece.Type)
		}
		state = append(state, piece.Data...)
	}
	return state, nil
}

// statePiece bounds one piece of the state: base64 in JSON, it stays well
// inside maxMessage and a unix socket's default send buffer (208 KiB).
const statePiece = 96 << 10

// sendState sends "frozen" and state in pieces (10 000 service ports'
// pick state is megabytes).
func sendState(c *net.UnixConn, state []byte) error {
	pieces := (len(state) + statePiece - 1) / statePiece
	if err := send(c, message{Type: msgFrozen, Count: pieces}, nil); err != nil {
		return err
	}
	for len(state) > 0 {
		n := min(len(state), statePiece)
		if err := send(c, message{Type: msgState, Data: state[:n]}, nil); err != nil {
			return err
		}
		state = state[n:]
	}
	return nil
}

// Serving tells the predecessor that this daemon serves: it closes its
// copies and serves nothing more.
func (p *Predecessor) Serving(ctx context.Context) error {
	_, err := p.step(ctx, msgServing, msgReleased)
	return err
}

func (p *Predecessor) step(ctx context.Context, say, want msgType) (message, error) {
	stop := context.AfterFunc(ctx, func() { p.c.Close() })
	defer stop()
	_ = p.c.SetDeadline(time.Now().Add(stepTimeout))
	if err := send(p.c, message{Type: say}, nil); err != nil {
		return message{}, fmt.Errorf("handover %s: %w", say, err)
	}
	m, _, err := receive(p.c)
	if err != nil {
		return message{}, fmt.Errorf("handover %s: %w", say, err)
	}
	if m.Type != want {
		return message{}, fmt.Errorf("handover %s: answered %q", say, m.Type)
	}
	return m, nil
}

// Transfer receives the live connections and UDP flows the predecessor
// transfers after Serving, giving each batch to take (which owns its
// Files), until the predecessor has none left (nil) or the exchange ends.
func (p *Predecessor) Transfer(ctx context.Context, take func([]Socket)) error {
	stop := context.AfterFunc(ctx, func() { p.c.Close() })
	defer stop()
	_ = p.c.SetDeadline(time.Time{})
	for {
		m, files, err := receive(p.c)
		if err != nil {
			return fmt.Errorf("handover of connections: %w", err)
		}
		switch {
		case m.Type == msgDone:
			return nil
		case m.Type != msgConns || len(files) != len(m.Sockets):
			closeAll(files)
			return fmt.Errorf("handover of connections: %q with %d descriptors for %d sockets", m.Type, len(files), len(m.Sockets))
		}
		for i := range m.Sockets {
			m.Sockets[i].File = files[i]
		}
		take(m.Sockets)
	}
}

// Close ends the exchange; the sockets' Files stay the caller's.
func (p *Predecessor) Close() { p.c.Close() }
