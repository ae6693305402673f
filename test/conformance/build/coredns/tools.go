//go:build tools

// Package tools pins, for go mod tidy, the conformance lab's cluster DNS:
// CoreDNS with its default plugins (kubernetes, forward, cache, ...).
package tools

import _ "github.com/coredns/coredns"
