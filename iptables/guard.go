package iptables

import (
	"context"
	"fmt"
	"strings"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// Families lists the address families whose rules this writes.
func (r *Rules) Families() []int {
	out := make([]int, 0, len(r.families))
	for _, f := range r.families {
		out = append(out, f.fam)
	}
	return out
}

// KernelGuard reports whether family fam's guard of the proxy port range
// is the filter table's (the conntrack match is there, and a range is
// set); where it is not, the daemon guards at accept (proxy's
// Config.GuardAtAccept).
func (r *Rules) KernelGuard(fam int) bool {
	for _, f := range r.families {
		if f.fam == fam {
			return f.features.Conntrack && r.cfg.ProxyPorts.Size > 0
		}
	}
	return false
}

// InstallGuards puts the guard of the proxy port range in place in every
// family — its chain and its jump from filter INPUT — touching no other
// chain, so that it is there before the first listener opens: without it,
// other hosts could connect to a ClusterIP-only listener by the node's
// address. The rules a previous daemon left stay untouched until the first
// sync. It returns each family whose guard could not be installed (nil
// where no guard is needed: no conntrack match, or no range).
func (r *Rules) InstallGuards(ctx context.Context) map[int]error {
	failed := map[int]error{}
	for _, f := range r.families {
		if !f.features.Conntrack || r.cfg.ProxyPorts.Size == 0 {
			continue
		}
		if err := f.installGuard(ctx, r.cfg.ProxyPorts); err != nil {
			failed[f.fam] = err
		}
	}
	return failed
}

func (f *family) installGuard(ctx context.Context, ports config.PortRange) error {
	rs := Render(nil, RenderOptions{Family: f.fam, Features: f.features, ProxyPorts: ports})
	var in strings.Builder
	fmt.Fprintf(&in, "*filter\n:%s - [0:0]\n", ChainGuard)
	for _, rule := range rs.Filter[ChainGuard] {
		fmt.Fprintf(&in, "-A %s %s\n", ChainGuard, rule)
	}
	in.WriteString("COMMIT\n")
	// --noflush: only the chain declared here is flushed and refilled.
	if err := f.run(ctx, f.restore, []string{"-w", "--noflush"}, in.String()); err != nil {
		return fmt.Errorf("IPv%d guard: %w", f.fam, err)
	}
	for _, j := range jumps(f.features) {
		if j.table != "filter" || j.chain != "INPUT" || j.rule[len(j.rule)-1] != ChainGuard {
			continue
		}
		ok, err := f.ipt.Exists(j.table, j.chain, j.rule...)
		if err == nil && !ok {
			err = f.ipt.Insert(j.table, j.chain, 1, j.rule...)
		}
		if err != nil {
			return fmt.Errorf("IPv%d guard jump: %w", f.fam, err)
		}
	}
	return nil
}
