package handover

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

// testProfile is the fake giver's profile, and its true successors'.
var testProfile = Profile{"node": "node-1", "rules": "managed"}

// fakeGiver lends real listening sockets and records the steps.
type fakeGiver struct {
	mu      sync.Mutex
	lns     []*net.TCPListener
	steps   []string
	release chan int
	log     testutil.Buffer // what Serve logged
}

func (g *fakeGiver) step(s string) {
	g.mu.Lock()
	g.steps = append(g.steps, s)
	g.mu.Unlock()
}

func (g *fakeGiver) Steps() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return strings.Join(g.steps, " ")
}

func (g *fakeGiver) Lend(ctx context.Context) ([]Socket, error) {
	g.step("lend")
	var socks []Socket
	for i, ln := range g.lns {
		socks = append(socks, Socket{Name: "ln" + string(rune('0'+i%10)), Proto: "tcp", Addr: ln.Addr().String(), Open: ln.File})
	}
	return socks, nil
}

func (g *fakeGiver) Freeze(ctx context.Context) (json.RawMessage, error) {
	g.step("freeze")
	return bigState, nil
}

// bigState is a state of many messages (10 000 service ports' pick state
// is megabytes).
var bigState = json.RawMessage(`{"picks":"` + strings.Repeat("x", 1<<20) + `"}`)

func (g *fakeGiver) Transfer(ctx context.Context, send func([]Socket) error) error {
	g.step("transfer")
	return nil
}
func (g *fakeGiver) Thaw()           { g.step("thaw") }
func (g *fakeGiver) Release(pid int) { g.step("release"); g.release <- pid }

func newGiver(t *testing.T, n int) (*fakeGiver, string, <-chan struct{}) {
	t.Helper()
	g := &fakeGiver{release: make(chan int, 1)}
	for range n {
		ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		g.lns = append(g.lns, ln)
	}
	path := filepath.Join(t.TempDir(), "run", "handover.sock")
	ln, err := Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	log := logrus.New()
	log.SetOutput(&g.log)
	done := Serve(ctx, ln, g, testProfile, log)
	t.Cleanup(func() { cancel(); <-done })
	return g, path, done
}

// The whole exchange with more sockets than one message carries: every
// socket arrives, is the same socket (a connection to the giver's
// listener is accepted on the taker's copy), and the giver is released.
func TestExchange(t *testing.T) {
	g, path, done := newGiver(t, 450)
	ctx := context.Background()
	p, err := Take(ctx, path, testProfile)
	if err != nil || p == nil {
		t.Fatalf("Take: %v %v", p, err)
	}
	defer p.Close()
	if len(p.Sockets) != 450 || p.PID != os.Getpid() {
		t.Fatalf("got %d sockets from pid %d, want 450 from %d", len(p.Sockets), p.PID, os.Getpid())
	}
	s := p.Sockets[449]
	if s.Addr != g.lns[449].Addr().String() {
		t.Fatalf("socket 449 is %s, want %s", s.Addr, g.lns[449].Addr())
	}
	ln, err := net.FileListener(s.File)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	g.lns[449].Close() // the giver's copy gone: the socket is the taker's alone
	c, err := net.Dial("tcp", s.Addr)
	if err != nil {
		t.Fatalf("dial the handed-over listener: %v", err)
	}
	c.Close()
	_ = ln.(*net.TCPListener).SetDeadline(time.Now().Add(5 * time.Second))
	if a, err := ln.Accept(); err != nil {
		t.Fatalf("accept on the handed-over listener: %v", err)
	} else {
		a.Close()
	}
	if state, err := p.Freeze(ctx); err != nil {
		t.Fatal(err)
	} else if string(state) != string(bigState) {
		t.Errorf("the giver's state arrived as %d bytes, want %d", len(state), len(bigState))
	}
	if err := p.Serving(ctx); err != nil {
		t.Fatal(err)
	}
	if pid := <-g.release; pid != os.Getpid() {
		t.Errorf("released to pid %d, want %d", pid, os.Getpid())
	}
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Serve did not return after the handover")
	}
	if got := g.Steps(); got != "lend freeze release transfer" {
		t.Errorf("steps %q", got)
	}
}

