// Command kube-userspace-proxy load-balances Kubernetes Services from
// userspace, the way kube-proxy's classic userspace mode did.
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
)

// Exit codes: 1 for a failure at run time, 2 for bad flags or values.
const (
	exitFailure = 1
	exitUsage   = 2
)

// usageError marks errors caused by the command line, which exit with 2.
type usageError struct{ error }

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "explain" {
		return runExplain(args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "keep" {
		return runKeeper(args[1:], stdout, stderr)
	}
	opts, err := parseFlags(args, stderr)
	if errors.Is(err, errHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "kube-userspace-proxy: %v\n", err)
		return exitUsage
	}
	log, err := newLogger(opts, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "kube-userspace-proxy: %v\n", err)
		return exitUsage
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := serve(ctx, opts, log, stdout); err != nil {
		log.WithError(err).Error("Exiting")
		var ue usageError
		if errors.As(err, &ue) {
			return exitUsage
		}
		return exitFailure
	}
	return 0
}

func newLogger(o *options, w io.Writer) (*logrus.Logger, error) {
	log := logrus.New()
	log.SetOutput(w)
	lvl, err := logrus.ParseLevel(o.logLevel)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", o.name("log-level"), err)
	}
	log.SetLevel(lvl)
	switch o.logFormat {
	case "text":
		log.SetFormatter(&logrus.TextFormatter{FullTimestamp: true})
	case "json":
		log.SetFormatter(&logrus.JSONFormatter{})
	default:
		return nil, fmt.Errorf("%s: %q is not text or json", o.name("log-format"), o.logFormat)
	}
	return log, nil
}
