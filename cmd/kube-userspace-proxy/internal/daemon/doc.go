// Package daemon is the daemon's life cycle: Serve starts its parts in one
// declared order (serve.go: the inputs checked, the process set up, the
// rules probed, a predecessor's sockets taken, the node prepared, the
// proxier, HTTP, the sync goroutine, the source, the handover socket) and
// stops them in the reverse one; the HTTP endpoints and the admin socket
// (http.go, admin.go), the handover's giving and taking sides (handover.go),
// the keeper (keeper.go, the keep subcommand) and the offline explainer
// (explain.go, the explain subcommand).
//
// It owns what runs while the daemon does: the servers, the goroutines of
// its members, the keeper's worker. It words the libraries' typed errors
// with the flags' names (Options.Name). It imports the options, the
// proxier, the rules and the packages below them.
package daemon
