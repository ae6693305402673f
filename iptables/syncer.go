package iptables

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sort"
	"sync"

	"github.com/hashicorp/go-multierror"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// Config holds the rule syncer's settings.
type Config struct {
	// NodePortAddresses (--nodeport-addresses) limits NodePorts to node
	// addresses inside these prefixes; empty means every local address.
	NodePortAddresses []netip.Prefix
	// RestoreCommand and SaveCommand override the iptables-restore and
	// iptables-save binaries of IPv4 (tests inject failures with them);
	// IPv6 always uses ip6tables-restore and ip6tables-save.
	RestoreCommand, SaveCommand string
	// DisableIPv6 skips ip6tables entirely.
	DisableIPv6 bool
	// ProxyPorts is --proxy-port-range: every listener port off a NodePort
	// is in it, so that one rule per protocol keeps them off-node. Required
	// where the kernel has the conntrack match.
	ProxyPorts config.PortRange
	// LocalTraffic is --detect-local-mode and its values: the pods of this
	// node whose traffic to the external addresses of an
	// externalTrafficPolicy: Local Service is short-circuited to every
	// endpoint, as the node's own is.
	LocalTraffic config.LocalTraffic
	// BasicOnly ignores the optional matches even where the kernel has them,
	// to run (and test) the rules a kernel without netfilter extras gets.
	BasicOnly bool
	// Kernel gathers the optional pieces found and missing (the matches,
	// ip6tables), for the start line; nil: not gathered.
	Kernel *config.KernelReport
	Log    logrus.FieldLogger
}

// Rules implements proxy.Rules with one table writer per IP family.
type Rules struct {
	cfg      Config
	log      logrus.FieldLogger
	families []*family

	mu     sync.Mutex // guards shown, counts and writes, for Counts, TraceInput and Check
	shown  map[int]*Ruleset
	counts map[string]int
	// writes counts rule writes in progress and done, per family, as a
	// sequence lock: odd while Sync writes, so that Check never compares
	// the kernel with a snapshot older than what it reads there.
	writes map[int]uint64
}

// ErrNotSupported wraps every "this machine cannot run the proxy" error.
var ErrNotSupported = errors.New("iptables support missing")

// New probes IPv4 (required) and IPv6 (optional: missing support is a
// warning and IPv6 services get no rules) and returns the syncer.
func New(cfg Config) (*Rules, error) {
	log := cfg.Log
	if log == nil {
		log = logrus.StandardLogger()
	}
	r := &Rules{cfg: cfg, log: log, shown: map[int]*Ruleset{}, counts: map[string]int{}, writes: map[int]uint64{}}
	v4, err := newFamily(4, cfg.RestoreCommand, cfg.SaveCommand, cfg.BasicOnly)
	if err != nil {
		return nil, err
	}
	r.families = append(r.families, v4)
	log.WithFields(
		logrus.Fields{"family": 4, "comment": v4.features.Comment, "addrtype": v4.features.Addrtype, "conntrack": v4.features.Conntrack},
	).Info(
		"iptables probed",
	)
	if v4.features.Conntrack && cfg.ProxyPorts.Size == 0 {
		return nil, errors.New("iptables: a proxy port range is required for the guard of proxy ports")
	}
	if !cfg.DisableIPv6 {
		v6, err := newFamily(6, "", "", cfg.BasicOnly)
		if err != nil {
			cfg.Kernel.Lacks(config.PieceIPv6Rules, "IPv6 service addresses are not redirected, and no IPv6 listener opens", err)
		} else {
			r.families = append(r.families, v6)
			cfg.Kernel.Present(config.PieceIPv6Rules)
		}
	}
	r.reportFeatures(cfg.Kernel)
	// The failure counters exist from the start, at zero, as kube-proxy's.
	for _, f := range r.families {
		for _, c := range []*prometheus.CounterVec{restoreFailures, partialRestoreFailures, conntrackReconcilerDeleted} {
			c.WithLabelValues(familyName(f.fam))
		}
	}
	return r, nil
}

// ErrBasicOnly is a kernel report's reason for an optional match left
// unused because Config.BasicOnly asks for the basic matches only.
var ErrBasicOnly = errors.New("off: the basic matches only were asked for")

// reportFeatures tells report which optional matches the families have,
// and what each missing one costs.
func (r *Rules) reportFeatures(report *config.KernelReport) {
	var off error
	if r.cfg.BasicOnly {
		off = ErrBasicOnly
	}
	for _, m := range []struct {
		piece config.KernelPiece
		has   func(Features) bool
		costs string
	}{
		{config.PieceCommentMatch, func(f Features) bool { return f.Comment }, "rules carry no namespace/name:port comments (iptables-save shows them bare)"},
		{config.PieceAddrtypeMatch, func(f Features) bool { return f.Addrtype },
			"every new connection through the node enters the NodePort chains, and the NodePort rules of externalTrafficPolicy: Local Services list the node's addresses one by one"},
		{config.PieceConntrackMatch, func(f Features) bool { return f.Conntrack },
			"the proxy ports are guarded by the daemon instead of the filter table: a TCP connection from another host that no rule redirected is reset at accept, " +
				"a UDP flow's datagrams are dropped where conntrack netlink tells (one request per new flow)"},
	} {
		for _, f := range r.families {
			if !m.has(f.features) {
				costs := m.costs
				if f.fam == 6 && m.has(r.families[0].features) {
					costs = "IPv6: " + costs
				}
				report.Lacks(m.piece, costs, off)
			}
		}
		if _, missing := report.Missing(m.piece); !missing {
			report.Present(m.piece)
		}
	}
}

