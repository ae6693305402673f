package balance

// Passive outlier detection: the proxy sees every dial and every UDP error,
// so it notices a dead endpoint long before readiness probes and the API
// server do, and stops sending new connections there for a while. The
// vocabulary is Envoy's (consecutive failures, base and max ejection time,
// panic when everything is ejected); the default of two failures in a row
// follows HAProxy's "observe layer4" spirit for connect errors: a dead
// endpoint costs clients one or two failed dials, not one in n forever.

import (
	"net/netip"
	"sync/atomic"
	"time"
)

// OutlierConfig is passive outlier detection (--outlier-*).
type OutlierConfig struct {
	// ConsecutiveFailures is how many failed dials (or UDP endpoint errors)
	// in a row eject an endpoint; 0 turns detection off.
	ConsecutiveFailures int
	// BaseEjectionTime is how long the first ejection lasts; the nth one in
	// a row (no success between them) lasts n times as long …
	BaseEjectionTime time.Duration
	// … up to MaxEjectionTime.
	MaxEjectionTime time.Duration
}

// DefaultOutlier is the outlier detection of a daemon started without
// --outlier-* flags. Envoy's base (30 s) and max (300 s) ejection times.
var DefaultOutlier = OutlierConfig{ConsecutiveFailures: 2, BaseEjectionTime: 30 * time.Second, MaxEjectionTime: 300 * time.Second}

// enabled reports whether detection is on.
func (o OutlierConfig) enabled() bool { return o.ConsecutiveFailures > 0 && o.BaseEjectionTime > 0 }

// ejectionTime is how long the nth ejection in a row lasts.
func (o OutlierConfig) ejectionTime(n int32) time.Duration {
	d := o.BaseEjectionTime * time.Duration(n)
	if o.MaxEjectionTime > 0 && d > o.MaxEjectionTime {
		d = o.MaxEjectionTime
	}
	return d
}

// endpoint is one endpoint of a balancer with its health. The counters are
// atomics: a dial's outcome is reported without taking the balancer's lock,
// and a pick only reads them.
type endpoint struct {
	addr      netip.AddrPort
	failures  atomic.Int32 // failed dials or UDP errors in a row
	ejections atomic.Int32 // ejections in a row, without a success between them
	until     atomic.Int64 // unix nanoseconds when the ejection ends; 0: not ejected
	active    atomic.Int64 // connections and flows picked and not Done
	drained   atomic.Bool  // no new picks (POST /debug/drain)
}

// ejected reports whether e is out of rotation at now (unix nanoseconds).
func (e *endpoint) ejected(now int64) bool { return e.until.Load() > now }

// report records one outcome for e and returns how long e is now ejected
// for (0: it is not, or it already was). A success clears the counters: the
// endpoint is healthy again, and a probe after an ejection that succeeds
// returns it to rotation. A failure after an ejection (the probe failed)
// ejects it again at once, for longer.
func (e *endpoint) report(o OutlierConfig, failed bool, now time.Time) (ejectedFor time.Duration, recovered bool) {
	if !failed {
		if e.failures.Load() != 0 {
			e.failures.Store(0)
		}
		if e.ejections.Load() != 0 {
			e.ejections.Store(0)
			return 0, e.until.Swap(0) != 0
		}
		return 0, false
	}
	threshold := int32(o.ConsecutiveFailures)
	if e.ejections.Load() > 0 {
		threshold = 1 // on probation since the last ejection
	}
	if e.failures.Add(1) < threshold {
		return 0, false
	}
	nanos := now.UnixNano()
	if e.ejected(nanos) {
		return 0, false // failures of connections picked before the ejection
	}
	d := o.ejectionTime(e.ejections.Add(1))
	e.until.Store(nanos + int64(d))
	e.failures.Store(0)
	return d, false
}

// EndpointHealth is one endpoint's outlier state, for the debug view.
type EndpointHealth struct {
	Endpoint netip.AddrPort `json:"endpoint"`
	// Failures is the number of failed dials or UDP errors in a row.
	Failures int `json:"failures"`
	// Ejections is the number of ejections in a row.
	Ejections int `json:"ejections,omitempty"`
	// EjectedUntil is when the current ejection ends; absent when the
	// endpoint is in rotation.
	EjectedUntil *time.Time `json:"ejectedUntil,omitempty"`
	// Active is the connections and UDP flows open to it from this listener.
	Active int `json:"active"`
	// Drained: no new picks, by hand (POST /debug/drain).
	Drained bool `json:"drained,omitempty"`
}

func (e *endpoint) health(now time.Time) EndpointHealth {
	h := EndpointHealth{Endpoint: e.addr, Failures: int(e.failures.Load()), Ejections: int(e.ejections.Load()),
		Active: int(e.active.Load()), Drained: e.drained.Load()}
	if u := e.until.Load(); u > now.UnixNano() {
		t := time.Unix(0, u)
		h.EjectedUntil = &t
	}
	return h
}
