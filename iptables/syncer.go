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
	"sort"
	"strings"
	"sync"
	"time"

	goipt "github.com/coreos/go-iptables/iptables"
	"github.com/hashicorp/go-multierror"
	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
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

	mu     sync.Mutex // guards shown and counts, for readers of Installed
	shown  map[int]shownRules
	counts map[string]int
}

// shownRules is what Installed renders on demand: rendering 10k frontends'
// rules on every sync only for a debug page would cost more than the sync.
type shownRules struct {
	frontends []proxy.Frontend
	opts      RenderOptions
}

var _ proxy.Rules = (*Rules)(nil)

// family writes the rules of one IP family. Owned by the sync goroutine.
type family struct {
	fam      int
	restore  string
	save     string
	ipt      *goipt.IPTables
	features Features
	// installed is what we believe is in the kernel, per frontend; nil
	// means unknown, so the next sync rewrites everything.
	installed map[feKey]*feRules
	opts      RenderOptions // what installed was rendered with
	jumpsOK   bool
	// nat and filter count the rules in installed.
	nat, filter int
	// gen numbers partial updates; a record not marked with the current one
	// belongs to a frontend that is gone.
	gen uint64
}

type feKey struct {
	name config.ServicePortName
	kind proxy.Kind
}

type feRules struct {
	fe    proxy.Frontend
	rules []chainRule
	seen  uint64 // the last partial update that found this frontend
}

// feChange is a frontend whose rules a partial update changes: rec is its
// new record, nil when the frontend is gone.
type feChange struct {
	key feKey
	rec *feRules
}

