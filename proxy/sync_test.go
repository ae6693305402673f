package proxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/ports"
)

func TestUpdateDeleteUpdate(t *testing.T) {
	h := startProxier(t, Config{})
	a := tcpBackend(t, "a")
	h.apply(svc("svc", config.TCP, a))
	addr1 := h.addr("svc")

	// An established connection survives its service's removal.
	c, err := net.Dial("tcp", addr1)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	if line, _ := r.ReadString('\n'); line != "a\n" {
		t.Fatalf("got %q", line)
	}
	h.apply()
	if h.port("svc") != 0 {
		t.Fatal("listener still reported after removal")
	}
	if _, err := net.DialTimeout("tcp", addr1, time.Second); err == nil {
		t.Fatal("removed service's listener still accepts")
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "still here\n")
	if line, err := r.ReadString('\n'); err != nil || line != "still here\n" {
		t.Fatalf("established connection broke with its service: %q %v", line, err)
	}

	h.apply(svc("svc", config.TCP, a))
	if got := fetchName(t, h.addr("svc")); got != "a" {
		t.Fatalf("re-added service reached %q", got)
	}
}

// probeRules records, when each Sync runs, whether the probed addresses
// accept a connection: it sees the listeners exactly as the kernel rules
// change.
type probeRules struct {
	mu      sync.Mutex
	probe   []string
	accepts map[string]bool // as of the last Sync
}

func (r *probeRules) Sync(_ context.Context, _ []config.Frontend, _ bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.accepts = map[string]bool{}
	for _, a := range r.probe {
		c, err := net.DialTimeout("tcp", a, time.Second)
		if err == nil {
			c.Close()
		}
		r.accepts[a] = err == nil
	}
	return nil
}

func (r *probeRules) set(probe ...string) {
	r.mu.Lock()
	r.probe, r.accepts = probe, nil
	r.mu.Unlock()
}

func (r *probeRules) accepted(a string) (accepts, synced bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	accepts, synced = r.accepts[a]
	return accepts, synced
}

// A removed Service is refused before its rules go (the rule transaction
// takes tens of ms at 10k service ports); a replaced one keeps serving until
// the rules point at its successor.
func TestRemovedListenerStopsBeforeRulesReplacedOneAfter(t *testing.T) {
	rules := &probeRules{}
	h := startProxier(t, Config{Rules: rules})
	a := tcpBackend(t, "a")
	h.apply(svc("gone", config.TCP, a), svc("moved", config.TCP, a))
	gone, moved := h.addr("gone"), h.addr("moved")

	rules.set(gone, moved)
	next := svc("moved", config.TCP, a)
	next.Port = 8080
	h.apply(next)
	accepts, synced := rules.accepted(gone)
	if !synced {
		t.Fatal("rules were not synced")
	}
	if accepts {
		t.Fatal("the removed Service's listener still accepted while its rules were being removed")
	}
	if accepts, _ := rules.accepted(moved); !accepts {
		t.Fatal("the replaced listener was closed before the rules pointed at its successor")
	}
	if _, err := net.DialTimeout("tcp", moved, time.Second); err == nil {
		t.Fatal("the replaced listener still accepts after the sync")
	}
}

func TestEndpointChangeKeepsListenerPortChangeReplacesIt(t *testing.T) {
	h := startProxier(t, Config{})
	a, b := tcpBackend(t, "a"), tcpBackend(t, "b")
	h.apply(svc("svc", config.TCP, a))
	port := h.port("svc")
	h.apply(svc("svc", config.TCP, b))
	if h.port("svc") != port {
		t.Fatal("an endpoint change replaced the listener")
	}
	if got := fetchName(t, h.addr("svc")); got != "b" {
		t.Fatalf("after the endpoint change: reached %q", got)
	}
	moved := svc("svc", config.TCP, b)
	moved.Port = 8080
	h.apply(moved)
	if p := h.port("svc"); p == port || p == 0 {
		t.Fatalf("a port change kept listener %d (now %d)", port, p)
	}
	if got := fetchName(t, h.addr("svc")); got != "b" {
		t.Fatalf("after the port change: reached %q", got)
	}
	udp := svc("svc", config.UDP, b)
	h.apply(udp)
	if fe := h.p.Frontends(); len(fe) != 1 || fe[0].Protocol != config.UDP {
		t.Fatalf("protocol change: frontends %+v", fe)
	}
}

