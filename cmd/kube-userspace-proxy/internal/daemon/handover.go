package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/internal/options"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// A daemon started beside a running one takes its sockets over (package
// handover): the HTTP listeners here, the frontends' in the Proxier
// (proxy.Proxier.Inherit). Once it serves it tells the predecessor, which
// stops serving, and opens the handover socket for its own successor.

// The HTTP listeners' names in a handover.
const (
	httpHealthz = "http healthz"
	httpMetrics = "http metrics"
)

// predecessor is the running daemon handing over to this one; nil: none.
type predecessor struct {
	*handover.Predecessor
	used map[int]bool // Sockets taken by this file (the HTTP listeners)
}

// takeOver asks a running daemon for its sockets; nil with none, or
// when the exchange fails (said in the log: the start is then plain). It
// returns the path this daemon serves its own successors on: path, or ""
// when that socket is a daemon's of another network namespace (not ours
// to replace). A running daemon that serves the node otherwise than
// profile says this one would is an error: this one must not start.
func takeOver(ctx context.Context, path string, profile handover.Profile, log logrus.FieldLogger) (*predecessor, string, error) {
	start := time.Now()
	// Restarted by our keeper after a crash: it holds our sockets.
	p, err := handover.KeptFromEnv(ctx, profile)
	if p != nil || err != nil {
		log.Info("Restarted by the keeper: taking back the sockets it kept")
	} else if path == "" {
		return nil, "", nil
	} else {
		p, err = handover.Take(ctx, path, profile)
	}
	var mismatch *handover.MismatchError
	switch {
	case errors.As(err, &mismatch):
		return nil, "", fmt.Errorf("another kube-userspace-proxy (pid %d, handover socket %s) serves this node otherwise than this one would (%s); "+
			"it serves on, untouched. To run this one beside it, give it --handover-socket '' (and addresses of its own for "+
			"--metrics-bind-address and --healthz-bind-address); to replace it, start this one with its settings",
			mismatch.PID, path, strings.Join(mismatch.Differences, "; "))
	case errors.Is(err, handover.ErrOtherNetNS):
		log.WithError(err).Error("The handover socket is another network namespace's daemon's: starting on our own, and no successor can take over from us; give each namespace's daemon its own --handover-socket")
		return nil, "", nil
	case err != nil:
		log.WithError(err).Warn("No handover from the running daemon; starting on our own")
		return nil, path, nil
	case p == nil:
		log.WithField("socket", path).Debug("No daemon running; starting on our own")
		return nil, path, nil
	}
	log.WithFields(logrus.Fields{"predecessor": p.PID, "sockets": len(p.Sockets), "took": time.Since(start).Round(time.Microsecond).String()}).
		Info("Taking over from the running daemon")
	return &predecessor{Predecessor: p, used: map[int]bool{}}, path, nil
}

// handoverProfile is how this daemon would serve the node, which a
// successor's must equal for it to take over (docs/operations.md,
// Upgrades): the node's name, the kind of source, whether it manages the
// rules, the proxy port range and the families it has rules for.
func handoverProfile(o *options.Options, node string, ipt *iptables.Rules) handover.Profile {
	source := "API server"
	if o.Manifests != "" {
		source = "manifests"
	}
	rules, families := "not managed (--iptables=false)", []string{"IPv4", "IPv6"}
	if ipt != nil {
		rules, families = "managed", nil
		for _, f := range ipt.Families() {
			families = append(families, fmt.Sprintf("IPv%d", f))
		}
	}
	return handover.Profile{"node": node, "source": source, "rules": rules,
		"proxy port range": o.PortRange.String(), "families": strings.Join(families, ",")}
}

// listener is the inherited HTTP listener name on addr, or nil.
func (p *predecessor) listener(name, addr string) net.Listener {
	if p == nil {
		return nil
	}
	for i, s := range p.Sockets {
		if s.Name != name || s.Addr != addr || p.used[i] {
			continue
		}
		p.used[i] = true
		ln, err := net.FileListener(s.File)
		s.File.Close()
		if err != nil {
			return nil
		}
		return ln
	}
	return nil
}

// inherit hands the frontends' sockets to the Proxier (the HTTP listeners
// are startHTTP's, through listener), which freezes the
// predecessor just before its first sync.
func (p *predecessor) inherit(ctx context.Context, px *proxy.Proxier) {
	if p == nil {
		return
	}
	var rest []handover.Socket
	for i, s := range p.Sockets {
		if !p.used[i] && !strings.HasPrefix(s.Name, "http ") {
			p.used[i] = true
			rest = append(rest, s)
		}
	}
	px.Inherit(rest, func() (json.RawMessage, error) { return p.Freeze(ctx) })
}

// close ends the exchange and closes what nobody took.
func (p *predecessor) close() {
	if p == nil {
		return
	}
	for i, s := range p.Sockets {
		if !p.used[i] {
			p.used[i] = true
			s.File.Close()
		}
	}
	p.Close()
}

