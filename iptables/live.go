package iptables

// The kernel's side: the rules installed now, read back with
// iptables-save, compared with the wanted ones, and the jumps into our
// chains pruned and repaired.

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"

	goipt "github.com/coreos/go-iptables/iptables"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

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
			_ = kernel.Renice(cmd.Process.Pid, backgroundNice)
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
