package iptables

// One IP family's rules: its records of what each frontend renders, the
// plan of a write, and the one commit that carries it out.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"time"

	goipt "github.com/coreos/go-iptables/iptables"
	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

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

// feKey names the rules of one frontend in a family's records.
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
	parent := ctx
	cmd, ctx, done := f.command(ctx, bin, args)
	defer done()
	cmd.Stdin = strings.NewReader(stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		if bin == f.restore && parent.Err() == nil { // one stopped (shutdown, handover) did not fail
			restoreFailures.WithLabelValues(familyName(f.fam)).Inc()
		}
		return f.commandError(ctx, bin, args, err, stderr.String())
	}
	return nil
}

// sync writes the rules of frontends: it brings the records up to date,
// plans the write from what is installed or live (writePlan), and commits
// the plan. It returns the rule counts per table.
func (f *family) sync(
	ctx context.Context,
	frontends []config.Frontend,
	opts RenderOptions,
	verify bool,
	h *hint,
	log logrus.FieldLogger,
) (nat, filter int, err error) {
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
		if nat, filter, err = f.commit(ctx, f.plan(f.installed, want, writeDiff), log, start); err == nil {
			return nat, filter, nil
		}
		if ctx.Err() != nil {
			// Stopped (a shutdown, a handover), not failed: the next write,
			// if any, reads what the kernel has.
			f.installed = nil
			log.WithError(err).WithField("family", f.fam).Info("Rule write stopped; the rules are what the kernel holds")
			return 0, 0, err
		}
		partialRestoreFailures.WithLabelValues(familyName(f.fam)).Inc()
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
	if nat, filter, err = f.commit(ctx, f.plan(live, want, mode), log, start); err != nil {
		f.installed = nil
		return 0, 0, err
	}
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
func (f *family) commit(ctx context.Context, p writePlan, log logrus.FieldLogger, start time.Time) (nat, filter int, err error) {
	full := p.mode == writeFull // chosen only while the jumps are not known good
	if full {
		// A jump into a chain about to be deleted, or a copy of ours.
		if err := f.pruneJumps(); err != nil {
			return 0, 0, err
		}
	}
	restoreStart := time.Now()
	if p.input != "" {
		if err := f.run(ctx, f.restore, []string{"-w", "--noflush"}, p.input); err != nil {
			return 0, 0, err
		}
	}
	f.installed = p.want
	countWritten(f.fam, p.input)
	if full {
		if err := f.ensureJumps(); err != nil {
			return 0, 0, err
		}
		f.jumpsOK = true
	}
	nat, filter = p.want.Count()
	log.WithFields(logrus.Fields{"family": f.fam, "write": writeModeNames[p.mode], "took": time.Since(start).String(),
		"restore": time.Since(restoreStart).String(), "lines": strings.Count(p.input, "\n"), "nat": nat, "filter": filter}).Debug("Rules written")
	return nat, filter, nil
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