// A successor that goes away (as killed with -9: the kernel closes its
// end) after taking the sockets, or after freezing, leaves the giver
// serving: thawed, never released, and ready for the next successor.
func TestSuccessorGoneHalfWay(t *testing.T) {
	g, path, _ := newGiver(t, 3)
	ctx := context.Background()
	p, err := Take(ctx, path, testProfile)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range p.Sockets {
		s.File.Close()
	}
	p.Close() // gone before freezing
	p, err = Take(ctx, path, testProfile)
	if err != nil {
		t.Fatalf("the next successor: %v", err)
	}
	if _, err := p.Freeze(ctx); err != nil {
		t.Fatal(err)
	}
	p.Close() // gone after freezing, before serving
	waitSteps(t, g, "lend lend freeze thaw")
	p, err = Take(ctx, path, testProfile)
	if err != nil {
		t.Fatalf("the third successor: %v", err)
	}
	defer p.Close()
	if _, err := p.Freeze(ctx); err != nil {
		t.Fatal(err)
	}
	if err := p.Serving(ctx); err != nil {
		t.Fatal(err)
	}
	waitSteps(t, g, "lend lend freeze thaw lend freeze release transfer")
}

// A giver gone half-way fails Take (a plain start follows), and with
// nobody on the path Take says there is no predecessor.
func TestGiverGone(t *testing.T) {
	path := filepath.Join(t.TempDir(), "handover.sock")
	if p, err := Take(context.Background(), path, testProfile); p != nil || err != nil {
		t.Fatalf("no socket: %v %v, want nil nil", p, err)
	}
	ln, err := Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		c, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		_, _, _ = receive(c)
		_ = send(c, message{Type: msgOffer, Version: Version, Count: 5}, nil)
		c.Close() // killed before the sockets
	}()
	if p, err := Take(context.Background(), path, testProfile); err == nil || p != nil {
		t.Fatalf("a giver gone half-way: %v %v, want an error", p, err)
	}
	ln.Close()
	if p, err := Take(context.Background(), path, testProfile); p != nil || err != nil {
		t.Fatalf("nobody listening: %v %v, want nil nil", p, err)
	}
}

