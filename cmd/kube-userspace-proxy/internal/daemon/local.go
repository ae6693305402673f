package daemon

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"github.com/sirupsen/logrus"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/internal/options"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// podCIDRWait is how long a start with --detect-local-mode NodeCIDR waits
// for the Node's spec.podCIDRs, as kube-proxy does (the controller manager
// allocates them once the node registers).
const podCIDRWait = 5 * time.Minute

// resolveLocal completes --detect-local-mode NodeCIDR with this node's pod
// CIDRs (the Node object, or the Node of --manifests) and says which
// clients count as this node's. kube-proxy reads them once too.
func resolveLocal(ctx context.Context, o *options.Options, client kubernetes.Interface, node string, log logrus.FieldLogger) error {
	if o.Local.Mode == config.LocalModeNodeCIDR {
		var err error
		if o.Local.CIDRs, err = nodePodCIDRs(ctx, client, o.Manifests, node, podCIDRWait, log); err != nil {
			return err
		}
	}
	l := log.WithFields(logrus.Fields{"mode": o.Local.Mode, "local": o.Local.Describe()})
	if len(o.Local.Matches(4)) == 0 && len(o.Local.Matches(6)) == 0 {
		l.Warn("Local-traffic detection finds no pod: backends see this node's address on the connections of its pods " +
			"(kube-proxy's would see the pod's), and only the node's own clients reach the external addresses of " +
			"externalTrafficPolicy: Local Services with every endpoint; set --cluster-cidr (kubeadm: podSubnet) or --detect-local-mode NodeCIDR")
		return nil
	}
	l.Info("Local-traffic detection")
	return nil
}

// nodePodCIDRs returns this node's spec.podCIDRs: from the API server,
// waiting up to wait for the controller manager to allocate them, or from
// the Node document of the manifests.
func nodePodCIDRs(
	ctx context.Context,
	client kubernetes.Interface,
	manifests, node string,
	wait time.Duration,
	log logrus.FieldLogger,
) ([]netip.Prefix, error) {
	if client == nil {
		st, _, err := config.LoadManifests(manifests, node)
		if err != nil {
			return nil, fmt.Errorf("--detect-local-mode NodeCIDR: %w", err)
		}
		if len(st.PodCIDRs) == 0 {
			return nil, fmt.Errorf("--detect-local-mode NodeCIDR: %s has no Node named %q with spec.podCIDRs", manifests, node)
		}
		return st.PodCIDRs, nil
	}
	deadline := time.Now().Add(wait)
	for logged := false; ; {
		n, err := client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err == nil {
			var cidrs []netip.Prefix
			if cidrs, err = config.NodePodCIDRs(n); err == nil && len(cidrs) > 0 {
				return cidrs, nil
			} else if err == nil {
				err = fmt.Errorf("node %s has no spec.podCIDRs yet", node)
			}
		}
		if apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err) {
			// Waiting cannot help; the RBAC rule of docs/deploy/rbac.yaml can.
			return nil, fmt.Errorf("--detect-local-mode NodeCIDR: cannot read Node %s (the daemon needs get on nodes): %w", node, err)
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("--detect-local-mode NodeCIDR: waited %v: %w", wait, err)
		}
		if !logged {
			log.WithError(err).Info("Waiting for this node's pod CIDRs (--detect-local-mode NodeCIDR)")
			logged = true
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}
