package dataplane

// A Dataplane owns what every frontend's connections share:
//
//	alloc    the proxy ports of the listeners (package ports)
//	acc      the one accept loop of every TCP listener (sock.Acceptor)
//	workers  the goroutines that dial and copy upstream (workers.go)
//	copiers  the goroutines that copy downstream
//	parker   the epoll set where idle connections wait without a goroutine
//	conns    every live TCP connection (conns.go)
//	budget   the descriptor budget of connections, flows and listeners (budget.go)
//	source   whose address backends see, and the conntrack source NAT that
//	         shows them their clients (package clientaddr)
//
// A frontend borrows these and never reaches past them. Its goroutines
// start with Start and end with Stop, in the order that leaves no
// connection without a goroutine to finish it.

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/clientaddr"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/ports"
)

type Dataplane struct {
	cfg     *Config
	alloc   *ports.Allocator
	conns   connTable
	budget  *descriptorBudget
	workers workers
	copiers workers
	// parker holds the sockets of idle connections without a goroutine
	// (tcp.go); set by start, nil without it (copies then wait on their
	// sockets).
	parker atomic.Pointer[sock.Parker]
	// ctx ends when the daemon shuts down: dials and UDP read loops
	// stop with it. Set by start, before any frontend opens.
	ctx context.Context
	// source decides whose address each dial's backend sees, and holds
	// the source NAT that shows backends their clients (package
	// clientaddr); closed by the task start adds.
	source *clientaddr.Chooser
	// inherited are the sockets a predecessor lent (inherit.go);
	// nil without one. Set before start.
	inherited *inherited
	// transferSink takes the pairs stopped for a successor (transfer.go);
	// nil when no transfer is under way.
	transferSink atomic.Pointer[func(*detachedPair) bool]
	// udpGate holds the UDP read loops of a successor until the
	// predecessor's flows are in their tables (transfer_udp.go); nil without
	// a predecessor. Set before start, closed once by OpenUDPGate.
	udpGate chan struct{}
	openUDP sync.Once
	// connLogLimit bounds the connection log (connlog.go);
	// unredirectedTCP and unredirectedUDP the lines of GuardAtAccept's
	// resets and drops (tcp.go, udp.go), one of each every 10 s.
	connLogLimit, unredirectedTCP, unredirectedUDP *connLogLimit
	// conntrack answers the UDP guard (udp.go, Config.GuardAtAccept): nil
	// without the guard or without conntrack netlink.
	conntrack *kernel.Conntrack
	// letGo has the keeper close its duplicates of sockets whose ports
	// are bound anew (proxy's keeper.go); nil without a keeper. Set before Start.
	// letGoUntil is until when a bind that finds such a port in use tries
	// again (bindAnew). Both on the sync goroutine.
	letGo      func([]SocketKey)
	letGoUntil time.Time
	// noLocalPortWarned is when the last "no local port" warning was
	// logged (Unix ns): one a minute says it without flooding the log.
	noLocalPortWarned atomic.Int64

	mu  sync.Mutex     // guards acc and detachedFlows
	acc *sock.Acceptor // made for the first TCP listener, closed by closeListeners
	// detachedFlows are the UDP flows detached at a Release, until Transfer
	// sends them (transfer_udp.go).
	detachedFlows []detachedFlow

	tasks []*task // stopped by stop, last started first
}

