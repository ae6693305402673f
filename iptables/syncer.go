package iptables

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	goipt "github.com/coreos/go-iptables/iptables"
	"github.com/hashicorp/go-multierror"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"

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
	// BasicOnly ignores the optional matches even where the kernel has them,
	// to run (and test) the rules a kernel without netfilter extras gets.
	BasicOnly bool
	Log       logrus.FieldLogger
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

// family writes the rules of one IP family. Owned by the proxier's rule
// writer (one Sync at a time).
type family struct {
	fam      int
	restore  string
	save     string
	ipt      *goipt.IPTables
	features Features
	// records are the rules of each frontend, rendered with opts: only a
	// frontend that changed is rendered again.
	records map[feKey]*feRules
	// trees are the records' rules by tree, sorted (see sortedTrees), kept
	// up to date with records so that a change does not sort them all again.
	trees map[string][]treeItem
	opts  RenderOptions
	// installed is what we believe is in the kernel (never modified once
	// built); nil means unknown, so the next sync rewrites everything.
	installed *Ruleset
	jumpsOK   bool
	// drifted is set by Check, from another goroutine: the next sync
	// rewrites everything.
	drifted atomic.Bool
	// gen numbers updates of records; a record not marked with the current
	// one belongs to a frontend that is gone.
	gen uint64
	// conntrack deletes the UDP entries a sync made stale.
	conntrack *conntrackCleaner
	// timeout bounds each iptables-restore and iptables-save (0:
	// commandTimeout).
	timeout time.Duration
}

// commandTimeout bounds one iptables-restore or iptables-save. A full write
// of 10k service ports takes ~1 s; one that has not finished in a minute is
// stuck (a kernel or a lock holder gone wrong), and is killed so that the
// rule writer, the syncs queued behind it and shutdown go on: the write
// fails and is tried again like any failed write.
const commandTimeout = time.Minute

// waitDelay bounds the wait for a killed command's output to close (a
// child it left holding the pipes).
const waitDelay = time.Second

// commandTimeout is the bound of one command of this family.
func (f *family) commandTimeout() time.Duration {
	if f.timeout > 0 {
		return f.timeout
	}
	return commandTimeout
}

// command returns bin with args, bound by ctx and the family's timeout (the
// context returned); done releases the timeout.
func (f *family) command(ctx context.Context, bin string, args []string) (*exec.Cmd, context.Context, context.CancelFunc) {
	ctx, done := context.WithTimeout(ctx, f.commandTimeout())
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.WaitDelay = waitDelay
	return cmd, ctx, done
}

// commandError describes a failed command; one that was killed (ctx ended)
// says why.
func (f *family) commandError(ctx context.Context, bin string, args []string, err error, stderr string) error {
	what := strings.TrimSpace(bin + " " + strings.Join(args, " "))
	switch cerr := ctx.Err(); {
	case errors.Is(cerr, context.DeadlineExceeded):
		return fmt.Errorf("%s: killed, not done after %v: %w", what, f.commandTimeout(), cerr)
	case cerr != nil:
		return fmt.Errorf("%s: killed: %w", what, cerr)
	}
	return fmt.Errorf("%s: %w: %s", what, err, strings.TrimSpace(stderr))
}

type feKey struct {
	name config.ServicePortName
	kind config.Kind
}

type feRules struct {
	fe    config.Frontend
	rules []leafRule
	seen  uint64 // the last update that found this frontend
}

// sameRules reports whether a and b render the same rules.
// Sources reuse an unchanged port's pointer, which settles most cases cheaply.
func sameRules(a, b config.Frontend) bool {
	return a.Service.SameRules(b.Service) && a.Listen == b.Listen &&
		a.Kind == b.Kind && a.Protocol == b.Protocol && (a.NodePortErr == nil) == (b.NodePortErr == nil)
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
	log.WithFields(logrus.Fields{"family": 4, "comment": v4.features.Comment, "addrtype": v4.features.Addrtype, "conntrack": v4.features.Conntrack}).Info("iptables probed")
	if !v4.features.Conntrack {
		log.Warn("WARNING: the conntrack match is missing: proxy listener ports of ClusterIP-only services can be reached from other hosts by connecting to this node's address and the listener port directly. Firewall the node or load xt_conntrack/nf_conntrack.")
	} else if cfg.ProxyPorts.Size == 0 {
		return nil, errors.New("iptables: a proxy port range is required for the guard of proxy ports")
	}
	if !cfg.DisableIPv6 {
		v6, err := newFamily(6, "", "", cfg.BasicOnly)
		if err != nil {
			log.WithError(err).Warn("IPv6 disabled: IPv6 service addresses will not be redirected")
		} else {
			r.families = append(r.families, v6)
		}
	}
	return r, nil
}

