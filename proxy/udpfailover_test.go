package proxy

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
)

// steadyClient sends a datagram every 100 ms from one socket (one fixed
// source port, as a DNS resolver, statsd or QUIC does) and records which
// backend answered each, until the test ends.
type steadyClient struct {
	mu      sync.Mutex
	answers []answer
}

type answer struct {
	at      time.Time
	backend string
}

func startSteadyClient(t *testing.T, addr string) *steadyClient {
	t.Helper()
	c := dialUDP(t, addr)
	sc := &steadyClient{}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // the reader: every answer, with the backend's name
		defer wg.Done()
		buf := make([]byte, 2048)
		for {
			n, err := c.Read(buf)
			if err != nil {
				select {
				case <-done:
					return
				default:
					continue // an ICMP error from a past datagram; go on reading
				}
			}
			name, _, _ := strings.Cut(string(buf[:n]), ":")
			sc.mu.Lock()
			sc.answers = append(sc.answers, answer{time.Now(), name})
			sc.mu.Unlock()
		}
	}()
	go func() {
		defer wg.Done()
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				_, _ = c.Write([]byte("q"))
			}
		}
	}()
	t.Cleanup(func() { close(done); c.Close(); wg.Wait() })
	return sc
}

// last returns the backend of the newest answer and when it came.
func (sc *steadyClient) last() answer {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if len(sc.answers) == 0 {
		return answer{}
	}
	return sc.answers[len(sc.answers)-1]
}

// answeredBy counts the answers since since that came from backend, and
// those from another.
func (sc *steadyClient) answeredBy(since time.Time, backend string) (from, other int) {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	for _, a := range sc.answers {
		if a.at.Before(since) {
			continue
		}
		if a.backend == backend {
			from++
		} else {
			other++
		}
	}
	return from, other
}

// A client on one fixed source port that never goes quiet moves off its
// endpoint within a second of that endpoint leaving the Service, or turning
// not serving; a terminating endpoint that still serves keeps it
// (kube-proxy's UDP conntrack cleanup).
func TestUDPFlowsFollowTheEndpointSet(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(ep *config.Endpoint) bool // false: remove the endpoint
		moves  bool
	}{
		{"removed from the slice", func(*config.Endpoint) bool { return false }, true},
		{"not serving", func(ep *config.Endpoint) bool { ep.Ready, ep.Serving, ep.Terminating = false, false, true; return true }, true},
		{"terminating, still serving", func(ep *config.Endpoint) bool { ep.Ready, ep.Serving, ep.Terminating = false, true, true; return true }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := startProxier(t, Config{})
			a, b := udpBackend(t, "a"), udpBackend(t, "b")
			sp := svc("dns", config.UDP, a, b)
			h.apply(sp)
			sc := startSteadyClient(t, h.addr("dns"))
			waitFor(t, "a first answer", func() bool { return sc.last().backend != "" })
			first := sc.last().backend
			gone, stay := a, "b"
			if first == "b" {
				gone, stay = b, "a"
			}

			next := *sp
			next.Endpoints = nil
			for _, ep := range sp.Endpoints {
				if ep.Addr == gone && !tc.change(&ep) {
					continue
				}
				next.Endpoints = append(next.Endpoints, ep)
			}
			changed := time.Now()
			h.apply(&next)
			if !tc.moves {
				// The sync that would move the flow is done (apply waited
				// for it): the next answers show where the flow is.
				waitFor(t, "five answers after the change", func() bool { from, other := sc.answeredBy(changed, first); return from+other >= 5 })
				if from, other := sc.answeredBy(changed, first); other != 0 {
					t.Fatalf("after its endpoint turned terminating but serving: %d answers from it, %d from the other; want all from it", from, other)
				}
				return
			}
			waitFor(t, "an answer from the other endpoint", func() bool { return sc.last().backend == stay })
			if took := sc.last().at.Sub(changed); took > time.Second {
				t.Fatalf("the client moved %v after the change, want within 1 s", took)
			}
			moved := sc.last().at
			waitFor(t, "five answers after the move", func() bool { from, other := sc.answeredBy(moved, first); return from+other >= 5 })
			if from, _ := sc.answeredBy(moved, first); from != 0 {
				t.Fatalf("%d answers from the old endpoint after the move", from)
			}
			waitFor(t, "the old flow's log line", func() bool {
				for _, f := range h.logs.Find("UDP flow closed") {
					if f["cause"] == dataplane.CauseEndpointGone.String() {
						return true
					}
				}
				return false
			})
		})
	}
}