func TestPortRangeReleasedAndReused(t *testing.T) {
	base := freePorts(t, 1)
	h := startProxier(t, Config{PortRange: config.PortRange{Base: int(base), Size: 1}})
	a := tcpBackend(t, "a")
	h.apply(svc("one", config.TCP, a))
	if h.port("one") != int(base) {
		t.Fatalf("listener on %d, want %d from the range", h.port("one"), base)
	}
	// The range is full: a second service cannot be served...
	h.apply(svc("one", config.TCP, a), svc("two", config.TCP, a))
	for _, fe := range h.p.Frontends() {
		if fe.Service.Name.Name == "two" && !errors.Is(fe.Err, ports.ErrExhausted) {
			t.Fatalf("service two: err %v, want ports.ErrExhausted", fe.Err)
		}
	}
	// ...until the first one goes and gives its port back.
	h.apply(svc("two", config.TCP, a))
	waitFor(t, "port reuse", func() bool {
		h.p.Update(&config.State{Ports: map[config.ServicePortName]*config.ServicePort{{Namespace: "ns", Name: "two"}: svc("two", config.TCP, a)}})
		return h.port("two") == int(base)
	})
}

// failingRules fails every Sync while fail is set.
type failingRules struct{ fail atomic.Bool }

func (r *failingRules) Sync(context.Context, []config.Frontend, bool) error {
	if r.fail.Load() {
		return errors.New("injected rule failure")
	}
	return nil
}

// A closed listener's port is not handed to another Service while the rules
// may still send the old Service's traffic there: not before a rule sync
// succeeded without it.
func TestPortHeldUntilRulesSyncedWithoutIt(t *testing.T) {
	base := freePorts(t, 1)
	rules := &failingRules{}
	h := startProxier(t, Config{PortRange: config.PortRange{Base: int(base), Size: 1}, Rules: rules})
	a := tcpBackend(t, "a")
	h.apply(svc("one", config.TCP, a))
	if h.port("one") != int(base) {
		t.Fatalf("listener on %d, want %d", h.port("one"), base)
	}
	rules.fail.Store(true)
	// One's rules could not be removed, in this sync nor in the next.
	for range 2 {
		h.apply(svc("two", config.TCP, a))
		for _, fe := range h.p.Frontends() {
			if fe.Service.Name.Name == "two" && !errors.Is(fe.Err, ports.ErrExhausted) {
				t.Fatalf("service two got a port (err %v) while the rules may still point one's traffic at it", fe.Err)
			}
		}
	}
	if _, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", base), time.Second); err == nil {
		t.Fatal("the removed Service's listener still accepts")
	}
	rules.fail.Store(false)
	waitFor(t, "the port after a successful rule sync", func() bool {
		h.p.Update(&config.State{Ports: map[config.ServicePortName]*config.ServicePort{{Namespace: "ns", Name: "two"}: svc("two", config.TCP, a)}})
		return h.port("two") == int(base)
	})
}

func TestNodePortListenerHoldsThePort(t *testing.T) {
	h := startProxier(t, Config{})
	a := tcpBackend(t, "a")
	free := closedPort(t).Port()
	sp := svc("np", config.TCP, a)
	sp.NodePort = int(free)
	h.apply(sp)
	if h.port("np") != int(free) {
		t.Fatalf("listener on %d, want the NodePort %d", h.port("np"), free)
	}
	if _, err := net.Listen("tcp4", fmt.Sprintf("127.0.0.1:%d", free)); err == nil {
		t.Fatal("another process could take the NodePort")
	}
	if got := fetchName(t, h.addr("np")); got != "a" {
		t.Fatalf("reached %q", got)
	}

	// A NodePort someone else holds: the service is served on another port
	// and the NodePort error is reported for it alone.
	other, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	taken := svc("taken", config.TCP, a)
	taken.NodePort = other.Addr().(*net.TCPAddr).Port
	h.apply(sp, taken)
	fe, ok := h.p.Lookup(taken.Name, 4, config.KindAll)
	if !ok || fe.NodePortErr == nil || int(fe.Listen.Port()) == taken.NodePort {
		t.Fatalf("frontend %+v: want a NodePort error and another port", fe)
	}
	if got := fetchName(t, h.addr("taken")); got != "a" {
		t.Fatalf("reached %q", got)
	}
	if fe, _ := h.p.Lookup(sp.Name, 4, config.KindAll); fe.NodePortErr != nil {
		t.Fatalf("the other service got an error: %v", fe.NodePortErr)
	}

	// Changing the Service port keeps the NodePort: the listener is
	// replaced on the same port.
	moved := svc("np", config.TCP, a)
	moved.NodePort, moved.Port = int(free), 8080
	h.apply(moved, taken)
	if h.port("np") != int(free) {
		t.Fatalf("after a port change the listener is on %d, want %d", h.port("np"), free)
	}
	if got := fetchName(t, h.addr("np")); got != "a" {
		t.Fatalf("reached %q", got)
	}
}

