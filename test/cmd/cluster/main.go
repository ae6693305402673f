// Command cluster (make cluster) starts a real control plane on this
// machine's loopback for trying the daemon against an API server: etcd,
// kube-apiserver and the endpointslice controller. Ctrl-C stops it.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

func main() {
	dir := flag.String("dir", ".cache/cluster", "state folder (etcd data, kubeconfig)")
	flag.Parse()
	abs, _ := filepath.Abs(*dir)
	os.RemoveAll(abs)
	bins, err := cluster.BinDir(".", os.Stderr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cp, err := cluster.Start(ctx, cluster.Options{BinDir: bins, Dir: abs, Log: os.Stderr})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer cp.Stop()
	fmt.Printf(`Control plane ready at %s (logs in %s).

  export KUBECONFIG=%s
  bin/kube-userspace-proxy --kubeconfig $KUBECONFIG --hostname-override node-1

No kubelet runs: create a Node, Pods with spec.nodeName and patch their status
to Ready (see README); the endpointslice controller then makes EndpointSlices.
Ctrl-C stops everything.
`, cp.URL, abs, cp.Kubeconfig)
	<-ctx.Done()
}
