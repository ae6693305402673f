package iptables

import (
	"context"
	"fmt"
	"strconv"
	"strings"
)

// Counters reads the kernel's packet and byte counters of every rule in our
// chains of family fam (one iptables-save -c per table), keyed by
// "table/chain rule" with the rule as iptables-save prints it.
func (r *Rules) Counters(fam int) (map[string]Counter, error) {
	f := r.family(fam)
	if f == nil {
		return nil, fmt.Errorf("no IPv%d rules on this node", fam)
	}
	out := map[string]Counter{}
	for _, table := range []string{"nat", "filter"} {
		data, err := f.dump(context.Background(), table, false, "-c")
		if err != nil {
			return nil, err
		}
		parseCounters(table, data, out)
	}
	return out, nil
}

// parseCounters adds the counters of our chains' rules in one table's
// iptables-save -c output ("[packets:bytes] -A CHAIN rule") to out.
func parseCounters(table, save string, out map[string]Counter) {
	for _, line := range strings.Split(save, "\n") {
		if !strings.HasPrefix(line, "[") {
			continue
		}
		counts, rest, ok := strings.Cut(line[1:], "] -A ")
		if !ok {
			continue
		}
		chain, rule, _ := strings.Cut(rest, " ")
		if !isOurs(table, chain) {
			continue
		}
		p, b, _ := strings.Cut(counts, ":")
		packets, err1 := strconv.ParseUint(p, 10, 64)
		byteCount, err2 := strconv.ParseUint(b, 10, 64)
		if err1 == nil && err2 == nil {
			out[table+"/"+chain+" "+rule] = Counter{Packets: packets, Bytes: byteCount}
		}
	}
}

// TraceInput returns family fam's rules as last written, with the
// kernel's counters when counters is true; ok is false when the family has
// no rules yet.
func (r *Rules) TraceInput(fam int, counters bool) (TraceInput, bool, error) {
	f := r.family(fam)
	r.mu.Lock()
	rs := r.shown[fam]
	r.mu.Unlock()
	if f == nil || rs == nil {
		return TraceInput{}, false, nil
	}
	in := TraceInput{Rules: rs, Features: f.features}
	if counters {
		c, err := r.Counters(fam)
		if err != nil {
			return in, true, err
		}
		in.Counters = c
	}
	return in, true, nil
}

// family returns the syncer of family fam, or nil. The families are fixed
// once New returns.
func (r *Rules) family(fam int) *family {
	for _, f := range r.families {
		if f.fam == fam {
			return f
		}
	}
	return nil
}
