// Package kernel is the node's kernel, reached one way: the settings under
// /proc/sys (Sysctls), the process's limits, and netlink — one encoder and
// one decoder of attributes for the route and conntrack families.
//
// It owns no state beyond its netlink sockets and imports nothing of this
// project. With package proxy/internal/sock (sockets) and proxy/handover
// (the handover's unix socket), it is where golang.org/x/sys/unix, syscall
// and unsafe are used; the rest of the project asks these packages.
package kernel
