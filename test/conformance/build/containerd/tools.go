//go:build tools

// Package tools pins, for go mod tidy, the container runtime the conformance
// lab's kubelets use: containerd, its runc shim and ctr (to import images).
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
