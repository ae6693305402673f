package dataplane

import (
	"net/netip"
	"strings"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"
	"golang.org/x/time/rate"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
)

// endLine is what the log line of one ended TCP connection or UDP flow
// says: the same fields for both, so that one query finds either.
type endLine struct {
	protocol    config.Protocol
	client      netip.AddrPort
	origDst     string         // where the client was going; "" when unknown
	endpoint    netip.AddrPort // invalid when none was picked
	reason      balance.Reason
	up, down    int64 // bytes to the endpoint and back to the client
	start       time.Time
	cause       Cause
	err         error         // the error behind cause, if any
	attempts    int           // TCP: dials tried
	dialLatency time.Duration // TCP: of the dial that succeeded
	dialErrors  []string      // TCP: "failure endpoint" of each failed dial
	backendSees string        // the source address the backend saw, or "node"; "" without a backend
}

// connLogLimit is the rate limit of the connection log.
type connLogLimit struct {
	limiter *rate.Limiter // nil: unbounded
	dropped atomic.Int64  // lines over the limit since the last one written
}

func newConnLogLimit(perSecond float64) *connLogLimit {
	switch {
	case perSecond < 0:
		return &connLogLimit{}
	case perSecond == 0:
		perSecond = DefaultConnLogRate
	}
	return &connLogLimit{limiter: rate.NewLimiter(rate.Limit(perSecond), int(2*perSecond)+1)}
}

// pass says whether a line may be written now, and how many were dropped
// before it (to be said with it).
func (c *connLogLimit) pass() (bool, int64) {
	if c.limiter == nil {
		return true, 0
	}
	if !c.limiter.Allow() {
		c.dropped.Add(1)
		return false, 0
	}
	return true, c.dropped.Swap(0)
}

// logEnd writes l's line, if --connection-log wants it and its rate
// limit lets it.
func (fe *Frontend) logEnd(l endLine) {
	if !fe.dp.cfg.logConn(l.protocol, l.cause) {
		return
	}
	ok, dropped := fe.dp.connLogLimit.pass()
	if !ok {
		return
	}
	if dropped > 0 {
		fe.dp.cfg.connLog().WithField("dropped", dropped).Warn("Connection log lines dropped over the rate limit (--connection-log-rate)")
	}
	fields := logrus.Fields{
		"service":   fe.key.Name.String(),
		"client":    l.client.String(),
		"protocol":  string(l.protocol),
		"bytesUp":   l.up,
		"bytesDown": l.down,
		"duration":  time.Since(l.start).Round(time.Microsecond).String(),
		"cause":     l.cause.String(),
	}
	if l.origDst != "" {
		fields["origDst"] = l.origDst
	}
	if l.endpoint.IsValid() {
		fields["endpoint"] = l.endpoint.String()
		fields["reason"] = string(l.reason)
	}
	if l.backendSees != "" {
		fields["backendSees"] = l.backendSees
	}
	msg := "UDP flow closed"
	if l.protocol == config.TCP {
		msg = "Connection closed"
		fields["attempts"] = l.attempts
		fields["dialLatency"] = l.dialLatency.Round(time.Microsecond).String()
		if len(l.dialErrors) > 0 {
			// Why each failed attempt failed: refused, timeout, unreachable …
			fields["dialErrors"] = strings.Join(l.dialErrors, ", ")
		}
	}
	log := fe.dp.cfg.connLog()
	if l.err != nil {
		log = log.WithError(l.err)
	}
	log.WithFields(fields).Info(msg)
}