// Sync implements proxy.Rules.
func (r *Rules) Sync(ctx context.Context, frontends []config.Frontend, verify bool) error {
	return r.sync(ctx, frontends, verify, nil)
}

func (r *Rules) sync(ctx context.Context, frontends []config.Frontend, verify bool, h *hint) error {
	var errs *multierror.Error
	for _, f := range r.families {
		mine := ofFamily(frontends, f.fam)
		opts := f.renderOptions(r.cfg)
		r.mu.Lock()
		r.writes[f.fam]++ // odd: writing
		r.mu.Unlock()
		nat, filter, err := f.sync(ctx, mine, opts, verify, h, r.log)
		if err != nil {
			r.mu.Lock()
			r.writes[f.fam]++
			r.mu.Unlock()
			errs = multierror.Append(errs, fmt.Errorf("IPv%d: %w", f.fam, err))
			continue
		}
		// The rules are in place: now the next datagram meets them.
		if f.conntrack != nil {
			f.conntrack.sync(mine, r.log)
		}
		ruleCount.WithLabelValues("nat", familyName(f.fam)).Set(float64(nat))
		ruleCount.WithLabelValues("filter", familyName(f.fam)).Set(float64(filter))
		r.mu.Lock()
		r.writes[f.fam]++ // even: done
		r.shown[f.fam] = f.installed
		r.counts[fmt.Sprintf("nat/%d", f.fam)] = nat
		r.counts[fmt.Sprintf("filter/%d", f.fam)] = filter
		r.mu.Unlock()
	}
	if errs != nil {
		return errs
	}
	for _, fe := range frontends {
		if fe.Family == 6 && len(r.families) < 2 && fe.Err == nil {
			return fmt.Errorf("%s has IPv6 addresses but IPv6 rules are unavailable", fe.Service.Name)
		}
	}
	return nil
}

// SyncChanged is Sync when only the frontends of changed were served again
// since the last Sync (fresh: those of them that are in frontends): the
// rules of the other frontends are not looked at. Anything unusual (the
// first sync, new node addresses, a drift) takes the full Sync.
func (r *Rules) SyncChanged(ctx context.Context, frontends []config.Frontend, changed []config.ServicePortName, fresh []config.Frontend) error {
	return r.sync(ctx, frontends, false, &hint{changed: changed, fresh: fresh})
}

// hint says which frontends a sync must look at (nil: all).
type hint struct {
	changed []config.ServicePortName
	fresh   []config.Frontend
}

// ofFamily returns the frontends of family fam that have a listener: the
// given slice itself when that is all of them (never modified: it is the
// proxier's view, and copying 10k frontends was a megabyte per sync).
func ofFamily(frontends []config.Frontend, fam int) []config.Frontend {
	all := true
	n := 0
	for _, fe := range frontends {
		if fe.Family == fam && fe.Err == nil {
			n++
		} else {
			all = false
		}
	}
	if all {
		return frontends
	}
	mine := make([]config.Frontend, 0, n)
	for _, fe := range frontends {
		if fe.Family == fam && fe.Err == nil {
			mine = append(mine, fe)
		}
	}
	return mine
}

// Counts returns the rule counts per table/family ("nat/4") of the last sync.
func (r *Rules) Counts() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	counts := make(map[string]int, len(r.counts))
	for k, v := range r.counts {
		counts[k] = v
	}
	return counts
}

// renderOptions returns the options of the next sync; a change of options
// (node addresses) renders every frontend again.
func (f *family) renderOptions(cfg Config) RenderOptions {
	o := RenderOptions{Family: f.fam, Features: f.features, ProxyPorts: cfg.ProxyPorts, LocalTraffic: cfg.LocalTraffic}
	if len(cfg.NodePortAddresses) == 0 && f.features.Addrtype {
		o.AllLocal = true
		return o
	}
	o.NodePortAddresses = LocalAddrs(f.fam, cfg.NodePortAddresses)
	return o
}

// LocalAddrs lists this node's addresses of a family inside cidrs (all of
// them when cidrs is empty), loopback included so that 127.0.0.1:NodePort
// works from the node.
func LocalAddrs(fam int, cidrs []netip.Prefix) []netip.Addr {
	addrs, _ := net.InterfaceAddrs()
	var out []netip.Addr
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok {
			continue
		}
		ip, ok := netip.AddrFromSlice(ipn.IP)
		if !ok {
			continue
		}
		ip = ip.Unmap()
		if (fam == 4) != ip.Is4() || ip.IsLinkLocalUnicast() {
			continue
		}
		in := len(cidrs) == 0
		for _, c := range cidrs {
			in = in || c.Contains(ip)
		}
		if in {
			out = append(out, ip)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Less(out[j]) })
	return out
}
