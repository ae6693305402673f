package main

import (
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"time"

	"golang.org/x/net/netutil"
)

// hostAllowed says whether a request's Host names this server: localhost,
// a loopback address, or the address it is bound to (any address literal
// when bound to all of them). A DNS name other than localhost is refused:
// that is what a DNS-rebinding page sends, having pointed its own name at
// 127.0.0.1, and no one reaches the daemon by a name of their own.
func hostAllowed(hostport string, bind netip.Addr) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.ToLower(strings.Trim(host, "[]")), ".")
	if host == "localhost" {
		return true
	}
	ip, err := netip.ParseAddr(host)
	if err != nil || ip.Zone() != "" {
		return false
	}
	ip = ip.Unmap()
	return ip.IsLoopback() || (bind.IsValid() && (bind.IsUnspecified() || ip == bind.Unmap()))
}

// guardHost answers 421 to a request whose Host is not this server's.
func guardHost(bind netip.Addr, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !hostAllowed(r.Host, bind) {
			http.Error(w, fmt.Sprintf("Host %q is not this daemon's address (use 127.0.0.1 or localhost)", r.Host), http.StatusMisdirectedRequest)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// serverLimits bound what one client can hold of an HTTP server: how long
// it may take to send its request and read the answer, how long an idle
// keep-alive connection stays, the header size, and how many connections
// are open at once (beyond that, new ones wait in the accept queue).
type serverLimits struct {
	readHeader, read, write, idle time.Duration
	maxHeaderBytes, maxConns      int
}

var (
	// The health address is probed by load balancers across the network:
	// small answers, short timeouts.
	healthLimits = serverLimits{readHeader: 5 * time.Second, read: 10 * time.Second, write: 10 * time.Second,
		idle: 30 * time.Second, maxHeaderBytes: 8 << 10, maxConns: 64}
	// The metrics address (local by default) also serves the debug pages:
	// a CPU profile writes for its duration, a big connection table for a
	// while.
	metricsLimits = serverLimits{readHeader: 5 * time.Second, read: 30 * time.Second, write: 2 * time.Minute,
		idle: 60 * time.Second, maxHeaderBytes: 16 << 10, maxConns: 32}
)

func (l serverLimits) server(h http.Handler) *http.Server {
	return &http.Server{Handler: h, ReadHeaderTimeout: l.readHeader, ReadTimeout: l.read, WriteTimeout: l.write,
		IdleTimeout: l.idle, MaxHeaderBytes: l.maxHeaderBytes}
}

func (l serverLimits) listener(ln net.Listener) net.Listener {
	return netutil.LimitListener(ln, l.maxConns)
}

// bindOf is the address part of an ip:port flag (checked at parse).
func bindOf(addr string) netip.Addr {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return netip.Addr{}
	}
	return ap.Addr()
}