func TestRestrictedNodePortIsHeldNotServed(t *testing.T) {
	h := startProxier(t, Config{NodePortsRestricted: true})
	free := closedPort(t).Port()
	sp := svc("np", config.TCP, tcpBackend(t, "a"))
	sp.NodePort = int(free)
	h.apply(sp)
	if p := h.port("np"); p == int(free) || p == 0 {
		t.Fatalf("listener on %d; with restricted NodePorts it must not sit on the NodePort", p)
	}
	if _, err := net.Listen("tcp4", fmt.Sprintf("127.0.0.1:%d", free)); err == nil {
		t.Fatal("another process could take the held NodePort")
	}
	if c, err := net.DialTimeout("tcp4", fmt.Sprintf("127.0.0.1:%d", free), time.Second); err == nil {
		c.Close()
		t.Fatal("the held NodePort accepted a connection directly")
	}
	h.apply()
	waitFor(t, "NodePort released", func() bool {
		ln, err := net.Listen("tcp4", fmt.Sprintf("127.0.0.1:%d", free))
		if err == nil {
			ln.Close()
		}
		return err == nil
	})
}

// A bulk sync (≥ bulkSync frontends opened or closed) collects its garbage
// once its rules are written, so that the next small change does not share
// the CPU with that collection; a small sync does not.
func TestBulkSyncCollectsGarbage(t *testing.T) {
	h := startProxier(t, Config{})
	collections := func() int { return len(h.logs.Find("Collected a bulk sync's garbage")) }
	many := make([]*config.ServicePort, bulkSync)
	for i := range many {
		many[i] = svc(fmt.Sprintf("s%d", i), config.TCP)
	}
	h.apply(many...)
	waitFor(t, "the bulk sync's collection, once its rules are written", func() bool { return collections() == 1 })
	// Two small syncs: the first one's write is over once the second's is
	// made (the sync goroutine takes each write's outcome in turn).
	h.apply(append(many, svc("one-more", config.TCP))...)
	h.apply(append(many, svc("one-more", config.TCP), svc("and-another", config.TCP))...)
	if n := collections(); n != 1 {
		t.Fatalf("%d collections after a bulk sync and a small one, want 1", n)
	}
}

// A listener that cannot be opened (here: a one-port range, two Services)
// is the daemon's ill health, shown by Health, and retried until it opens:
// the second Service is served soon after the first goes, with no change
// to it.
func TestFailedListenerRetriedAndUnhealthy(t *testing.T) {
	p := freePorts(t, 1)
	h := startProxier(t, Config{PortRange: config.PortRange{Base: p, Size: 1}})
	a, b := svc("a", config.TCP, tcpBackend(t, "a")), svc("b", config.TCP, tcpBackend(t, "b"))
	st := &config.State{Ports: map[config.ServicePortName]*config.ServicePort{a.Name: a, b.Name: b}, Node: "node-a"}
	h.p.Update(st)
	waitFor(t, "one listener failing", func() bool { return h.p.Health().ListenFailures == 1 })
	failed := b
	if h.port("a") == 0 {
		failed = a
	}
	// The served one goes: the failed one gets the port at a retry.
	h.p.Update(&config.State{Ports: map[config.ServicePortName]*config.ServicePort{failed.Name: failed}, Node: "node-a"})
	waitFor(t, "the failed listener opened by a retry", func() bool { return h.port(failed.Name.Name) == p })
	waitFor(t, "healthy again", func() bool { return h.p.Health().ListenFailures == 0 })
	if got := fetchName(t, h.addr(failed.Name.Name)); got != failed.Name.Name {
		t.Fatalf("reached %q", got)
	}
}