func newFamily(fam int, restore, save string, basicOnly bool) (*family, error) {
	proto, prefix := goipt.ProtocolIPv4, "iptables"
	if fam == 6 {
		proto, prefix = goipt.ProtocolIPv6, "ip6tables"
	}
	if restore == "" {
		restore = prefix + "-restore"
	}
	if save == "" {
		save = prefix + "-save"
	}
	for _, bin := range []string{prefix, restore, save} {
		if _, err := exec.LookPath(bin); err != nil {
			return nil, fmt.Errorf("%w: %s not found in PATH (install the iptables package)", ErrNotSupported, bin)
		}
	}
	ipt, err := goipt.New(goipt.IPFamily(proto), goipt.Timeout(30))
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrNotSupported, prefix, err)
	}
	f := &family{fam: fam, restore: restore, save: save, ipt: ipt, conntrack: newConntrackCleaner(fam)}
	if err := f.probe(); err != nil {
		return nil, err
	}
	if basicOnly {
		f.features = Features{}
	}
	return f, nil
}

// probe checks that the nat table and REDIRECT work (required) and which
// optional matches exist, using a scratch chain it deletes again.
func (f *family) probe() error {
	if _, err := f.ipt.ListChains("nat"); err != nil {
		return fmt.Errorf("%w: IPv%d nat table unusable (kernel needs iptable_nat or nft nat): %v", ErrNotSupported, f.fam, err)
	}
	defer func() { _ = f.ipt.ClearAndDeleteChain("nat", chainProbe) }()
	try := func(rule string) error {
		in := fmt.Sprintf("*nat\n:%s - [0:0]\n-A %s %s\nCOMMIT\n", chainProbe, chainProbe, rule)
		return f.run(context.Background(), f.restore, []string{"-w", "--noflush"}, in)
	}
	if err := try("-p tcp -m tcp --dport 1 -j REDIRECT --to-ports 1"); err != nil {
		return fmt.Errorf("%w: IPv%d REDIRECT target unusable (kernel needs nf_nat / REDIRECT support): %v", ErrNotSupported, f.fam, err)
	}
	if err := try("-p tcp -m tcp --dport 1 -j DNAT --to-destination " + map[int]string{4: "127.0.0.1:1", 6: "[::1]:1"}[f.fam]); err != nil {
		return fmt.Errorf("%w: IPv%d DNAT target unusable: %v", ErrNotSupported, f.fam, err)
	}
	f.features.Comment = try(`-m comment --comment "probe" -j RETURN`) == nil
	f.features.Addrtype = try("-m addrtype --dst-type LOCAL -j RETURN") == nil
	f.features.Conntrack = try("-m conntrack --ctstate DNAT -j RETURN") == nil
	return nil
}

// run runs bin with args and stdin as its input, bound by ctx and the
// family's timeout.
func (f *family) run(ctx context.Context, bin string, args []string, stdin string) error {
	cmd, ctx, done := f.command(ctx, bin, args)
	defer done()
	cmd.Stdin = strings.NewReader(stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		if bin == f.restore {
			restoreFailures.Inc()
		}
		return f.commandError(ctx, bin, args, err, stderr.String())
	}
	return nil
}

// Sync implements proxy.Rules.
func (r *Rules) Sync(ctx context.Context, frontends []config.Frontend, verify bool) error {
	return r.sync(ctx, frontends, verify, nil)
}

