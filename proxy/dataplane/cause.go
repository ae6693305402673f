package dataplane

import "github.com/kube-userspace-proxy/kube-userspace-proxy/config"

// Cause is why a TCP connection or a UDP flow ended: the "cause" of its log
// line.
type Cause uint32

const (
	causeNone          Cause = iota // still open
	CauseClientClosed               // the client sent its FIN first
	CauseBackendClosed              // the backend sent its FIN first
	CauseClientReset                // the client reset the connection
	CauseBackendReset               // the backend reset the connection
	CauseIdleTimeout                // nothing moved for --tcp-idle-timeout / --udp-timeout
	CauseShutdown                   // the daemon stopped or the Service went away
	CauseNoEndpoints                // no endpoint to send it to
	CauseDialFailed                 // every dial attempt failed
	CauseEvicted                    // UDP: the flow table was full
	CauseEndpointError              // UDP: the endpoint's socket failed (an ICMP error, say)
	CauseEndpointGone               // UDP: the endpoint left the Service or stopped serving
	CauseTransferred                // it goes on in the successor daemon (a handover)
	CauseNotRedirected              // TCP: another host reached a proxy port directly (Config.GuardAtAccept)
)

var causeNames = [...]string{
	causeNone:          "open",
	CauseClientClosed:  "client closed",
	CauseBackendClosed: "backend closed",
	CauseClientReset:   "client reset",
	CauseBackendReset:  "backend reset",
	CauseIdleTimeout:   "idle timeout",
	CauseShutdown:      "shutdown",
	CauseNoEndpoints:   "no endpoints",
	CauseDialFailed:    "dial failed",
	CauseEvicted:       "evicted",
	CauseEndpointError: "endpoint error",
	CauseEndpointGone:  "endpoint gone",
	CauseTransferred:   "transferred",
	CauseNotRedirected: "not redirected",
}

func (c Cause) String() string {
	if int(c) < len(causeNames) {
		return causeNames[c]
	}
	return "unknown"
}

// Normal reports whether c is an ordinary end of a connection or flow of
// protocol, one that --connection-log errors does not log: a FIN for TCP; a
// flow that went quiet for UDP, which has no other way to end (a DNS
// query's flow always ends so).
func (c Cause) Normal(protocol config.Protocol) bool {
	switch c {
	case CauseClientClosed, CauseBackendClosed, CauseTransferred:
		return true
	case CauseIdleTimeout:
		return protocol == config.UDP
	}
	return false
}