// Two Services claim one NodePort: the older keeps it, whatever their names
// and whichever the source lists first; the other is told.
func TestDuplicateNodePortGoesToTheOldest(t *testing.T) {
	for _, olderName := range []string{"a", "z"} {
		t.Run("older "+olderName, func(t *testing.T) {
			np := int(closedPort(t).Port())
			h := startProxier(t, Config{})
			older, newer := svc(olderName, config.TCP, tcpBackend(t, "older")), svc("m", config.TCP, tcpBackend(t, "newer"))
			for i, sp := range []*config.ServicePort{older, newer} {
				sp.NodePort = np
				sp.Created = time.Unix(1_700_000_000+int64(i)*3600, 0)
			}
			h.apply(newer, older)
			for _, fe := range h.p.Frontends() {
				isOlder := fe.Service.Name == older.Name
				if isOlder != fe.OnNodePort() || isOlder == (fe.NodePortErr != nil) {
					t.Fatalf("%s: on NodePort %v, error %v; want only the older on it", fe.Service.Name, fe.OnNodePort(), fe.NodePortErr)
				}
			}
		})
	}
}

// gatedRules holds every Sync until the test lets it through: a rule write
// that takes as long as the test wants.
type gatedRules struct {
	gate     chan struct{} // a held Sync returns after taking one value
	free     chan struct{} // closed: no Sync is held
	freeOnce sync.Once
	mu       sync.Mutex
	calls    int
}

func newGatedRules() *gatedRules {
	return &gatedRules{gate: make(chan struct{}), free: make(chan struct{})}
}

func (r *gatedRules) Sync(ctx context.Context, _ []config.Frontend, _ bool) error {
	r.mu.Lock()
	r.calls++
	r.mu.Unlock()
	select {
	case <-r.gate:
	case <-r.free:
	case <-ctx.Done():
		return ctx.Err()
	}
	return nil
}

func (r *gatedRules) open() { r.freeOnce.Do(func() { close(r.free) }) }

func (r *gatedRules) started() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls
}

// While a rule write is in flight (a new Service's: tens of ms at 10k
// service ports), the syncs that follow go on: an endpoint change reaches
// its balancer at once, a removed Service is refused at once, and the port
// of a closed listener stays taken until a write made after its closing
// succeeded — not merely the one in flight.
func TestSyncsGoOnWhileRulesAreWritten(t *testing.T) {
	base := freePorts(t, 2)
	rules := newGatedRules()
	h := startProxier(t, Config{PortRange: config.PortRange{Base: base, Size: 2}, Rules: rules})
	t.Cleanup(rules.open) // before the proxier stops (cleanups run last first): its last write is gated too
	a, b := tcpBackend(t, "a"), tcpBackend(t, "b")
	state := func(ports ...*config.ServicePort) *config.State {
		st := &config.State{Ports: map[config.ServicePortName]*config.ServicePort{}, Node: "node-a"}
		for _, sp := range ports {
			st.Ports[sp.Name] = sp
		}
		return st
	}
	h.p.Update(state(svc("one", config.TCP, a)))
	waitFor(t, "the first write", func() bool { return rules.started() == 1 })
	rules.gate <- struct{}{}
	waitFor(t, "the first write done", func() bool { return h.p.Health().LastUpdated != time.Time{} })
	one := h.addr("one")

	// A new Service: its write is held.
	h.p.Update(state(svc("one", config.TCP, a), svc("two", config.TCP, a)))
	waitFor(t, "the second write", func() bool { return rules.started() == 2 })
	// One's endpoints change while it is held.
	h.p.Update(state(svc("one", config.TCP, b), svc("two", config.TCP, a)))
	waitFor(t, "the endpoint change served during the write", func() bool { return fetchName(t, one) == "b" })
	if fetchName(t, h.addr("two")) != "a" {
		t.Fatal("the new Service is not served while its rules are written")
	}
	if rules.started() != 2 {
		t.Fatalf("%d writes started while one was in flight", rules.started())
	}
	// One goes while the write is still held: refused at once.
	h.p.Update(state(svc("two", config.TCP, a)))
	waitFor(t, "the removed Service refused during the write", func() bool {
		c, err := net.DialTimeout("tcp", one, time.Second)
		if err == nil {
			c.Close()
		}
		return err != nil
	})
	// The held write completes; it was made before one closed, so one's
	// port stays taken: a third Service finds the range full.
	rules.gate <- struct{}{}
	waitFor(t, "the merged write", func() bool { return rules.started() == 3 })
	h.p.Update(state(svc("two", config.TCP, a), svc("three", config.TCP, a)))
	waitFor(t, "three tried", func() bool {
		for _, fe := range h.p.Frontends() {
			if fe.Service.Name.Name == "three" {
				return true
			}
		}
		return false
	})
	for _, fe := range h.p.Frontends() {
		if fe.Service.Name.Name == "three" && !errors.Is(fe.Err, ports.ErrExhausted) {
			t.Fatalf("three got a port (err %v) before a write without one was done", fe.Err)
		}
	}
	// Once the write without one is done, three gets its port (the
	// proxier retries listeners it could not open).
	rules.open()
	waitFor(t, "three served after the write without one", func() bool {
		return h.port("three") != 0 && fetchName(t, h.addr("three")) == "a"
	})
}

