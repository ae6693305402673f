package proxy

import (
	"time"
)

// Health is what /healthz reports.
type Health struct {
	LastUpdated time.Time // end of the last successful sync; zero before the first
	QueuedAt    time.Time // when the oldest change not yet in force (its sync or rule write to come) arrived; zero if none
	LastErr     error     // the last sync's error
	// ListenFailures counts the listeners the last sync could not open:
	// not one Service's conflict (NodePort conflicts do not count) but the
	// daemon's own trouble — the port range exhausted, out of
	// descriptors, a bind address that is not local.
	ListenFailures int
	// OutOfFiles: a system call failed for want of descriptors less than
	// 10 s ago (accept, dial, a flow's socket, a listener).
	OutOfFiles bool
	// NodeDeleting: the node is being deleted or tainted for removal by
	// the cluster autoscaler (config.NodeState): /healthz fails, /livez not.
	NodeDeleting bool
}

// Health returns the sync state for health checks.
func (p *Proxier) Health() Health {
	p.mu.Lock()
	queuedAt := earliest(p.queuedAt, p.applyingAt)
	p.mu.Unlock()
	lastUpdated, unwrittenAt, lastErr := p.writer.status()
	listenFailures, nodeDeleting := p.rec.health()
	return Health{LastUpdated: lastUpdated, QueuedAt: earliest(queuedAt, unwrittenAt), LastErr: lastErr, ListenFailures: listenFailures,
		OutOfFiles: p.dp.OutOfFilesWithin(10 * time.Second), NodeDeleting: nodeDeleting}
}

// health is the last sync's part of Health: listeners it could not open,
// and whether the node is going away.
func (r *reconciler) health() (listenFailures int, nodeDeleting bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.lastListenFailures, r.nodeDeleting
}
