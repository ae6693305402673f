package ports

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

var loopback = netip.MustParseAddr("127.0.0.1")

// testSocket is a socket bound through Take, as the proxy binds its
// listeners.
type testSocket struct {
	port  int
	close func()
}

// listen binds a TCP listener or UDP socket on loopback with a port a
// gives key.
func listen(a *Allocator, proto config.Protocol, key string) (testSocket, func(), error) {
	var sk testSocket
	release, err := a.Take(SpaceOf(proto, loopback), key, func(port int) error {
		addr := netip.AddrPortFrom(loopback, uint16(port))
		if proto == config.UDP {
			c, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(addr))
			if err != nil {
				return err
			}
			sk = testSocket{port: c.LocalAddr().(*net.UDPAddr).Port, close: func() { c.Close() }}
			return nil
		}
		ln, err := net.ListenTCP("tcp4", net.TCPAddrFromAddrPort(addr))
		if err != nil {
			return err
		}
		sk = testSocket{port: ln.Addr().(*net.TCPAddr).Port, close: func() { ln.Close() }}
		return nil
	})
	return sk, release, err
}

// sysctlDir is a copy of the two port settings under a directory of its own.
func sysctlDir(t *testing.T, portRange, reserved string) kernel.Sysctls {
	t.Helper()
	s := kernel.Sysctls{Root: t.TempDir()}
	if err := os.MkdirAll(filepath.Dir(s.Path(localPortRange)), 0o755); err != nil {
		t.Fatal(err)
	}
	if portRange != "" {
		os.WriteFile(s.Path(localPortRange), []byte(portRange), 0o644)
	}
	if reserved != "" {
		os.WriteFile(s.Path(localReservedPort), []byte(reserved), 0o644)
	}
	return s
}

// With no --proxy-port-range the allocator picks from the kernel's local
// port range itself, skipping the reserved ports, as the kernel would.
func TestKernelRangeAllocation(t *testing.T) {
	base := int(testutil.ClosedPort(t).Port()) &^ 63
	if base < 1024 {
		base = 40000
	}
	// 64 ports, of which all but base+5 … base+8 are reserved.
	sysctls := sysctlDir(t, strconv.Itoa(base)+"\t"+strconv.Itoa(base+63)+"\n",
		strconv.Itoa(base)+"-"+strconv.Itoa(base+4)+","+strconv.Itoa(base+9)+"-"+strconv.Itoa(base+63)+"\n")
	a := NewIn(config.PortRange{}, sysctls, nil)
	seen := map[int]bool{}
	for i := 0; i < 4; i++ {
		ln, release, err := listen(a, config.TCP, "")
		if err != nil {
			// Another process may hold one of the four ports.
			t.Logf("listener %d: %v", i, err)
			continue
		}
		defer func() { ln.close(); release() }()
		if ln.port < base+5 || ln.port > base+8 || seen[ln.port] {
			t.Fatalf("port %d: want one of %d-%d, each once (got %v before)", ln.port, base+5, base+8, seen)
		}
		seen[ln.port] = true
	}
	if len(seen) == 0 {
		t.Fatal("no listener opened")
	}
	if _, _, err := listen(a, config.TCP, ""); err == nil {
		t.Fatal("a fifth listener opened: reserved ports were used")
	}
}

// When the kernel's range cannot be read, the kernel chooses (port 0).
func TestKernelRangeUnreadable(t *testing.T) {
	var warned []error
	a := NewIn(config.PortRange{}, sysctlDir(t, "", ""), func(err error) { warned = append(warned, err) })
	for i := 0; i < 2; i++ {
		ln, release, err := listen(a, config.TCP, "")
		if err != nil {
			t.Fatal(err)
		}
		defer release()
		defer ln.close()
		if ln.port == 0 {
			t.Fatal("no port")
		}
	}
	if len(warned) != 1 {
		t.Fatalf("warned %v, want the read error once", warned)
	}
}