// heldRules holds every write of frontends until its context ends (a
// write of none goes through). Then the write fails with the context's
// error or, with finish, reports done: an iptables-restore that
// completes as the daemon is told to stop.
type heldRules struct {
	calls  atomic.Int32
	finish bool
}

func (r *heldRules) Sync(ctx context.Context, frontends []config.Frontend, _ bool) error {
	if len(frontends) == 0 {
		return nil
	}
	r.calls.Add(1)
	<-ctx.Done()
	if r.finish {
		return nil
	}
	return ctx.Err()
}

// Stopping while a rule write is held: the write is given the cancelled
// context, and Run returns within a bound with the listeners closed.
func TestStopWhileRulesAreWritten(t *testing.T) {
	rules := &heldRules{}
	log := logrus.New()
	log.SetOutput(io.Discard)
	p := New(Config{BindAddress: loopback, MinSyncPeriod: time.Millisecond, Rules: rules, Log: log})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx, 0); close(done) }()
	a := tcpBackend(t, "a")
	p.Update(&config.State{Ports: map[config.ServicePortName]*config.ServicePort{{Namespace: "ns", Name: "one"}: svc("one", config.TCP, a)}, Node: "node-a"})
	waitFor(t, "the write", func() bool { return rules.calls.Load() == 1 })
	addr := fmt.Sprintf("127.0.0.1:%d", p.ListenPort(config.ServicePortName{Namespace: "ns", Name: "one"}, 4, config.KindAll))
	if got := fetchName(t, addr); got != "a" {
		t.Fatalf("served %q while the write was held", got)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return within 10 s of its context ending while a rule write was held")
	}
	if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		c.Close()
		t.Fatal("the listener still accepts after Run returned")
	}
}

// A write that completes as the stop comes counts as any other: the
// rules point at this daemon, so Serving is closed and the stop says that
// the node refuses until the next start (a race seen on a loaded machine,
// where the first write ended just after SIGTERM).
func TestWriteDoneAsTheStopComesServed(t *testing.T) {
	rules := &heldRules{finish: true}
	h := startProxier(t, Config{Rules: rules})
	a := tcpBackend(t, "a")
	h.p.Update(&config.State{Ports: map[config.ServicePortName]*config.ServicePort{{Namespace: "ns", Name: "one"}: svc("one", config.TCP, a)}, Node: "node-a"})
	waitFor(t, "the write", func() bool { return rules.calls.Load() == 1 })
	select {
	case <-h.p.Serving():
		t.Fatal("serving before the write was done")
	default:
	}
	h.stop()
	select {
	case <-h.p.Serving():
	default:
		t.Fatal("Serving still open after a write that succeeded as the stop came")
	}
	if len(h.logs.Find("Stopped serving: the rules stay, so this node refuses every new connection to its Services "+
		"until a daemon starts again (kube-userspace-proxy --cleanup removes them)")) != 1 {
		t.Fatalf("the stop does not say the node refuses until the next start; logs:\n%s", strings.Join(h.logs.Entries(), "\n"))
	}
}

