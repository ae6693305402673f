package proxy

import (
	"net/netip"
	"strings"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// endLine is what the log line of one ended TCP connection or UDP flow
// says: the same fields for both, so that one query finds either.
type endLine struct {
	protocol    config.Protocol
	client      netip.AddrPort
	origDst     string         // where the client was going; "" when unknown
	endpoint    netip.AddrPort // invalid when none was picked
	reason      Reason
	up, down    int64 // bytes to the endpoint and back to the client
	start       time.Time
	cause       Cause
	err         error         // the error behind cause, if any
	attempts    int           // TCP: dials tried
	dialLatency time.Duration // TCP: of the dial that succeeded
	dialErrors  []string      // TCP: "failure endpoint" of each failed dial
}

// logEnd writes l's line, if --connection-log wants it.
func (f *frontend) logEnd(l endLine) {
	if !f.dp.cfg.logConn(l.protocol, l.cause) {
		return
	}
	fields := logrus.Fields{
		"service":   f.key.Name.String(),
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
	log := f.dp.cfg.connLog()
	if l.err != nil {
		log = log.WithError(l.err)
	}
	log.WithFields(fields).Info(msg)
}
