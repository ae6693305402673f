// Package dataplane is the data path: the frontends (one live listener
// each, with its balancer), one TCP connection's path from accept to the
// end of its splice (tcp.go), one UDP flow's (udp.go), the connection
// table, the goroutine pools, the descriptor budget, the end-of-connection
// log line, and the detach machinery that transfers live connections and
// flows to a successor (transfer.go, transfer_udp.go).
//
// Who owns what: a Dataplane owns what the connections share (dataplane.go
// lists it); a Frontend owns its listener and its UDP flows; a TCP
// connection's handler goroutine owns its two sockets (tcp.go). Everything
// live on the data path — listeners, TCP pairs, UDP flows, the balancers'
// affinity and ejection state — is reachable from a Dataplane and its
// Frontends. Its callers (package proxy's sync goroutine) open, serve,
// stop and release frontends; nothing here decides what to serve.
//
// It imports the leaf packages (balance, proxyproto, ports, clientaddr),
// the handover protocol's Socket, and the kernel owners (internal/sock,
// kernel); never package proxy.
package dataplane