// TestQuietWhileNothingIsSynced: Quiet is false while a rule write is under
// way and for the given time after, true once that time has passed.
func TestQuietWhileNothingIsSynced(t *testing.T) {
	base := freePorts(t, 2)
	rules := newGatedRules()
	h := startProxier(t, Config{PortRange: config.PortRange{Base: base, Size: 2}, Rules: rules})
	t.Cleanup(rules.open)
	if !h.p.Quiet(0) {
		t.Fatal("a proxier that has synced nothing is not quiet")
	}
	a := tcpBackend(t, "a")
	one := svc("one", config.TCP, a)
	h.p.Update(&config.State{Ports: map[config.ServicePortName]*config.ServicePort{one.Name: one}, Node: "node-a"})
	waitFor(t, "the write", func() bool { return rules.started() == 1 })
	if h.p.Quiet(0) {
		t.Fatal("quiet while a rule write is under way")
	}
	rules.gate <- struct{}{}
	waitFor(t, "the write done", func() bool { return h.p.Health().LastUpdated != time.Time{} })
	if h.p.Quiet(time.Hour) {
		t.Fatal("quiet for an hour right after a write")
	}
	waitFor(t, "quiet for 50 ms", func() bool { return h.p.Quiet(50 * time.Millisecond) })
}

// TestHealthQueuedUntilRulesAreWritten: a change counts as queued for
// /healthz until its rules are written, not only until a sync took it: a
// rule write that hangs makes the daemon unhealthy after 2 × --sync-period.
func TestHealthQueuedUntilRulesAreWritten(t *testing.T) {
	base := freePorts(t, 2)
	rules := newGatedRules()
	h := startProxier(t, Config{PortRange: config.PortRange{Base: base, Size: 2}, Rules: rules})
	t.Cleanup(rules.open)
	a := tcpBackend(t, "a")
	one := svc("one", config.TCP, a)
	before := time.Now()
	h.p.Update(&config.State{Ports: map[config.ServicePortName]*config.ServicePort{one.Name: one}, Node: "node-a"})
	waitFor(t, "the write", func() bool { return rules.started() == 1 })
	// The sync is done and the listener serves; the rules are not written.
	waitFor(t, "the listener", func() bool { return len(h.p.Frontends()) == 1 })
	health := h.p.Health()
	if health.QueuedAt.IsZero() || health.QueuedAt.Before(before) || !health.LastUpdated.IsZero() {
		t.Fatalf("while the write hangs: QueuedAt %v, LastUpdated %v; want the change's arrival and no update", health.QueuedAt, health.LastUpdated)
	}
	rules.gate <- struct{}{}
	waitFor(t, "the write done", func() bool { return !h.p.Health().LastUpdated.IsZero() })
	waitFor(t, "nothing queued", func() bool { return h.p.Health().QueuedAt.IsZero() })
}

// verifyRules records whether each Sync was asked to verify.
type verifyRules struct {
	mu       sync.Mutex
	verifies []bool
}

func (r *verifyRules) Sync(_ context.Context, _ []config.Frontend, verify bool) error {
	r.mu.Lock()
	r.verifies = append(r.verifies, verify)
	r.mu.Unlock()
	return nil
}

func (r *verifyRules) last() (n int, verify bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.verifies) == 0 {
		return 0, false
	}
	return len(r.verifies), r.verifies[len(r.verifies)-1]
}

// A handover that breaks off after the freeze (the successor gone before
// it served, maybe after writing its own rules) leaves this daemon
// rewriting its rules at once, verified against the kernel's, not at the
// next sync period (an hour here).
func TestThawVerifiesTheRules(t *testing.T) {
	rules := &verifyRules{}
	h := startProxier(t, Config{Rules: rules, SyncPeriod: time.Hour})
	h.apply(svc("web", config.TCP, tcpBackend(t, "a")))
	before, _ := rules.last()
	if _, err := h.p.Freeze(context.Background()); err != nil {
		t.Fatal(err)
	}
	h.p.Thaw()
	waitFor(t, "a verifying rule write after the thaw", func() bool {
		n, verify := rules.last()
		return n > before && verify
	})
}
