package handover

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

// What a worker keeps, the keeper holds (a name kept again replaces, a name
// dropped goes), and lends to the next worker through the exchange: the
// very sockets, which accept what waited in their backlog while nobody
// served. A worker that was handed over lets every socket go.
func TestKeeperKeepsAndLends(t *testing.T) {
	kc, wf, err := WorkerSocket()
	if err != nil {
		t.Fatal(err)
	}
	defer kc.Close()
	k := NewKeeper()
	defer k.Close()
	saidc := make(chan WorkerSaid, 1)
	go func() { saidc <- k.Receive(kc) }()
	wc, err := net.FileConn(wf)
	wf.Close()
	if err != nil {
		t.Fatal(err)
	}
	link := &KeeperLink{c: wc.(*net.UnixConn)}

	var lns []*net.TCPListener
	var socks []Socket
	for i := range 3 {
		ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			t.Fatal(err)
		}
		lns = append(lns, ln)
		socks = append(socks, Socket{Name: "ln" + string(rune('0'+i)), Proto: "tcp", Addr: ln.Addr().String(), Open: ln.File})
	}
	if err := link.Keep(socks); err != nil {
		t.Fatal(err)
	}
	if err := link.Keep(socks[:1]); err != nil { // again: replaces
		t.Fatal(err)
	}
	if err := link.Drop([]string{"ln2"}); err != nil {
		t.Fatal(err)
	}
	if err := link.Serving(); err != nil {
		t.Fatal(err)
	}
	// Pick states: given, changed, one gone (null).
	if err := link.Picks(map[string]json.RawMessage{"a": json.RawMessage(`{"n":1}`), "b": json.RawMessage(`{"n":2}`)}); err != nil {
		t.Fatal(err)
	}
	if err := link.Picks(map[string]json.RawMessage{"a": json.RawMessage(`{"n":3}`), "b": json.RawMessage("null")}); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, "two sockets held", 5*time.Second, 5*time.Millisecond, func() bool { return k.Held() == 2 })

	// The worker dies: its listeners close, a client connects meanwhile.
	link.Close()
	if said := <-saidc; !said.Serving || said.Released {
		t.Fatalf("the worker said %+v, want serving", said)
	}
	for _, ln := range lns {
		ln.Close()
	}
	waiting, err := net.Dial("tcp", socks[0].Addr)
	if err != nil {
		t.Fatalf("a connection to a kept listener with its worker gone: %v", err)
	}
	defer waiting.Close()

	// The next worker takes them back.
	path := filepath.Join(t.TempDir(), "keeper.sock")
	ln, err := Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	log := logrus.New()
	log.SetOutput(&testutil.Buffer{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := Serve(ctx, ln, k, nil, log)
	p, err := Take(ctx, path, Profile{"node": "any"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if len(p.Sockets) != 2 {
		t.Fatalf("took %d sockets, want 2", len(p.Sockets))
	}
	var got *net.TCPListener
	for _, s := range p.Sockets {
		if s.Name == "ln0" {
			l, err := net.FileListener(s.File)
			if err != nil {
				t.Fatal(err)
			}
			got = l.(*net.TCPListener)
		}
		s.File.Close()
	}
	defer got.Close()
	_ = got.SetDeadline(time.Now().Add(5 * time.Second))
	if c, err := got.Accept(); err != nil {
		t.Fatalf("the connection that waited: %v", err)
	} else {
		c.Close()
	}
	if state, err := p.Freeze(ctx); err != nil || string(state) != `{"a":{"n":3}}` {
		t.Fatalf("the keeper's pick state: %s %v, want the last given", state, err)
	}
	if err := p.Serving(ctx); err != nil {
		t.Fatal(err)
	}
	if err := p.Transfer(ctx, func([]Socket) { t.Error("a keeper handed a connection over") }); err != nil {
		t.Fatal(err)
	}
	<-done
	if k.Held() != 2 {
		t.Fatalf("the keeper holds %d sockets after lending, want 2 (kept for the next crash)", k.Held())
	}

	// A worker handed over to a successor: the keeper lets go.
	kc2, wf2, err := WorkerSocket()
	if err != nil {
		t.Fatal(err)
	}
	go func() { saidc <- k.Receive(kc2) }()
	wc2, _ := net.FileConn(wf2)
	wf2.Close()
	link2 := &KeeperLink{c: wc2.(*net.UnixConn)}
	if err := link2.Released(); err != nil {
		t.Fatal(err)
	}
	link2.Close()
	if said := <-saidc; !said.Released {
		t.Fatalf("the worker said %+v, want handed over", said)
	}
	kc2.Close()
	if k.Held() != 0 {
		t.Fatalf("the keeper holds %d sockets after a handover, want none", k.Held())
	}
	_ = os.Remove(path)
}
