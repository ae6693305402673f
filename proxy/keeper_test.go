package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/internal/sock"
)

// fakeKeeper records what it is told, the descriptors it is lent opened
// (and closed) as a keeper's link would.
type fakeKeeper struct {
	mu     sync.Mutex
	kept   map[string]string // name → the socket's address
	events []string
}

func (k *fakeKeeper) Keep(socks []handover.Socket) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, s := range socks {
		f, err := s.Open()
		if err != nil {
			continue
		}
		f.Close()
		k.kept[s.Name] = s.Addr
		k.events = append(k.events, "keep "+s.Name)
	}
	return nil
}

func (k *fakeKeeper) Drop(names []string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, n := range names {
		delete(k.kept, n)
		k.events = append(k.events, "drop "+n)
	}
	return nil
}

func (k *fakeKeeper) names() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var out []string
	for n := range k.kept {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// The keeper is told of every listening socket a sync opens (TCP and UDP)
// before the sync's rules are written, of none twice while it stays, and
// of each one closed: a Service gone, a port refusing for want of
// endpoints.
func TestKeeperToldOfOpenedAndClosedSockets(t *testing.T) {
	k := &fakeKeeper{kept: map[string]string{}}
	h := startProxier(t, Config{Keeper: k})
	a := tcpBackend(t, "a")
	u := udpBackend(t, "u")
	h.apply(svc("web", config.TCP, a), svc("dns", config.UDP, u), svc("other", config.TCP, a))
	waitFor(t, "three sockets kept", func() bool { return len(k.names()) == 3 })
	for _, n := range k.names() {
		if !strings.HasPrefix(n, "frontend ") || !strings.HasSuffix(n, " range") {
			t.Fatalf("kept %q, want a frontend's socket name", n)
		}
	}
	kept := k.kept[k.names()[0]]
	if _, err := net.ResolveTCPAddr("tcp", kept); err != nil {
		t.Fatalf("kept address %q: %v", kept, err)
	}

	// Unchanged sockets are not sent again; a Service gone is dropped;
	// one without endpoints refuses, and holds no socket to keep.
	before := len(k.events)
	h.apply(svc("web", config.TCP, a), svc("dns", config.UDP, u), svc("other", config.TCP))
	waitFor(t, "the refusing Service's socket dropped", func() bool { return len(k.names()) == 2 })
	h.apply(svc("web", config.TCP, a))
	waitFor(t, "the removed Service's socket dropped", func() bool { return len(k.names()) == 1 })
	k.mu.Lock()
	events := slices.Clone(k.events[before:])
	k.mu.Unlock()
	for _, e := range events {
		if strings.HasPrefix(e, "keep ") {
			t.Errorf("a socket kept again without a change: %s (events %v)", e, events)
		}
	}
	if len(events) != 2 {
		t.Errorf("events after the first sync: %v, want the two drops", events)
	}
}

// A listener inherited with connections already waiting in its backlog
// (a keeper's after a crash, where clients went on connecting while no
// process served) is not served before its frontend's balancer holds the
// endpoints: a connection accepted earlier would be reset as having none.
// Opened, the frontend leaves them waiting; once it serves the Service,
// each is answered.
func TestAdoptedListenerServesWhatWaited(t *testing.T) {
	a := tcpBackend(t, "a")
	ln, err := sock.ListenTCP(netip.MustParseAddrPort("127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	var waiting []net.Conn
	for range 5 {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		waiting = append(waiting, c)
	}
	f, err := ln.File()
	if err != nil {
		t.Fatal(err)
	}
	ln.Close() // the socket lives on in f alone, as in a keeper
	sp := svc("web", config.TCP, a)
	key := dataplane.Key{Name: sp.Name, Kind: config.KindAll, Family: 4}
	h := startProxier(t, Config{}, func(p *Proxier) {
		p.Inherit([]handover.Socket{{Name: dataplane.RangeSocket(key).Name(), Proto: "tcp", Addr: ln.Addr().String(), File: f}},
			func() (json.RawMessage, error) { return nil, nil })
	})
	var fe *dataplane.Frontend
	if err := h.p.call(context.Background(), func() (err error) { fe, err = h.p.dp.Open(key, sp); return err }); err != nil {
		t.Fatal(err)
	}
	if fe.Listen() != ln.Addr() {
		t.Fatalf("opened on %s, want the inherited %s", fe.Listen(), ln.Addr())
	}
	// Opened, not serving: a connection that waited is neither answered
	// nor reset.
	_ = waiting[0].SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, err := waiting[0].Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a connection that waited, before its frontend served: %d bytes, %v; want it still waiting", n, err)
	}
	if err := h.p.call(context.Background(), func() error { return fe.ServeAs(sp, dataplane.Serve{Endpoints: []netip.AddrPort{a}}) }); err != nil {
		t.Fatal(err)
	}
	for i, c := range waiting {
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil || strings.TrimSpace(line) != "a" {
			t.Fatalf("connection %d that waited: %q %v", i, line, err)
		}
	}
	_ = h.p.call(context.Background(), func() error { fe.Stop(); return nil })
}

// holdingKeeper keeps the duplicates it is lent open until told to drop
// them, and closes them a moment after, as a keeper process reading its
// link would: a socket it holds stays listening after the worker closes
// its own descriptor.
type holdingKeeper struct {
	mu    sync.Mutex
	files map[string]*os.File
	wg    sync.WaitGroup
}

func (k *holdingKeeper) Keep(socks []handover.Socket) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, s := range socks {
		f, err := s.Open()
		if err != nil {
			return err
		}
		if old := k.files[s.Name]; old != nil {
			old.Close()
		}
		k.files[s.Name] = f
	}
	return nil
}

func (k *holdingKeeper) Drop(names []string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	var closing []*os.File
	for _, n := range names {
		if f := k.files[n]; f != nil {
			closing = append(closing, f)
			delete(k.files, n)
		}
	}
	k.wg.Add(1)
	go func() { // another process: its close comes after the message
		defer k.wg.Done()
		time.Sleep(20 * time.Millisecond)
		for _, f := range closing {
			f.Close()
		}
	}()
	return nil
}

func (k *holdingKeeper) count() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.files)
}