// newDataplane makes the dataplane of cfg and opens its kernel interfaces
// (the source NAT, the UDP guard's conntrack netlink), said to cfg.Kernel;
// start takes them over and closes them at stop.
func New(cfg *Config) *Dataplane {
	d := &Dataplane{
		cfg: cfg,
		alloc: ports.New(cfg.PortRange, func(err error) {
			cfg.log().WithError(err).Warn("Cannot read the kernel's local port range; listeners take a port from bind(0), slow beyond ~7000 listeners")
		}),
		budget:  newDescriptorBudget(cfg.FileLimit),
		workers: workers{maxIdle: workerMaxIdle, maxParked: workerMaxParked},
		copiers: workers{maxIdle: workerMaxIdle, maxParked: workerMaxParked},
		ctx:     context.Background(),

		connLogLimit:    newConnLogLimit(cfg.ConnLogRate),
		unredirectedTCP: newConnLogLimit(0.1),
		unredirectedUDP: newConnLogLimit(0.1),
	}
	// Both users of conntrack netlink ask once whether it answers; where it
	// does not (no nf_conntrack_netlink: the socket may open and every
	// request fail) the start line says so, as conntrack-netlink
	// (ProbeConntrackNetlink, asked by cmd), not once per user.
	source := clientaddr.Options{Mode: cfg.BackendSource, LocalTraffic: cfg.LocalTraffic, Serves: cfg.serves, PortRange: cfg.PortRange,
		OpenNAT: true, Sockets: runtime.GOMAXPROCS(0), Kernel: cfg.Kernel, Log: cfg.log()}
	if cfg.GuardAtAccept || cfg.BackendSource != clientaddr.Node {
		if err := kernel.ProbeConntrack(); err != nil {
			cfg.log().WithError(err).Debug("No conntrack netlink: backends see the node's address, and UDP proxy ports are unguarded")
			source.OpenNAT = false
			d.source = clientaddr.New(source)
			return d
		}
	}
	d.source = clientaddr.New(source)
	for _, fam := range []int{4, 6} {
		if d.source.Available(fam) {
			clientAddressAvailable.WithLabelValues(familyName(fam)).Set(1)
		}
	}
	if cfg.GuardAtAccept {
		if ct, err := kernel.OpenConntrack(runtime.GOMAXPROCS(0)); err != nil {
			cfg.log().WithError(err).Warn("UDP proxy ports unguarded: the guard's conntrack netlink sockets could not be opened")
		} else {
			d.conntrack = ct
		}
	}
	return d
}

const (
	workerMaxIdle   = 10 * time.Second
	workerMaxParked = 1024
)

// ranOutOfLocalPorts logs, at most once a minute, that a dial to ep found
// no local port: the node's limit, which an operator lifts, not the
// endpoint's fault.
func (d *Dataplane) ranOutOfLocalPorts(log logrus.FieldLogger, ep netip.AddrPort) {
	now := time.Now().UnixNano()
	last := d.noLocalPortWarned.Load()
	if last != 0 && now-last < int64(time.Minute) || !d.noLocalPortWarned.CompareAndSwap(last, now) {
		return
	}
	log.WithField("endpoint", ep).Warn("No local port left for connections to the endpoint (the node's earlier connections to it wait out TIME_WAIT); " +
		"not the endpoint's fault, so it is not ejected. Set net.ipv4.tcp_tw_reuse=1 or widen net.ipv4.ip_local_port_range (docs/operations.md)")
}

// Start runs the dataplane's goroutines until Stop; ctx is the daemon's
// lifetime, which dials and read loops follow.
func (d *Dataplane) Start(ctx context.Context) {
	running.add(d)
	d.ctx = ctx
	// Stopped last: whatever the parker still holds at stop goes back to
	// the copiers, and the handlers of the last connections to the workers.
	d.tasks = append(d.tasks,
		startTask(func(ctx context.Context) { d.workers.Run(ctx.Done()) }),
		startTask(func(ctx context.Context) { d.copiers.Run(ctx.Done()) }))
	if d.cfg.parkIdleAfter() > 0 {
		if parker, err := sock.NewParker(); err != nil {
			d.cfg.log().WithError(err).Warn("Idle connections keep their goroutines: no epoll set for parking them")
		} else {
			d.parker.Store(parker)
			d.tasks = append(d.tasks, startTask(func(ctx context.Context) {
				parker.Run(ctx.Done())
				_ = parker.Close()
			}))
		}
	}
	d.tasks = append(d.tasks, startTask(func(ctx context.Context) {
		<-ctx.Done() // after the connections drained: no dial uses it
		d.source.Close()
	}))
	if ct := d.conntrack; ct != nil {
		d.tasks = append(d.tasks, startTask(func(ctx context.Context) {
			<-ctx.Done() // after the read loops stopped
			ct.Close()
		}))
	}
	if idle := d.cfg.TCPIdleTimeout; idle > 0 {
		d.tasks = append(d.tasks, startTask(func(ctx context.Context) { d.conns.sweepIdle(ctx, idle) }))
	}
}

