package dataplane

import (
	"testing"
	"time"
)

// Over its rate the connection log drops lines and counts them; the count
// comes with the next line that passes.
func TestConnLogRateLimit(t *testing.T) {
	c := newConnLogLimit(10) // burst 21
	passed := 0
	for i := 0; i < 1000; i++ {
		if ok, _ := c.pass(); ok {
			passed++
		}
	}
	if passed > 25 {
		t.Fatalf("%d of 1000 lines passed at 10/s, want about the burst of 21", passed)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		ok, dropped := c.pass()
		if ok {
			if dropped < int64(1000-passed) {
				t.Fatalf("the next line says %d dropped, want at least %d", dropped, 1000-passed)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no line passed after the rate refilled")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if ok, _ := newConnLogLimit(-1).pass(); !ok {
		t.Fatal("an unbounded log dropped a line")
	}
}
