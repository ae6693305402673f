package config

import (
	"fmt"
	"net/netip"
	"strings"

	v1 "k8s.io/api/core/v1"
)

// TaintToBeDeleted is the cluster autoscaler's taint on a node it is about
// to remove.
const TaintToBeDeleted = "ToBeDeletedByClusterAutoscaler"

// NodeState reads what the proxy needs of this node's Node object: its
// zone (topology.kubernetes.io/zone), and whether it is going away (being
// deleted, or tainted by the cluster autoscaler for removal), in which case
// /healthz fails so that load balancers drain it first, as kube-proxy's does.
func NodeState(n *v1.Node) (zone string, deleting bool) {
	zone = n.Labels[v1.LabelTopologyZone]
	deleting = n.DeletionTimestamp != nil
	for _, t := range n.Spec.Taints {
		if t.Key == TaintToBeDeleted {
			deleting = true
		}
	}
	return zone, deleting
}

// NodePodCIDRs reads the Node's spec.podCIDRs (spec.podCIDR when only that
// is set), for --detect-local-mode NodeCIDR.
func NodePodCIDRs(n *v1.Node) ([]netip.Prefix, error) {
	cidrs := n.Spec.PodCIDRs
	if len(cidrs) == 0 && n.Spec.PodCIDR != "" {
		cidrs = []string{n.Spec.PodCIDR}
	}
	out, err := ParseCIDRs(strings.Join(cidrs, ","))
	if err != nil {
		return nil, fmt.Errorf("node %s: spec.podCIDRs: %w", n.Name, err)
	}
	return out, nil
}