// A successor of another version is refused, with the reason.
func TestVersionRefused(t *testing.T) {
	g, path, _ := newGiver(t, 1)
	c, err := net.Dial("unixpacket", path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	uc := c.(*net.UnixConn)
	if err := send(uc, message{Type: msgHello, Versions: []int{Version + 1}}, nil); err != nil {
		t.Fatal(err)
	}
	m, _, err := receive(uc)
	if err != nil || m.Type != msgRefuse || !strings.Contains(m.Reason, "version") {
		t.Fatalf("got %+v %v, want a refusal naming the version", m, err)
	}
	if got := g.Steps(); got != "" {
		t.Errorf("the giver did %q for a refused successor", got)
	}
}

// The socket and its folder are root-only: another user cannot even
// connect, and one that could (the folder opened up by mistake) is
// refused by its credentials before anything is lent.
func TestOtherUserRefused(t *testing.T) {
	testutil.RequireRoot(t, "it runs a peer as another user")
	g, path, _ := newGiver(t, 1)
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v %v, want 0600", fi.Mode(), err)
	}
	di, err := os.Stat(filepath.Dir(path))
	if err != nil || di.Mode().Perm() != 0o700 {
		t.Fatalf("folder mode %v %v, want 0700", di.Mode(), err)
	}
	asNobody := func() (string, error) {
		cmd := exec.Command(os.Args[0], "-test.run=TestHelperPeer$")
		cmd.Env = append(os.Environ(), "HANDOVER_HELPER="+path)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	// The test binary must be reachable by nobody: its folder usually is
	// not (go test's temporary folder is 0700), so the peer runs a copy.
	exe := filepath.Join(os.TempDir(), "handover-peer-"+strings.ReplaceAll(t.Name(), "/", "-"))
	if b, err := os.ReadFile(os.Args[0]); err != nil {
		t.Fatal(err)
	} else if err := os.WriteFile(exe, b, 0o755); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(exe)
	self := os.Args[0]
	defer func() { os.Args[0] = self }()
	os.Args[0] = exe
	out, _ := asNobody()
	if !strings.Contains(out, "permission denied") {
		t.Fatalf("nobody connecting to the root-only socket: %q, want permission denied", out)
	}
	// Opened up: the credentials check refuses.
	for d := filepath.Dir(path); d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(path, 0o666); err != nil {
		t.Fatal(err)
	}
	out, _ = asNobody()
	if !strings.Contains(out, "refused") || !strings.Contains(out, "not root") {
		t.Fatalf("nobody with access to the socket: %q, want a refusal", out)
	}
	if got := g.Steps(); got != "" {
		t.Errorf("the giver did %q for another user", got)
	}
}

// A daemon in another network namespace (two namespaces' daemons given one
// socket path, as lab daemons on one machine are) is refused: neither takes
// the other's listeners, whose addresses only mean something in their own
// namespace.
func TestOtherNetworkNamespaceRefused(t *testing.T) {
	testutil.RequireRoot(t, "it runs a peer in a network namespace of its own")
	g, path, _ := newGiver(t, 2)
	cmd := exec.Command(os.Args[0], "-test.run=TestHelperPeer$")
	cmd.Env = append(os.Environ(), "HANDOVER_HELPER="+path)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	out, err := cmd.CombinedOutput()
	if !strings.Contains(string(out), "another network namespace") {
		t.Fatalf("a peer in another network namespace: %q (%v), want a refusal naming the namespace", out, err)
	}
	if got := g.Steps(); got != "" {
		t.Errorf("the giver did %q for a peer of another namespace", got)
	}
	// The same peer in our namespace takes over: the refusal was the namespace's.
	p, err := Take(context.Background(), path, testProfile)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if len(p.Sockets) != 2 {
		t.Errorf("took %d sockets, want 2", len(p.Sockets))
	}
}

// TestHelperPeer is a peer run as another user or in another namespace.
func TestHelperPeer(t *testing.T) {
	path := os.Getenv("HANDOVER_HELPER")
	if path == "" {
		t.Skip("a helper of TestOtherUserRefused")
	}
	p, err := Take(context.Background(), path, testProfile)
	if p != nil {
		t.Fatalf("took %d sockets as uid %d", len(p.Sockets), os.Getuid())
	}
	t.Fatalf("Take: %v", err)
}

func waitSteps(t *testing.T, g *fakeGiver, want string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for g.Steps() != want {
		if time.Now().After(deadline) {
			t.Fatalf("steps %q, want %q", g.Steps(), want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Only a true successor takes over: one that would serve the node
// otherwise is refused before anything is lent, learns the running
// daemon's pid and every difference, and the running daemon logs who
// asked. A successor that says nothing of how it serves (an older
// version) is taken as a true one.
func TestOnlyATrueSuccessorTakesOver(t *testing.T) {
	g, path, _ := newGiver(t, 3)
	other := Profile{"node": "node-1", "rules": "not managed", "source": "manifests"}
	p, err := Take(context.Background(), path, other)
	var mismatch *MismatchError
	if p != nil || !errors.As(err, &mismatch) || !errors.Is(err, ErrRefused) {
		t.Fatalf("Take with another profile: %v %v, want a *MismatchError", p, err)
	}
	want := []string{`rules: the running daemon's "managed", this one's "not managed"`, `source: the running daemon's unsaid, this one's "manifests"`}
	if mismatch.PID != os.Getpid() || strings.Join(mismatch.Differences, "|") != strings.Join(want, "|") {
		t.Fatalf("refused by pid %d for %q, want pid %d for %q", mismatch.PID, mismatch.Differences, os.Getpid(), want)
	}
	if steps := g.Steps(); steps != "" {
		t.Fatalf("the running daemon did %q for a successor it refused, want nothing", steps)
	}
	testutil.WaitFor(t, "the refusal in the running daemon's log", 5*time.Second, 10*time.Millisecond, func() bool {
		out := g.log.String()
		return strings.Contains(out, "Handover refused: the successor would serve this node otherwise") &&
			strings.Contains(out, "pid "+strconv.Itoa(os.Getpid())) && strings.Contains(out, "rules: the running daemon")
	})

	// An older successor: no profile, taken as a true one.
	p, err = Take(context.Background(), path, nil)
	if err != nil || p == nil || len(p.Sockets) != 3 {
		t.Fatalf("Take without a profile: %v %v", p, err)
	}
	p.Close()
}