// A port whose endpoints all leave refuses on the port it had, and serves
// there again when one comes back, while a keeper holds a duplicate of its
// listener: the keeper lets go first (found by make differential: the
// refusing socket's bind found the port in use, the frontend was given up,
// and its addresses went unredirected until a retry on another port).
func TestKeeperLetsGoOfAPortThatTurnsToRefuse(t *testing.T) {
	k := &holdingKeeper{files: map[string]*os.File{}}
	t.Cleanup(func() {
		k.wg.Wait()
		for _, f := range k.files {
			f.Close()
		}
	})
	h := startProxier(t, Config{Keeper: k})
	a := tcpBackend(t, "a")
	u := udpBackend(t, "a")
	h.apply(svc("web", config.TCP, a), svc("dns", config.UDP, u))
	waitFor(t, "both listeners kept", func() bool { return k.count() == 2 })
	webPort, dnsPort := h.port("web"), h.port("dns")

	h.apply(svc("web", config.TCP), svc("dns", config.UDP))
	for _, f := range h.p.Frontends() {
		if f.Err != nil {
			t.Fatalf("a frontend failed turning to refuse: %v", f.Err)
		}
	}
	if h.port("web") != webPort || h.port("dns") != dnsPort {
		t.Fatalf("ports moved: web %d→%d, dns %d→%d", webPort, h.port("web"), dnsPort, h.port("dns"))
	}
	expectRefused(t, h.addr("web"))
	c := dialUDP(t, h.addr("dns"))
	expectUDPRefused(t, c)

	h.apply(svc("web", config.TCP, a), svc("dns", config.UDP, u))
	if h.port("web") != webPort || h.port("dns") != dnsPort {
		t.Fatalf("ports moved on serving again: web %d→%d, dns %d→%d", webPort, h.port("web"), dnsPort, h.port("dns"))
	}
	if got := fetchName(t, h.addr("web")); got != "a" {
		t.Fatalf("reached %q, want a", got)
	}
	if reply := udpExchange(t, c, []byte("q")); string(reply) != "a:q" {
		t.Fatalf("after the endpoint came back: %q", reply)
	}
	waitFor(t, "both listeners kept again", func() bool { return k.count() == 2 })
}

// Both traffic policies flipped at once keep the Service's listener: its
// kind stays, so it takes the new endpoints in place, no connection is
// refused while a successor would open, and the keeper hears of nothing
// but the short-circuit's new listener (found by make differential: the
// listener was replaced, and with a keeper holding it the successor could
// not bind its port).
func TestPolicyFlipKeepsTheListener(t *testing.T) {
	k := &fakeKeeper{kept: map[string]string{}}
	h := startProxier(t, Config{Keeper: k})
	here, there := tcpBackend(t, "here"), tcpBackend(t, "there")
	web := func(local bool) *config.ServicePort {
		sp := svc("web", config.TCP)
		sp.ExternalIPs = []netip.Addr{netip.MustParseAddr("203.0.113.5")}
		sp.InternalLocal, sp.ExternalLocal = local, local
		sp.Endpoints = []config.Endpoint{
			{Addr: here, Ready: true, Serving: true, NodeName: "node-a"},
			{Addr: there, Ready: true, Serving: true, NodeName: "node-b"},
		}
		return sp
	}
	h.apply(web(false))
	waitFor(t, "the listener kept", func() bool { return len(k.names()) == 1 })
	port := h.port("web")
	h.apply(web(true))
	if h.port("web") != port {
		t.Fatalf("the listener moved from %d to %d", port, h.port("web"))
	}
	for i := 0; i < 4; i++ {
		if got := fetchName(t, h.addr("web")); got != "here" {
			t.Fatalf("after the flip to Local: reached %q, want here", got)
		}
	}
	waitFor(t, "the short-circuit's listener kept beside it", func() bool { return len(k.names()) == 2 })
	h.apply(web(false))
	if h.port("web") != port {
		t.Fatalf("the listener moved from %d to %d", port, h.port("web"))
	}
	seen := map[string]bool{}
	for i := 0; i < 8; i++ {
		seen[fetchName(t, h.addr("web"))] = true
	}
	if !seen["here"] || !seen["there"] {
		t.Fatalf("after the flip back: reached %v, want both", seen)
	}
	waitFor(t, "the short-circuit's listener dropped", func() bool { return len(k.names()) == 1 })
}