// CloseListeners stops the accept loop; the frontends have closed their
// listeners already.
func (d *Dataplane) CloseListeners() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.acc != nil {
		d.acc.Close()
		d.acc = nil
	}
}

// Stop ends the dataplane's goroutines, last started first: for after the
// connections have drained (Drain).
func (d *Dataplane) Stop() {
	running.remove(d)
	for i := len(d.tasks) - 1; i >= 0; i-- {
		d.tasks[i].stop()
	}
	d.tasks = nil
}

// acceptor returns the accept loop of the TCP listeners, made at first use.
func (d *Dataplane) acceptor() (*sock.Acceptor, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.acc == nil {
		a, err := sock.NewAcceptor()
		if err != nil {
			return nil, err
		}
		d.acc = a
	}
	return d.acc, nil
}

// Open opens a listener for key, to serve sp once ServeAs says how. The port goes back to the
// allocator on every failure path.
func (d *Dataplane) Open(key Key, sp *config.ServicePort) (*Frontend, error) {
	bind := BindFor(d.cfg.BindAddress, key.Family)
	var ln listener
	var nodePortErr error
	release := func() {}
	var hold *sock.Hold
	if sp.NodePort != 0 && key.Kind.External() {
		var err error
		if d.cfg.NodePortsRestricted {
			hold, err = sock.HoldPort(sp.Protocol == config.UDP, netip.AddrPortFrom(bind, uint16(sp.NodePort)))
		} else if inh, ok := d.inherit(key, roleNodePort, sp.Protocol, bind); ok && inh.port == sp.NodePort {
			ln = inh
		} else {
			inh.close()
			// The listener itself sits on the NodePort: it holds the port
			// against other processes, costs no extra descriptor, and
			// serves even a connection that reaches it without a redirect.
			err = d.bindAnew(func() (err error) {
				ln, err = listenOn(sp.Protocol, netip.AddrPortFrom(bind, uint16(sp.NodePort)))
				return err
			})
		}
		if err != nil {
			// Logged by the caller: a retry that fails again stays quiet.
			nodePortErr = fmt.Errorf("NodePort %d/%s is already in use by another process on this node (%w); serving the other addresses only, retrying", sp.NodePort, sp.Protocol, err)
		}
	}
	onNodePort := ln.port != 0
	if inh, ok := d.inherit(key, roleRange, sp.Protocol, bind); ok && ln.port == 0 {
		ln, release = inh, d.alloc.Hold(ports.SpaceOf(sp.Protocol, bind), inh.port)
	} else {
		inh.close()
	}
	if ln.port == 0 {
		var err error
		release, err = d.alloc.Take(ports.SpaceOf(sp.Protocol, bind), key.String(), func(port int) (err error) {
			ln, err = listenOn(sp.Protocol, netip.AddrPortFrom(bind, uint16(port)))
			return err
		})
		if err != nil {
			if sock.IsFileLimit(err) {
				d.budget.ranOut()
			}
			hold.Close()
			return nil, err
		}
	}
	d.budget.listeners.Add(1)
	if hold != nil {
		d.budget.listeners.Add(1)
	}
	fe := &Frontend{
		dp: d, key: key, protocol: sp.Protocol, spec: sp, bal: balance.New(sp.Scheduler), m: newFEMetrics(key.Name.String(), sp.Protocol),
		listen:      netip.AddrPortFrom(bind, uint16(ln.port)),
		nodePortErr: nodePortErr,
		onNodePort:  onNodePort,
		hold:        hold,
		releasePort: release,
	}
	fe.opened = ln // served by its first serveAs
	fe.proxyProto.Store(sp.ProxyProtocol)
	return fe, nil
}

// inherit takes the socket a predecessor lent for key's role, if
// any (see inherited.take).
func (d *Dataplane) inherit(key Key, role string, proto config.Protocol, bind netip.Addr) (listener, bool) {
	if d.inherited == nil {
		return listener{}, false
	}
	return d.inherited.take(key, role, proto, bind)
}