// takeTransfer takes the predecessor's UDP flows (its first batch, after
// which the UDP frontends read their sockets) and live connections until
// it has none left.
func takeTransfer(ctx context.Context, pred *predecessor, p *proxy.Proxier, log logrus.FieldLogger) {
	defer p.FlowsTransferred()
	start := time.Now()
	total := 0
	err := pred.Transfer(ctx, func(socks []handover.Socket) {
		n, err := p.TakeTransfer(socks)
		p.FlowsTransferred()
		total += n
		if err != nil {
			log.WithError(err).Warn("Connections the predecessor transferred were closed")
		}
	})
	l := log.WithFields(logrus.Fields{"connections": total, "took": time.Since(start).Round(time.Millisecond).String()})
	if err != nil {
		l.WithError(err).Warn("The predecessor stopped transferring connections; the rest drain in it")
		return
	}
	l.Info("Took the predecessor's connections")
}

// keeperLink is the link to the keeper that runs this daemon (kube-userspace-proxy
// keep), or nil.
func keeperLink(log logrus.FieldLogger) *handover.KeeperLink {
	k, err := handover.KeeperFromEnv()
	if err != nil {
		log.WithError(err).Warn("Not kept: a crash refuses connections until the next start")
		return nil
	}
	if k != nil {
		log.Info("Kept: a keeper holds this daemon's listening sockets, and starts another on them if it crashes")
	}
	return k
}

// socketKeeper is k for the Proxier (nil when there is none).
func socketKeeper(k *handover.KeeperLink) proxy.SocketKeeper {
	if k == nil {
		return nil
	}
	return k
}

// giver is this daemon's side when a successor takes over.
type giver struct {
	p        *proxy.Proxier
	http     map[string]*httpServing
	addrs    map[string]string
	stopHTTP func()
	ready    readyFile
	keeper   *handover.KeeperLink // nil: none
	log      logrus.FieldLogger
}

func (g *giver) Lend(ctx context.Context) ([]handover.Socket, error) {
	socks, err := g.p.Lend(ctx)
	if err != nil {
		return nil, err
	}
	for name, s := range g.http {
		if s.bound() {
			socks = append(socks, handover.Socket{Name: name, Proto: "tcp", Addr: g.addrs[name], Open: s.lend})
		}
	}
	return socks, nil
}

func (g *giver) Transfer(ctx context.Context, send func([]handover.Socket) error) error {
	return g.p.Transfer(ctx, send)
}

func (g *giver) Freeze(ctx context.Context) (json.RawMessage, error) { return g.p.Freeze(ctx) }
func (g *giver) Thaw()                                               { g.p.Thaw() }

func (g *giver) Release(successor int) {
	g.ready.set(false)
	_ = g.p.Release(context.Background())
	g.stopHTTP() // our copies: the successor serves on its own
	if g.keeper != nil {
		// Our end is no crash now: the keeper lets the sockets go and
		// ends with us.
		if err := g.keeper.Released(); err != nil {
			g.log.WithError(err).Warn("Cannot tell the keeper that a successor took over")
		}
	}
	g.log.WithField("successor", successor).Info("Serving nothing more: open connections go on until they end; stop with SIGTERM")
}

// serveHandovers tells the predecessor once this daemon serves, then
// hands over to the next successor that asks, until ctx ends.
func serveHandovers(
	ctx context.Context,
	path string,
	profile handover.Profile,
	pred *predecessor,
	p *proxy.Proxier,
	g *giver,
	log logrus.FieldLogger,
) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		select {
		case <-p.Serving():
		case <-ctx.Done():
			pred.close()
			return
		}
		if g.keeper != nil {
			if err := g.keeper.Serving(); err != nil {
				log.WithError(err).Warn("Cannot tell the keeper that this daemon serves")
			}
		}
		var taking sync.WaitGroup
		defer taking.Wait()
		if pred != nil {
			if err := pred.Serving(ctx); err != nil {
				log.WithError(err).Warn("The predecessor did not confirm the handover; it was stopped meanwhile, or stops serving by itself")
				p.FlowsTransferred()
				pred.close()
			} else {
				log.WithField("predecessor", pred.PID).Info("Took over: the predecessor serves nothing more")
				taking.Go(func() {
					defer pred.close()
					takeTransfer(ctx, pred, p, log)
				})
			}
		}
		g.ready.set(true)
		if path == "" {
			return
		}
		ln, err := handover.Listen(path)
		if err != nil {
			log.WithError(err).Warn("No handover socket: a successor will start on its own")
			return
		}
		// From here a daemon started with the same socket takes over (or
		// is refused); before, it finds none and starts on its own.
		log.WithField("socket", path).Info("Serving the handover socket")
		<-handover.Serve(ctx, ln, g, profile, log)
	}()
	return done
}

// dupListener duplicates a TCP listener's descriptor without making it
// blocking (net.TCPListener.File would, and the socket is shared).
func dupListener(ln net.Listener) (*os.File, error) {
	tl, ok := ln.(*net.TCPListener)
	if !ok {
		return nil, errors.New("not a TCP listener")
	}
	return kernel.Dup(tl, tl.Addr().String())
}

// readyFile is --ready-file: present while this daemon serves (its first
// sync done, a predecessor's handover finished), for an exec readiness
// probe; the HTTP health port is shared by both daemons of a handover and
// cannot tell them apart.
type readyFile struct {
	path string
	log  logrus.FieldLogger
}

func (r readyFile) set(ready bool) {
	if r.path == "" {
		return
	}
	var err error
	if ready {
		err = os.WriteFile(r.path, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644)
	} else if err = os.Remove(r.path); errors.Is(err, os.ErrNotExist) {
		err = nil
	}
	if err != nil {
		r.log.WithError(err).WithField("path", r.path).Warn("Cannot update the ready file")
	}
}
