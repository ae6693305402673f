package proxy

import (
	"net"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
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