// startServing has fe serve on ln: a TCP listener through the accept loop, a UDP
// socket with a read loop of its own.
func (d *Dataplane) startServing(fe *Frontend, ln listener) error {
	if ln.tcp != nil {
		fe.tcp = &tcpServer{ln: ln.tcp}
		if err := fe.serveTCP(ln.tcp); err != nil {
			ln.tcp.Close()
			return fmt.Errorf("serving %s: %w", fe.listen, err)
		}
		return nil
	}
	if fe.udp == nil {
		fe.udp = &udpServer{Frontend: fe, flows: udpFlows{budget: d.budget}}
		fe.udp.flows.server = fe.udp
	}
	fe.udp.open(&udpSocket{conn: ln.udp, family: fe.key.Family})
	return nil
}

// task is a goroutine with an owner, who stops it.
type task struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// startTask runs fn on a goroutine of its own until stop: not until the
// daemon's context ends, since the dataplane's goroutines must outlive the
// connections' drain.
func startTask(fn func(ctx context.Context)) *task {
	ctx, cancel := context.WithCancel(context.Background())
	t := &task{cancel: cancel, done: make(chan struct{})}
	go func() { defer close(t.done); fn(ctx) }()
	return t
}

// stop ends the task's context and waits for its goroutine.
func (t *task) stop() {
	t.cancel()
	<-t.done
}

// BindFor returns the address listeners of a family bind to, given
// --bind-address b.
func BindFor(b netip.Addr, family int) netip.Addr {
	if b.IsValid() && !b.IsUnspecified() && config.Family(b) == family {
		return b
	}
	if family == 6 {
		return netip.IPv6Unspecified()
	}
	return netip.IPv4Unspecified()
}

// bindAnew runs bind, and runs it again while it finds its port in use and
// the keeper was just asked to let go of sockets (letGo): the keeper's
// duplicate of the socket that had the port closes a moment later.
func (d *Dataplane) bindAnew(bind func() error) error {
	for {
		err := bind()
		if err == nil || !errors.Is(err, syscall.EADDRINUSE) || time.Now().After(d.letGoUntil) {
			return err
		}
		time.Sleep(2 * time.Millisecond) // the keeper's close, in another process: polled until letGoUntil
	}
}

// countSource counts whose address the backend of client's connection saw, and says at debug
// level why it was not the client's when it should have been.
func (fe *Frontend) countSource(client, ep netip.AddrPort, dialed sock.Dialed, wanted bool) {
	switch {
	case wanted && !dialed.Sees.IsValid():
		backendSources.WithLabelValues("fallback").Inc()
		err := dialed.SourceErr
		if err == nil {
			err = errors.New("the source NAT is not available for this client and endpoint (see the start log)")
		}
		fe.debug(logrus.Fields{"client": client, "endpoint": ep}, err, "Backend sees the node's address, not the client's")
	case dialed.Sees.IsValid():
		backendSources.WithLabelValues("client").Inc()
	default:
		backendSources.WithLabelValues("node").Inc()
	}
}

// Drain waits up to grace for the open connections to end, then ends the
// rest; for after CloseListeners.
func (d *Dataplane) Drain(grace time.Duration) { d.conns.drain(grace) }

// SetLetGo has letGo told of sockets whose ports are about to be bound
// anew, so that a keeper closes its duplicates first (proxy's keeper.go).
// Before Start.
func (d *Dataplane) SetLetGo(letGo func([]SocketKey)) { d.letGo = letGo }

// LetGo has the keeper (SetLetGo) close its duplicates of the sockets of
// fes, which are about to stop: their successors bind the same ports.
func (d *Dataplane) LetGo(fes []*Frontend) {
	if d.letGo == nil || len(fes) == 0 {
		return
	}
	keys := make([]SocketKey, len(fes))
	for i, fe := range fes {
		keys[i] = fe.SocketKey()
	}
	d.letGo(keys)
}

// LetGoUntil is until when a bind that finds its port in use tries again:
// the keeper was just asked to let go. On the sync goroutine.
func (d *Dataplane) LetGoUntil(t time.Time) { d.letGoUntil = t }

// OutOfFilesWithin says whether a system call failed for want of
// descriptors in the last d.
func (d *Dataplane) OutOfFilesWithin(window time.Duration) bool {
	return d.budget.exhaustedWithin(window)
}

// Source is whose address backends see (explain's question).
func (d *Dataplane) Source() *clientaddr.Chooser { return d.source }
