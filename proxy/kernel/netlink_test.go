package kernel

import (
	"bytes"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

// What the encoder nests, the decoder finds by its path, whatever the
// padding and flags; a malformed attribute ends the walk instead of
// reading past it.
func TestAttrCodec(t *testing.T) {
	b := NewMessage(1, 0, 9, 9, 9, 9)
	if len(b) != unix.SizeofNlMsghdr+4 {
		t.Fatalf("header and fixed part: %d bytes", len(b))
	}
	attrs := len(b)
	b = AppendAttr(b, 1, []byte{7}) // padded to 4
	b = AppendNested(b, 2, func(b []byte) []byte {
		b = AppendAttr(b, 1, []byte("abcde"))
		return AppendNested(b, 3, func(b []byte) []byte { return AppendAttr(b, 4, []byte{1, 2}) })
	})
	b = AppendAttr(b, 5, nil)
	body := b[attrs:]
	for _, tc := range []struct {
		path []uint16
		want []byte
	}{
		{[]uint16{1}, []byte{7}},
		{[]uint16{2, 1}, []byte("abcde")},
		{[]uint16{2, 3, 4}, []byte{1, 2}},
		{[]uint16{5}, []byte{}},
		{[]uint16{2, 9}, nil},
		{[]uint16{6}, nil},
		{[]uint16{1, 1}, nil}, // 7 is not a nest of attributes
	} {
		if got := Attr(body, tc.path...); !bytes.Equal(got, tc.want) || (got == nil) != (tc.want == nil) {
			t.Errorf("Attr(%v) = %v, want %v", tc.path, got, tc.want)
		}
	}
	var types []uint16
	EachAttr(body, func(typ uint16, _ []byte) bool { types = append(types, typ); return true })
	if !slices.Equal(types, []uint16{1, 2, 5}) {
		t.Errorf("EachAttr saw %v, want [1 2 5] (the nested flag cleared)", types)
	}
	for _, bad := range [][]byte{{3, 0, 1, 0}, {200, 0, 1, 0, 0, 0, 0, 0}, {8, 0}} {
		if got := Attr(bad, 1); got != nil {
			t.Errorf("malformed %v: Attr returned %v", bad, got)
		}
	}
}

// The main table's routes and the links, read in a network namespace of
// the test's own with a veth link and a bridge.
func TestRoutesAndLinksInNamespace(t *testing.T) {
	testutil.RequireRoot(t, "it creates a network namespace")
	name := fmt.Sprintf("kupkr%d", os.Getpid())
	ip := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	ip("netns", "add", name)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	for _, args := range [][]string{
		{"link", "add", "dummy0", "type", "veth", "peer", "name", "dummy1"},
		{"addr", "add", "10.77.0.1/24", "dev", "dummy0"},
		{"link", "set", "dummy0", "up"},
		{"route", "add", "10.88.0.0/16", "dev", "dummy0"},
		{"route", "add", "10.99.0.0/16", "dev", "dummy0", "table", "7"}, // not the main table
		{"link", "add", "br0", "type", "bridge"},
		{"addr", "add", "10.66.0.1/24", "dev", "br0"},
		{"link", "set", "br0", "up"},
	} {
		ip(append([]string{"-n", name}, args...)...)
	}
	var routes []Route
	var links []Link
	err := inNetns(name, func() (err error) {
		if routes, err = MainRoutes(); err != nil {
			return err
		}
		links, err = Links()
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []Route{
		{netip.MustParsePrefix("10.66.0.0/24"), "br0"},
		{netip.MustParsePrefix("10.77.0.0/24"), "dummy0"},
		{netip.MustParsePrefix("10.88.0.0/16"), "dummy0"},
	}
	for _, w := range want {
		if !slices.Contains(routes, w) {
			t.Errorf("route %v missing from %v", w, routes)
		}
	}
	for i := 1; i < len(routes); i++ {
		if routes[i].Dst.Bits() > routes[i-1].Dst.Bits() {
			t.Errorf("routes not longest prefix first: %v", routes)
		}
	}
	if slices.ContainsFunc(routes, func(r Route) bool { return r.Dst == netip.MustParsePrefix("10.99.0.0/16") }) {
		t.Errorf("a route of table 7 read as the main table's: %v", routes)
	}
	byName := map[string]Link{}
	for _, l := range links {
		byName[l.Name] = l
	}
	if l := byName["dummy0"]; l.Bridge || !slices.Contains(l.Prefixes, netip.MustParsePrefix("10.77.0.0/24")) {
		t.Errorf("dummy0: %+v", l)
	}
	if l := byName["br0"]; !l.Bridge || !slices.Contains(l.Prefixes, netip.MustParsePrefix("10.66.0.0/24")) {
		t.Errorf("br0: %+v", l)
	}
}

// inNetns runs fn on a thread in the named network namespace. The thread
// stays locked to its goroutine and ends with it, never going back to the
// pool in the wrong namespace.
func inNetns(name string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		f, err := os.Open("/run/netns/" + name)
		if err != nil {
			errc <- err
			return
		}
		defer f.Close()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("setns: %w", err)
			return
		}
		errc <- fn()
	}()
	return <-errc
}
