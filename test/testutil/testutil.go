// Package testutil holds what the tests of several packages share: waiting
// for a condition with a deadline (never a fixed sleep), a buffer a child
// process may write while the test reads it, a logrus hook that keeps the
// entries a test asserts on, and the rule for tests that need root.
package testutil

import (
	"bytes"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
)

// RequireRoot skips a test that needs root (why says for what), or fails it
// when CI demands that root tests run (KUP_REQUIRE_ROOT_TESTS, set by .ci/run).
func RequireRoot(t testing.TB, why string) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv("KUP_REQUIRE_ROOT_TESTS") != "" {
		t.Fatalf("this test needs root (%s) and KUP_REQUIRE_ROOT_TESTS is set", why)
	}
	t.Skipf("needs root: %s", why)
}

// WaitFor polls cond every poll until it holds, or fails the test once
// timeout has passed, naming what it waited for.
func WaitFor(t testing.TB, what string, timeout, poll time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(poll)
	}
}

// WaitStalled polls a counter every poll until it is positive and the same
// at two polls in a row (bytes stopped moving: a peer stopped reading), or
// fails the test once timeout has passed.
func WaitStalled(t testing.TB, what string, timeout, poll time.Duration, counter func() int64) {
	t.Helper()
	last := int64(-1)
	WaitFor(t, what, timeout, poll, func() bool {
		v := counter()
		stalled := v > 0 && v == last
		last = v
		return stalled
	})
}

// Buffer is a bytes.Buffer safe to read while another goroutine (a child
// process's output copier) writes it.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *Buffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *Buffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// LogHook collects every logrus entry of the logger it is added to.
type LogHook struct {
	mu  sync.Mutex
	all []*logrus.Entry
}

func (h *LogHook) Levels() []logrus.Level { return logrus.AllLevels }

func (h *LogHook) Fire(e *logrus.Entry) error {
	h.mu.Lock()
	h.all = append(h.all, e)
	h.mu.Unlock()
	return nil
}

// Entries returns every entry as "message error", for substring checks.
func (h *LogHook) Entries() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []string
	for _, e := range h.all {
		s := e.Message
		if err, ok := e.Data[logrus.ErrorKey].(error); ok {
			s += " " + err.Error()
		}
		out = append(out, s)
	}
	return out
}

// Find returns the fields of every entry with message msg, oldest first.
func (h *LogHook) Find(msg string) []logrus.Fields {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []logrus.Fields
	for _, e := range h.all {
		if e.Message == msg {
			out = append(out, e.Data)
		}
	}
	return out
}
