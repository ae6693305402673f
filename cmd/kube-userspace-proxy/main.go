// Command kube-userspace-proxy load-balances Kubernetes Services from
// userspace, the way kube-proxy's classic userspace mode did.
//
// This package parses the command line and starts what it names: the
// daemon (package internal/daemon), its keeper (keep) or the offline
// explainer (explain). What the daemon's options are is package
// internal/options's.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/internal/daemon"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/internal/options"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "explain" {
		return daemon.RunExplain(args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "keep" {
		return daemon.RunKeeper(args[1:], stdout, stderr)
	}
	opts, err := options.Parse(args, stderr)
	if errors.Is(err, options.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "kube-userspace-proxy: %v\n", err)
		return daemon.ExitUsage
	}
	log, err := newLogger(opts, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "kube-userspace-proxy: %v\n", err)
		return daemon.ExitUsage
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := daemon.Serve(ctx, opts, log, stdout); err != nil {
		log.WithError(err).Error("Exiting")
		if errors.As(err, new(daemon.UsageError)) {
			return daemon.ExitUsage
		}
		return daemon.ExitFailure
	}
	return 0
}

func newLogger(o *options.Options, w io.Writer) (*logrus.Logger, error) {
	log := logrus.New()
	log.SetOutput(w)
	lvl, err := logrus.ParseLevel(o.LogLevel)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", o.Name("log-level"), err)
	}
	log.SetLevel(lvl)
	switch o.LogFormat {
	case "text":
		log.SetFormatter(&logrus.TextFormatter{FullTimestamp: true})
	case "json":
		log.SetFormatter(&logrus.JSONFormatter{})
	default:
		return nil, fmt.Errorf("%s: %q is not text or json", o.Name("log-format"), o.LogFormat)
	}
	return log, nil
}