func TestLoadKernelRangeRejectsGarbage(t *testing.T) {
	sysctls := sysctlDir(t, "", "")
	for _, bad := range []string{"", "32768", "x y", "60999 32768"} {
		os.WriteFile(sysctls.Path(localPortRange), []byte(bad), 0o644)
		if _, _, err := kernelRange(sysctls); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

// The proxy port range is merged into the kernel's reserved list and taken
// out again; the list keeps the kernel's "a-b,c" form and other entries.
func TestReservePorts(t *testing.T) {
	sysctls := sysctlDir(t, "", "1000-1005,2000\n")
	file := sysctls.Path(localReservedPort)
	read := func() string { b, _ := os.ReadFile(file); return string(b) }

	if changed, err := editReserved(sysctls, config.PortRange{Base: 1003, Size: 8}, true); err != nil || !changed {
		t.Fatalf("reserve: changed %v, %v", changed, err)
	}
	if got := read(); got != "1000-1010,2000" {
		t.Fatalf("after reserving 1003-1010: %q", got)
	}
	if changed, err := editReserved(sysctls, config.PortRange{Base: 1003, Size: 8}, true); err != nil || changed {
		t.Fatalf("reserving again: changed %v, %v", changed, err)
	}
	if changed, err := editReserved(sysctls, config.PortRange{Base: 1003, Size: 8}, false); err != nil || !changed {
		t.Fatalf("unreserve: changed %v, %v", changed, err)
	}
	if got := read(); got != "1000-1002,2000" {
		t.Fatalf("after unreserving 1003-1010: %q", got)
	}
	os.WriteFile(file, []byte("not-a-range\n"), 0o644)
	if _, err := editReserved(sysctls, config.PortRange{Base: 1003, Size: 8}, true); err == nil {
		t.Fatal("a garbled list was overwritten")
	}
}

// TCP and UDP are separate port spaces: a one-port range serves one TCP and
// one UDP listener, and a second TCP listener finds the range exhausted.
func TestPortRangePerProtocol(t *testing.T) {
	p := int(testutil.ClosedPort(t).Port())
	a := New(config.PortRange{Base: p, Size: 1}, nil)
	tl, trel, err := listen(a, config.TCP, "")
	if err != nil {
		t.Skipf("port %d taken meanwhile: %v", p, err)
	}
	defer func() { tl.close(); trel() }()
	ul, urel, err := listen(a, config.UDP, "")
	if err != nil {
		t.Fatalf("UDP listener on the range's only port: %v", err)
	}
	defer func() { ul.close(); urel() }()
	if tl.port != p || ul.port != p {
		t.Fatalf("ports %d/%d, want %d for both", tl.port, ul.port, p)
	}
	if _, _, err := listen(a, config.TCP, ""); !errors.Is(err, ErrExhausted) {
		t.Fatalf("second TCP listener: %v, want ErrExhausted", err)
	}
}

// A listener gets the same port after it is closed and opened again (a
// restart, a Service removed and re-added) while the port is free, and
// another listener whose preferred port is taken gets another one.
func TestPreferredPortIsStable(t *testing.T) {
	base := int(testutil.ClosedPort(t).Port()) &^ 1023
	if base < 1024 || base+1024 > 65535 {
		base = 40000
	}
	a := New(config.PortRange{Base: base, Size: 1024}, nil)
	open := func(key string) (int, func()) {
		t.Helper()
		ln, release, err := listen(a, config.UDP, key)
		if err != nil {
			t.Fatal(err)
		}
		return ln.port, func() { ln.close(); release() }
	}
	first, closeFirst := open("ns/dns/all/4")
	if want := Preferred(a.Range(), "ns/dns/all/4"); first != want {
		t.Skipf("preferred port %d taken by another process (got %d)", want, first)
	}
	closeFirst()
	again, closeAgain := open("ns/dns/all/4")
	defer closeAgain()
	if again != first {
		t.Fatalf("reopened on %d, first on %d", again, first)
	}
	// Another key that prefers the same port (forced) falls back.
	other, closeOther := open("ns/dns/all/4")
	defer closeOther()
	if other == again {
		t.Fatalf("two listeners on port %d", other)
	}
}

// Keys opened in the same order get the same ports, collisions included:
// a restart that opens its Services sorted finds its old ports (and the
// rules that point at them). A collision takes the next free port.
func TestPortsRepeatAcrossRestarts(t *testing.T) {
	base := int(testutil.ClosedPort(t).Port()) &^ 63
	if base < 1024 || base+64 > 65535 {
		base = 40000
	}
	r := config.PortRange{Base: base, Size: 64}
	keys := make([]string, 40) // 40 keys in 64 ports: collisions for sure
	for i := range keys {
		keys[i] = "ns/svc-" + strconv.Itoa(i) + "/all/4"
	}
	run := func() []int {
		a := New(r, nil)
		var ports []int
		var closers []func()
		for _, k := range keys {
			ln, release, err := listen(a, config.TCP, k)
			if err != nil {
				t.Fatal(err)
			}
			closers = append(closers, func() { ln.close(); release() })
			ports = append(ports, ln.port)
		}
		for _, c := range closers {
			c()
		}
		return ports
	}
	first, second := run(), run()
	collided := 0
	for i := range keys {
		if first[i] != second[i] {
			t.Errorf("%s: port %d, then %d after a restart", keys[i], first[i], second[i])
		}
		if pref := Preferred(r, keys[i]); first[i] != pref {
			collided++
			// The next free one after its preferred port, wrapping.
			for p := pref; p != first[i]; p = r.Base + (p-r.Base+1)%r.Size {
				if !slices.Contains(first[:i], p) && !heldElsewhere(p) {
					t.Errorf("%s: port %d, but %d (after its preferred %d) was free", keys[i], first[i], p, pref)
					break
				}
			}
		}
	}
	if collided == 0 {
		t.Error("no key collided; the test proves nothing about collisions")
	}
}

// heldElsewhere says whether another process holds TCP port p on loopback.
func heldElsewhere(p int) bool {
	ln, err := net.ListenTCP("tcp4", net.TCPAddrFromAddrPort(netip.AddrPortFrom(loopback, uint16(p))))
	if err != nil {
		return true
	}
	ln.Close()
	return false
}