// sameRules reports whether a and b render the same rules.
// Sources reuse an unchanged port's pointer, which settles most cases cheaply.
func sameRules(a, b proxy.Frontend) bool {
	return (a.Service == b.Service || a.Service.SameFrontend(b.Service)) && a.Listen == b.Listen &&
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
	r := &Rules{cfg: cfg, log: log, shown: map[int]shownRules{}, counts: map[string]int{}}
	v4, err := newFamily(4, cfg.RestoreCommand, cfg.SaveCommand, cfg.BasicOnly)
	if err != nil {
		return nil, err
	}
	r.families = append(r.families, v4)
	log.WithFields(logrus.Fields{"family": 4, "comment": v4.features.Comment, "addrtype": v4.features.Addrtype, "conntrack": v4.features.Conntrack}).Info("iptables probed")
	if !v4.features.Conntrack {
		log.Warn("WARNING: the conntrack match is missing: proxy listener ports of ClusterIP-only services can be reached from other hosts by connecting to this node's address and the listener port directly. Firewall the node or load xt_conntrack/nf_conntrack.")
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
	f := &family{fam: fam, restore: restore, save: save, ipt: ipt}
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
		return f.run(f.restore, []string{"-w", "--noflush"}, in)
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

func (f *family) run(bin string, args []string, stdin string) error {
	cmd := exec.Command(bin, args...)
	cmd.Stdin = strings.NewReader(stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		if bin == f.restore {
			restoreFailures.Inc()
		}
		return fmt.Errorf("%s %s: %w: %s", bin, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return nil
}

// Sync implements proxy.Rules.
func (r *Rules) Sync(ctx context.Context, frontends []proxy.Frontend, verify bool) error {
	var errs *multierror.Error
	for _, f := range r.families {
		mine := ofFamily(frontends, f.fam)
		opts := f.renderOptions(r.cfg.NodePortAddresses, len(mine))
		nat, filter, err := f.sync(mine, opts, verify, r.log)
		if err != nil {
			errs = multierror.Append(errs, fmt.Errorf("IPv%d: %w", f.fam, err))
			continue
		}
		ruleCount.WithLabelValues("nat", fmt.Sprint(f.fam)).Set(float64(nat))
		ruleCount.WithLabelValues("filter", fmt.Sprint(f.fam)).Set(float64(filter))
		r.mu.Lock()
		r.shown[f.fam] = shownRules{frontends: mine, opts: opts}
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

// ofFamily returns the frontends of family fam that have a listener: the
// given slice itself when that is all of them (never modified: it is the
// proxier's view, and copying 10k frontends was a megabyte per sync).
func ofFamily(frontends []proxy.Frontend, fam int) []proxy.Frontend {
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
	mine := make([]proxy.Frontend, 0, n)
	for _, fe := range frontends {
		if fe.Family == fam && fe.Err == nil {
			mine = append(mine, fe)
		}
	}
	return mine
}

// Installed returns the rules last written per family as iptables-restore
// input, and the rule counts per table/family.
func (r *Rules) Installed() (map[int]string, map[string]int) {
	r.mu.Lock()
	shown := make(map[int]shownRules, len(r.shown))
	for k, v := range r.shown {
		shown[k] = v
	}
	counts := map[string]int{}
	for k, v := range r.counts {
		counts[k] = v
	}
	r.mu.Unlock()
	text := map[int]string{}
	for fam, s := range shown {
		text[fam] = Render(s.frontends, s.opts).RestoreInput()
	}
	return text, counts
}

// renderOptions returns the options for n frontends; a change of options
// (node addresses, shard layout) makes the next sync a full rewrite.
func (f *family) renderOptions(cidrs []netip.Prefix, n int) RenderOptions {
	o := RenderOptions{Family: f.fam, Features: f.features}
	if o.Shards = ShardsFor(n); f.opts.Shards > 0 && n >= shardBelow {
		o.Shards = f.opts.Shards
	}
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

// sync writes the rules of frontends: only the rules of frontends that
// changed (-D/-A lines) when it knows the kernel's state, a full rewrite of our
// chains otherwise, or when verify finds the live rules differ. It returns
// the rule counts per table.
func (f *family) sync(frontends []proxy.Frontend, opts RenderOptions, verify bool, log logrus.FieldLogger) (nat, filter int, err error) {
	if f.installed != nil && !reflect.DeepEqual(opts, f.opts) {
		f.installed = nil // node addresses changed: every NodePort rule may
	}
	if verify && f.installed != nil {
		live, jumps, err := f.live()
		if err != nil {
			return 0, 0, err
		}
		if !equalSets(live, f.installedSets()) || !jumps {
			log.WithField("family", f.fam).Warn("Rules changed behind our back; rewriting them")
			f.installed, f.jumpsOK = nil, jumps
		}
	}
	if f.installed != nil {
		start := time.Now()
		changes, in, dels := f.partial(frontends, opts)
		// iptables-nft finds each -D's rule by a linear search of the
		// chain: 20k deletions at 10k services took 50 s, a rewrite 0.5 s.
		if dels <= maxPartialDeletes {
			if in == "" {
				f.apply(changes)
				return f.nat, f.filter, nil
			}
			restoreStart := time.Now()
			err := f.run(f.restore, []string{"-w", "--noflush"}, in)
			if err == nil {
				f.apply(changes)
				log.WithFields(logrus.Fields{"family": f.fam, "took": time.Since(start).String(),
					"restore": time.Since(restoreStart).String(), "lines": strings.Count(in, "\n")}).Debug("Rules updated")
				return f.nat, f.filter, nil
			}
			log.WithError(err).Warn("Partial rule update failed; rewriting all rules")
		}
	}
	start := time.Now()
	next := make(map[feKey]*feRules, len(frontends))
	for _, fe := range frontends {
		next[feKey{fe.Service.Name, fe.Kind}] = &feRules{fe: fe, rules: renderFrontend(fe, opts)}
	}
	in := Render(frontends, opts).RestoreInput()
	if opts.Shards == 0 && (f.installed == nil || f.opts.Shards != 0) {
		in += deleteChainsInput(shardChains(opts.Features)) // a sharded layout may be left over
	}
	if err := f.run(f.restore, []string{"-w", "--noflush"}, in); err != nil {
		f.installed = nil
		return 0, 0, err
	}
	f.installed, f.opts = next, opts
	f.nat, f.filter = f.counts()
	if !f.jumpsOK {
		if err := f.ensureJumps(); err != nil {
			return 0, 0, err
		}
		f.jumpsOK = true
	}
	log.WithFields(logrus.Fields{"family": f.fam, "took": time.Since(start).String(), "nat": f.nat, "filter": f.filter}).Debug("Rules written")
	return f.nat, f.filter, nil
}

// counts counts the rules in installed.
func (f *family) counts() (nat, filter int) {
	for _, fr := range f.installed {
		n, fl := fr.counts()
		nat, filter = nat+n, filter+fl
	}
	return nat, filter
}

func (fr *feRules) counts() (nat, filter int) {
	for _, r := range fr.rules {
		if r.table == "nat" {
			nat++
		} else {
			filter++
		}
	}
	return nat, filter
}

// apply records changes, written to the kernel, in installed.
func (f *family) apply(changes []feChange) {
	for _, c := range changes {
		if old := f.installed[c.key]; old != nil {
			n, fl := old.counts()
			f.nat, f.filter = f.nat-n, f.filter-fl
		}
		if c.rec == nil {
			delete(f.installed, c.key)
			continue
		}
		f.installed[c.key] = c.rec
		n, fl := c.rec.counts()
		f.nat, f.filter = f.nat+n, f.filter+fl
	}
}

// maxPartialDeletes is the most -D lines a partial update may hold; beyond
// it a full rewrite is cheaper.
const maxPartialDeletes = 100

// partial returns the changes to installed and the restore input that makes
// them ("" when no rule changes), and the number of -D lines in it. Only the
// frontends whose rules differ are rendered; installed itself is changed (by
// apply) only once the input is written, and no map of all frontends is
// built (at 10k service ports that was most of a sync's garbage).
func (f *family) partial(frontends []proxy.Frontend, opts RenderOptions) ([]feChange, string, int) {
	f.gen++
	var changes []feChange
	var dels, adds []chainRule
	for _, fe := range frontends {
		k := feKey{fe.Service.Name, fe.Kind}
		old := f.installed[k]
		if old != nil {
			old.seen = f.gen
			if sameRules(old.fe, fe) {
				// Same rules: the newest Service keeps the comparison
				// above on its pointer fast path; safe to record even if
				// the write below fails.
				old.fe = fe
				continue
			}
			dels = append(dels, old.rules...)
		}
		fr := &feRules{fe: fe, rules: renderFrontend(fe, opts), seen: f.gen}
		changes = append(changes, feChange{k, fr})
		adds = append(adds, fr.rules...)
	}
	for k, old := range f.installed {
		if old.seen != f.gen {
			changes = append(changes, feChange{k, nil})
			dels = append(dels, old.rules...)
		}
	}
	return changes, partialInput(dels, adds), len(dels)
}

// installedSets returns installed as table/chain → rule set, the form live
// rules are compared in.
func (f *family) installedSets() map[string]map[string]bool {
	out := map[string]map[string]bool{}
	for _, table := range []string{"nat", "filter"} {
		for c := range chainsOf(table, f.opts) {
			out[table+"/"+c] = map[string]bool{}
		}
	}
	for _, r := range skeleton(f.opts) {
		out[r.table+"/"+r.chain][r.rule] = true
	}
	for _, fr := range f.installed {
		for _, r := range fr.rules {
			out[r.table+"/"+r.chain][r.rule] = true
		}
	}
	return out
}

func equalSets(a, b map[string]map[string]bool) bool {
	if len(a) != len(b) {
		return false
	}
	for k, as := range a {
		bs, ok := b[k]
		if !ok || len(as) != len(bs) {
			return false
		}
		for r := range as {
			if !bs[r] {
				return false
			}
		}
	}
	return true
}

// partialInput renders -D lines for dels and -A lines for adds, by table
// ("" when both are empty). A rule in both is left alone. Rules of different
// service ports never overlap, so their order inside a chain does not matter.
func partialInput(dels, adds []chainRule) string {
	inAdds := make(map[chainRule]bool, len(adds))
	for _, r := range adds {
		inAdds[r] = true
	}
	inDels := make(map[chainRule]bool, len(dels))
	for _, r := range dels {
		inDels[r] = true
	}
	var out strings.Builder
	for _, table := range []string{"nat", "filter"} {
		var b strings.Builder
		for _, r := range dels {
			if r.table == table && !inAdds[r] {
				fmt.Fprintf(&b, "-D %s %s\n", r.chain, r.rule)
			}
		}
		for _, r := range adds {
			if r.table == table && !inDels[r] {
				fmt.Fprintf(&b, "-A %s %s\n", r.chain, r.rule)
			}
		}
		if b.Len() > 0 {
			out.WriteString("*" + table + "\n" + b.String() + "COMMIT\n")
		}
	}
	return out.String()
}

// live reads our chains with one iptables-save per table and reports
// whether every jump rule is present.
func (f *family) live() (map[string]map[string]bool, bool, error) {
	out := map[string]map[string]bool{}
	jumpsFound := true
	for _, table := range []string{"nat", "filter"} {
		cmd := exec.Command(f.save, "-t", table)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		data, err := cmd.Output()
		if err != nil {
			return nil, false, fmt.Errorf("%s -t %s: %w: %s", f.save, table, err, strings.TrimSpace(stderr.String()))
		}
		ours := chainsOf(table, f.opts)
		var builtin []string
		for _, line := range strings.Split(string(data), "\n") {
			if strings.HasPrefix(line, ":") {
				name, _, _ := strings.Cut(line[1:], " ")
				if ours[name] {
					out[table+"/"+name] = map[string]bool{}
				}
				continue
			}
			rest, ok := strings.CutPrefix(line, "-A ")
			if !ok {
				continue
			}
			chain, rule, _ := strings.Cut(rest, " ")
			if ours[chain] {
				if out[table+"/"+chain] == nil {
					out[table+"/"+chain] = map[string]bool{}
				}
				out[table+"/"+chain][rule] = true
			} else {
				builtin = append(builtin, chain+" "+rule)
			}
		}
		for _, j := range jumps(f.features) {
			if j.table != table {
				continue
			}
			want := j.chain + " " + strings.Join(quoteComment(j.rule), " ")
			found := false
			for _, b := range builtin {
				found = found || b == want
			}
			jumpsFound = jumpsFound && found
		}
	}
	return out, jumpsFound, nil
}

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
