package options

import "time"

// Conntrack are kube-proxy's conntrack sysctls (its --conntrack-*
// flags and conntrack: fields, with its defaults). Connections through a
// REDIRECT are conntrack entries like kube-proxy's DNAT ones: a CLOSE_WAIT
// entry that lives 60 s (the kernel's default) instead of kube-proxy's
// hour breaks clients that keep half-closed connections.
type Conntrack struct {
	MaxPerCore, Min int
	TCPEstablished  time.Duration
	TCPCloseWait    time.Duration
	TCPBeLiberal    bool
	UDPTimeout      time.Duration
	UDPStream       time.Duration
}

// Max is kube-proxy's: maxPerCore × CPUs, at least min, at most
// 1 Mi; 0 (MaxPerCore 0) leaves the limit alone.
func (c Conntrack) Max(cpus int) int {
	if c.MaxPerCore <= 0 {
		return 0
	}
	return min(max(c.MaxPerCore*cpus, c.Min), 1<<20)
}
