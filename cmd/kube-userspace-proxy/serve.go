package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// serve runs the daemon until ctx ends.
func serve(ctx context.Context, o *options, log *logrus.Logger, stdout io.Writer) error {
	node := o.nodeName()
	if o.manifests == "" {
		return usageError{errors.New("--kubeconfig/--master: watching a cluster is not built yet; use --manifests")}
	}
	if limit, err := proxy.RaiseFileLimit(); err != nil {
		log.WithError(err).Warn("Cannot raise the open-file limit")
	} else {
		log.WithField("limit", limit).Debug("Open-file limit")
	}

	p := proxy.New(proxy.Config{
		BindAddress:    o.bindAddress,
		PortRange:      o.portRange,
		TCPIdleTimeout: o.tcpIdleTimeout,
		UDPTimeout:     o.udpTimeout,
		UDPMaxFlows:    o.udpMaxFlows,
		MinSyncPeriod:  o.minSyncPeriod,
		SyncPeriod:     o.syncPeriod,
		Log:            log.WithField("component", "proxier"),
		ConnLog:        log.WithField("component", "conn"),
	})
	srcCtx, stopSource := context.WithCancel(ctx)
	defer stopSource()
	src := &config.ManifestSource{Path: o.manifests, Node: node, Sink: p, Log: log.WithField("component", "manifests")}
	watching, err := src.Start(srcCtx)
	if err != nil {
		return fmt.Errorf("loading --manifests: %w", err)
	}
	log.WithFields(logrus.Fields{"node": node, "manifests": o.manifests}).Info("Started")

	p.Run(ctx, o.shutdownGrace) // returns after ctx ends and connections drained
	stopSource()
	<-watching
	log.Info("Stopped")
	return nil
}
