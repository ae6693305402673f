package config

import (
	"context"
	"errors"
	"time"
)

// watchHealth probes the API server every 2 s while ctx lives and logs
// the start and the end of an outage once each; the informers' own retries
// are quiet (client-go retries a refused watch in place without reporting).
func (c *ClusterSource) watchHealth(ctx context.Context) {
	probe := c.Probe
	if probe == nil {
		probe = func(ctx context.Context) error {
			_, err := c.Client.Discovery().RESTClient().Get().AbsPath("/version").Do(ctx).Raw()
			return err
		}
	}
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := probe(pctx)
		cancel()
		if err == nil {
			c.apiBack()
			continue
		}
		if ctx.Err() != nil {
			return
		}
		c.mu.Lock()
		first := !c.outage
		c.outage = true
		c.mu.Unlock()
		if first {
			c.Log.WithError(err).Warn("API server unreachable; serving the last known state until it is back")
		}
	}
}

// watchError is called by the informers when a list or watch fails for a
// reason they do not retry in place (e.g. forbidden): each distinct error is
// logged once.
func (c *ClusterSource) watchError(err error) {
	if errors.Is(err, context.Canceled) {
		return
	}
	c.mu.Lock()
	if c.seenErrs == nil {
		c.seenErrs = map[string]bool{}
	}
	seen := c.seenErrs[err.Error()]
	c.seenErrs[err.Error()] = true
	c.mu.Unlock()
	if !seen {
		c.Log.WithError(err).Warn("Watching the API server failed; retrying")
	}
}

func (c *ClusterSource) apiBack() {
	c.mu.Lock()
	was := c.outage
	c.outage = false
	c.mu.Unlock()
	if was {
		c.Log.Info("API server reachable again; relisting to apply changes made meanwhile")
		select {
		case c.back <- struct{}{}:
		default:
		}
	}
}