func (r *Rules) sync(ctx context.Context, frontends []config.Frontend, verify bool, h *hint) error {
	var errs *multierror.Error
	for _, f := range r.families {
		mine := ofFamily(frontends, f.fam)
		opts := f.renderOptions(r.cfg.NodePortAddresses, r.cfg.ProxyPorts)
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
		ruleCount.WithLabelValues("nat", fmt.Sprint(f.fam)).Set(float64(nat))
		ruleCount.WithLabelValues("filter", fmt.Sprint(f.fam)).Set(float64(filter))
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
func (f *family) renderOptions(cidrs []netip.Prefix, ports config.PortRange) RenderOptions {
	o := RenderOptions{Family: f.fam, Features: f.features, ProxyPorts: ports}
	if len(cidrs) == 0 && f.features.Addrtype {
		o.AllLocal = true
		return o
	}
	o.NodePortAddresses = LocalAddrs(f.fam, cidrs)
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

// sync writes the rules of frontends: it brings the records up to date,
// plans the write from what is installed or live (writePlan), and commits
// the plan. It returns the rule counts per table.
func (f *family) sync(ctx context.Context, frontends []config.Frontend, opts RenderOptions, verify bool, h *hint, log logrus.FieldLogger) (nat, filter int, err error) {
	live, err := f.check(ctx, opts, verify, log)
	if err != nil {
		return 0, 0, err
	}
	start := time.Now()
	var changed bool
	if h != nil && f.records != nil && f.installed != nil {
		changed = f.updateChanged(h)
	} else {
		changed = f.update(frontends)
	}
	if f.installed != nil && !changed {
		nat, filter = f.installed.Count()
		return nat, filter, nil
	}
	want := f.render()
	if f.installed != nil {
		if err := f.commit(ctx, f.plan(f.installed, want, writeDiff), log, start); err == nil {
			nat, filter = want.Count()
			return nat, filter, nil
		}
		log.WithError(err).Warn("Partial rule update failed; rewriting all rules")
	}
	if live == nil {
		var jumps bool
		if live, jumps, err = f.live(ctx, false); err != nil {
			f.installed = nil
			return 0, 0, err
		}
		f.jumpsOK = f.jumpsOK || jumps
	}
	mode := writeFull
	if f.jumpsOK {
		// What is installed (at a restart: the rules of the daemon before,
		// mostly the wanted ones, its listeners' ports being chosen alike)
		// is known now: write only the chains that differ. At 10k
		// service ports a restart wrote 10 685 rules for 1.2 s.
		mode = writeOverwrite
	}
	if err := f.commit(ctx, f.plan(live, want, mode), log, start); err != nil {
		f.installed = nil
		return 0, 0, err
	}
	nat, filter = want.Count()
	return nat, filter, nil
}

// check forgets what is installed when the rules drifted (a check found it)
// or, with verify, when the live rules differ from it; it returns the live
// rules when it read them.
func (f *family) check(ctx context.Context, opts RenderOptions, verify bool, log logrus.FieldLogger) (*Ruleset, error) {
	if !reflect.DeepEqual(opts, f.opts) {
		f.records = nil // node addresses changed: every NodePort rule may
	}
	f.opts = opts
	if f.drifted.Swap(false) && f.installed != nil {
		log.WithField("family", f.fam).Warn("Rules changed behind our back; rewriting them")
		f.installed, f.jumpsOK = nil, false
	}
	if !verify || f.installed == nil {
		return nil, nil
	}
	live, jumps, err := f.live(ctx, false)
	if err != nil {
		return nil, err
	}
	if !live.Same(f.installed) || !jumps {
		log.WithField("family", f.fam).Warn("Rules changed behind our back; rewriting them")
		f.installed, f.jumpsOK = nil, jumps
	}
	return live, nil
}

// writeMode is how a write brings the kernel's rules to the wanted ones.
type writeMode int

const (
	// writeDiff writes the chains that differ from what we installed.
	writeDiff writeMode = iota
	// writeOverwrite writes the chains that differ from the live rules,
	// whose jumps into our chains are known good.
	writeOverwrite
	// writeFull writes every chain of ours, deletes the other chains of
	// ours (left by an earlier layout or version) and repairs the jumps.
	writeFull
)

var writeModeNames = [...]string{writeDiff: "diff", writeOverwrite: "overwrite", writeFull: "full"}

// writePlan is one write: what iptables-restore is given (nothing: the
// rules are as wanted already) and the rules it leaves installed.
type writePlan struct {
	mode  writeMode
	input string
	want  *Ruleset
}

// plan returns the write of mode that turns from into want.
func (f *family) plan(from, want *Ruleset, mode writeMode) writePlan {
	p := writePlan{mode: mode, want: want}
	if mode != writeFull {
		p.input = diffInput(from, want)
		return p
	}
	stale := map[string][]string{}
	for _, table := range []string{"nat", "filter"} {
		for chain := range from.table(table) {
			if _, ok := want.table(table)[chain]; !ok {
				stale[table] = append(stale[table], chain)
			}
		}
	}
	for _, c := range stale {
		sort.Strings(c)
	}
	p.input = want.RestoreInput() + deleteChainsInput(stale)
	return p
}

// commit carries out p: the one place rules are written.
func (f *family) commit(ctx context.Context, p writePlan, log logrus.FieldLogger, start time.Time) error {
	full := p.mode == writeFull // chosen only while the jumps are not known good
	if full {
		// A jump into a chain about to be deleted, or a copy of ours.
		if err := f.pruneJumps(); err != nil {
			return err
		}
	}
	restoreStart := time.Now()
	if p.input != "" {
		if err := f.run(ctx, f.restore, []string{"-w", "--noflush"}, p.input); err != nil {
			return err
		}
	}
	f.installed = p.want
	if full {
		if err := f.ensureJumps(); err != nil {
			return err
		}
		f.jumpsOK = true
	}
	nat, filter := p.want.Count()
	log.WithFields(logrus.Fields{"family": f.fam, "write": writeModeNames[p.mode], "took": time.Since(start).String(),
		"restore": time.Since(restoreStart).String(), "lines": strings.Count(p.input, "\n"), "nat": nat, "filter": filter}).Debug("Rules written")
	return nil
}

// update brings records up to date with frontends, rendering only the
// frontends whose rules differ, and reports whether any rule changed. No map
// of all frontends is built (at 10k service ports that was most of a sync's
// garbage).
func (f *family) update(frontends []config.Frontend) bool {
	if f.records == nil {
		f.records = make(map[feKey]*feRules, len(frontends))
		f.trees = nil
	}
	f.gen++
	var gone, added []leafRule
	changed := false
	for _, fe := range frontends {
		k := feKey{fe.Service.Name, fe.Kind}
		old := f.records[k]
		if old != nil {
			old.seen = f.gen
			if sameRules(old.fe, fe) {
				// The newest Service keeps the comparison above on its
				// pointer fast path.
				old.fe = fe
				continue
			}
			gone = append(gone, old.rules...)
		}
		rec := &feRules{fe: fe, rules: renderFrontend(fe, f.opts), seen: f.gen}
		f.records[k] = rec
		added = append(added, rec.rules...)
		changed = true
	}
	for k, rec := range f.records {
		if rec.seen != f.gen {
			delete(f.records, k)
			gone = append(gone, rec.rules...)
			changed = true
		}
	}
	f.updateTrees(gone, added)
	return changed
}

// updateChanged is update for the frontends of h's service ports alone.
func (f *family) updateChanged(h *hint) bool {
	fresh := make(map[feKey]config.Frontend, len(h.fresh))
	for _, fe := range h.fresh {
		if fe.Family == f.fam && fe.Err == nil {
			fresh[feKey{fe.Service.Name, fe.Kind}] = fe
		}
	}
	var gone, added []leafRule
	changed := false
	done := make(map[config.ServicePortName]bool, len(h.changed))
	for _, name := range h.changed {
		if done[name] {
			continue // listed twice: looked at once
		}
		done[name] = true
		for _, kind := range config.Kinds {
			k := feKey{name, kind}
			old, fe := f.records[k], fresh[k]
			switch {
			case old == nil && fe.Service == nil:
				continue
			case old != nil && fe.Service != nil && sameRules(old.fe, fe):
				old.fe = fe
				continue
			case old != nil:
				gone = append(gone, old.rules...)
				delete(f.records, k)
				changed = true
			}
			if fe.Service != nil {
				rec := &feRules{fe: fe, rules: renderFrontend(fe, f.opts), seen: f.gen}
				f.records[k] = rec
				added = append(added, rec.rules...)
				changed = true
			}
		}
	}
	f.updateTrees(gone, added)
	return changed
}

// maxTreeEdits is the most rules updateTrees moves in place; beyond it,
// sorting every rule again is cheaper than that many insertions.
const maxTreeEdits = 64

// updateTrees takes the rules that are gone out of trees and puts the added
// ones in, keeping each tree sorted.
func (f *family) updateTrees(gone, added []leafRule) {
	if f.trees == nil || len(gone)+len(added) > maxTreeEdits {
		var all []leafRule
		for _, rec := range f.records {
			all = append(all, rec.rules...)
		}
		f.trees = sortedTrees(all)
		return
	}
	for _, l := range gone {
		items := f.trees[l.tree]
		if i, found := slices.BinarySearchFunc(items, treeItem{l.key, l.rule}, compareItems); found {
			f.trees[l.tree] = slices.Delete(items, i, i+1)
		}
	}
	for _, l := range added {
		items := f.trees[l.tree]
		it := treeItem{l.key, l.rule}
		if i, found := slices.BinarySearchFunc(items, it, compareItems); !found {
			f.trees[l.tree] = slices.Insert(items, i, it)
		}
	}
}

// render assembles the chains from the records.
func (f *family) render() *Ruleset { return assembleTrees(f.trees, f.opts) }

// Same reports whether rs and o hold the same chains with the same rules in
// each, in any order. The rules are compared in order first: iptables-save
// prints a chain's rules in the order they were written, so the sets (7.6 MB
// of garbage a check at 10k service ports) are built only for a chain whose
// order differs.
func (rs *Ruleset) Same(o *Ruleset) bool {
	for _, table := range []string{"nat", "filter"} {
		a, b := rs.table(table), o.table(table)
		if len(a) != len(b) {
			return false
		}
		for chain, ra := range a {
			rb, ok := b[chain]
			if !ok {
				return false
			}
			if !slices.Equal(ra, rb) && !sameSet(ra, rb) {
				return false
			}
		}
	}
	return true
}

// sameSet reports whether a and b hold the same rules, in any order.
func sameSet(a, b []string) bool {
	as := make(map[string]bool, len(a))
	for _, r := range a {
		as[r] = true
	}
	bs := make(map[string]bool, len(b))
	for _, r := range b {
		if !as[r] {
			return false
		}
		bs[r] = true
	}
	return len(as) == len(bs)
}

// diffInput renders the iptables-restore --noflush input that turns old into
// want ("" when they are equal): a chain whose rules differ is declared,
// which flushes it, and written again whole — every chain is small, and
// iptables-nft finds a -D's rule by a linear search of its chain — and a chain
// that is gone is flushed and deleted after the chains that jumped to it are
// rewritten.
func diffInput(old, want *Ruleset) string {
	var out strings.Builder
	for _, table := range []string{"nat", "filter"} {
		was, now := old.table(table), want.table(table)
		var changed, gone []string
		for c, rules := range now {
			if prev, ok := was[c]; !ok || !slices.Equal(prev, rules) {
				changed = append(changed, c)
			}
		}
		for c := range was {
			if _, ok := now[c]; !ok {
				gone = append(gone, c)
			}
		}
		if len(changed)+len(gone) == 0 {
			continue
		}
		sort.Strings(changed)
		sort.Strings(gone)
		out.WriteString("*" + table + "\n")
		for _, c := range append(append([]string(nil), changed...), gone...) {
			fmt.Fprintf(&out, ":%s - [0:0]\n", c)
		}
		for _, c := range changed {
			for _, r := range now[c] {
				fmt.Fprintf(&out, "-A %s %s\n", c, r)
			}
		}
		for _, c := range gone {
			fmt.Fprintf(&out, "-X %s\n", c)
		}
		out.WriteString("COMMIT\n")
	}
	return out.String()
}

// live reads our chains with one iptables-save per table, each chain's
// rules in order, and reports whether the jump rules into them are exactly
// the wanted ones; background: for the periodic check (dump).
func (f *family) live(ctx context.Context, background bool) (*Ruleset, bool, error) {
	out := &Ruleset{Nat: map[string][]string{}, Filter: map[string][]string{}}
	jumpsOK := true
	for _, table := range []string{"nat", "filter"} {
		data, err := f.dump(ctx, table, background)
		if err != nil {
			return nil, false, err
		}
		chains := out.table(table)
		want := map[string]int{}
		for _, j := range jumps(f.features) {
			if j.table == table {
				want[j.text()] = 0
			}
		}
		for _, line := range strings.Split(data, "\n") {
			if strings.HasPrefix(line, ":") {
				name, _, _ := strings.Cut(line[1:], " ")
				if isOurs(table, name) {
					chains[name] = []string{}
				}
				continue
			}
			rest, ok := strings.CutPrefix(line, "-A ")
			if !ok {
				continue
			}
			chain, rule, _ := strings.Cut(rest, " ")
			switch {
			case isOurs(table, chain):
				chains[chain] = append(chains[chain], rule)
			case isOurs(table, target(splitRule(rule))):
				n, wanted := want[rest]
				jumpsOK = jumpsOK && wanted && n == 0
				want[rest] = n + 1
			}
		}
		for _, n := range want {
			jumpsOK = jumpsOK && n == 1
		}
	}
	return out, jumpsOK, nil
}

// dump is one table of this family as iptables-save prints it (extra
// arguments: -c for counters). A background dump (the periodic check) runs
// at a low CPU priority: at 10k service ports iptables-save spends ~110 ms of
// CPU, which a rule write or the node's own work should not wait behind.
func (f *family) dump(ctx context.Context, table string, background bool, extra ...string) (string, error) {
	args := append(append([]string(nil), extra...), "-t", table)
	cmd, ctx, done := f.command(ctx, f.save, args)
	defer done()
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Start()
	if err == nil {
		if background {
			// Best effort: it may have run a little at the normal priority.
			_ = unix.Setpriority(unix.PRIO_PROCESS, cmd.Process.Pid, backgroundNice)
		}
		err = cmd.Wait()
	}
	if err != nil {
		return "", f.commandError(ctx, f.save, args, err, stderr.String())
	}
	return stdout.String(), nil
}

// backgroundNice is the nice value of the periodic check's iptables-save.
const backgroundNice = 10

// text renders the jump the way iptables-save prints it, without "-A ".
func (j jump) text() string { return j.chain + " " + j.ruleText() }

// ruleText is the jump's rule as iptables-save prints it after "-A chain".
func (j jump) ruleText() string { return strings.Join(quoteComment(j.rule), " ") }

// quoteComment renders a rule's argv the way iptables-save prints it.
func quoteComment(rule []string) []string {
	out := append([]string(nil), rule...)
	for i := 1; i < len(out); i++ {
		if out[i-1] == "--comment" {
			out[i] = fmt.Sprintf("%q", out[i])
		}
	}
	return out
}

// pruneJumps deletes every jump into our chains from a built-in chain that
// is not a wanted jump, or a second copy of one (an earlier version's guard
// jump, say), so that the chains it led to can be deleted.
func (f *family) pruneJumps() error {
	want := map[string]bool{}
	for _, j := range jumps(f.features) {
		want[j.text()] = true
	}
	for _, table := range []string{"nat", "filter"} {
		if _, err := deleteJumps(f.ipt, table, want); err != nil {
			return err
		}
	}
	return nil
}

// deleteJumps deletes the jumps into our chains from the built-in chains of
// table, but the first copy of each rule in keep (as iptables -S prints it,
// without "-A "), and returns how many it deleted.
func deleteJumps(ipt *goipt.IPTables, table string, keep map[string]bool) (int, error) {
	removed := 0
	for _, builtin := range []string{"PREROUTING", "INPUT", "OUTPUT", "FORWARD", "POSTROUTING"} {
		lines, err := ipt.List(table, builtin)
		if err != nil {
			continue // the table has no such chain
		}
		kept := map[string]bool{}
		for _, line := range lines {
			rest, ok := strings.CutPrefix(line, "-A ")
			args := splitRule(line)
			if !ok || !isOurs(table, target(args)) {
				continue
			}
			if keep[rest] && !kept[rest] {
				kept[rest] = true
				continue
			}
			if err := ipt.Delete(table, builtin, args[2:]...); err != nil {
				return removed, fmt.Errorf("deleting %s %s: %w", table, line, err)
			}
			removed++
		}
	}
	return removed, nil
}

// ensureJumps puts each jump rule in place exactly once: portals first,
// NodePorts last.
func (f *family) ensureJumps() error {
	for _, j := range jumps(f.features) {
		ok, err := f.ipt.Exists(j.table, j.chain, j.rule...)
		if err != nil {
			return fmt.Errorf("checking %s %s jump: %w", j.table, j.chain, err)
		}
		if ok {
			continue
		}
		if j.insert {
			err = f.ipt.Insert(j.table, j.chain, 1, j.rule...)
		} else {
			err = f.ipt.Append(j.table, j.chain, j.rule...)
		}
		if err != nil {
			return fmt.Errorf("adding %s %s jump: %w", j.table, j.chain, err)
		}
	}
	return nil
}
