package iptables

// Trace walks one packet through our chains the way netfilter would, rule by
// rule, over the rule text as rendered (or as installed): explain's answer
// to "which rule catches this packet". It understands exactly the matches
// this package writes; a rule with anything else is reported, never guessed.

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// Packet is the first packet of a connection or flow, as the node sees it.
type Packet struct {
	Src, Dst netip.Addr
	Port     int    // destination port
	Protocol string // "tcp" or "udp"
	// FromNode: the node itself sends it (nat OUTPUT); otherwise it arrives
	// from a pod or another host (nat PREROUTING).
	FromNode bool
	// DstLocal: Dst is one of the node's addresses (-m addrtype --dst-type LOCAL).
	DstLocal bool
	// InInterface is the interface a packet from a pod or another host
	// arrives on ("": unknown, matching no -i but lo's negation), for the
	// local-traffic detection by interface.
	InInterface string
}

// Counter is a rule's packet and byte counts, as iptables-save -c prints them.
type Counter struct {
	Packets uint64 `json:"packets"`
	Bytes   uint64 `json:"bytes"`
}

// Step is one rule of ours a packet matched, or one chain it passed through
// without a match.
type Step struct {
	Table string `json:"table"`
	Chain string `json:"chain"`
	// Rule is the matching rule as iptables-save prints it after "-A chain";
	// empty when the packet left the chain without a match.
	Rule string `json:"rule,omitempty"`
	// Tested is how many rules of the chain the packet was tested against.
	Tested int `json:"tested"`
	// Counter is the rule's counter when the rules were read from the
	// kernel (nil otherwise).
	Counter *Counter `json:"counter,omitempty"`
	Note    string   `json:"note,omitempty"`
}

// Verdict is where our rules send the packet.
type Verdict struct {
	// Target is REDIRECT, DNAT, DROP, RETURN (the guard let it through)
	// or "" (no rule of ours matched: the packet goes on unchanged).
	Target string `json:"target,omitempty"`
	// ToPort is the port a REDIRECT or DNAT sends it to (a placeholder
	// when the rules were rendered before any listener existed).
	ToPort string `json:"toPort,omitempty"`
	// ToAddr is DNAT's address.
	ToAddr string `json:"toAddr,omitempty"`
}

// TraceResult is a packet's way through our nat chains and then, if it is
// delivered to the node, the filter guard.
type TraceResult struct {
	// Hook is the built-in chain the packet enters by: PREROUTING or OUTPUT.
	Hook string  `json:"hook"`
	Nat  []Step  `json:"nat"`
	NAT  Verdict `json:"natVerdict"`
	// FilterHook is the filter chain where the walk ended: INPUT, FORWARD
	// or OUTPUT.
	FilterHook string `json:"filterHook,omitempty"`
	// Guard is the walk through our filter chains: the proxy-port guard
	// and the source-range drops.
	Guard []Step `json:"filter,omitempty"`
	// Filter is their verdict: DROP, RETURN (an exception of the guard let
	// it through), or "" (no rule of ours stopped it).
	Filter Verdict `json:"filterVerdict"`
	// Walked is the number of rules of ours in nat the packet was tested
	// against: what it costs, growing with log16 of the Service count.
	Walked int `json:"natRulesWalked"`
}

// TraceInput is what a trace walks: one family's rules, the features they
// were rendered with, and optionally the kernel's counters keyed by
// "table/chain rule".
type TraceInput struct {
	Rules    *Ruleset
	Features Features
	Counters map[string]Counter
}

// Trace walks p through in's rules.
func Trace(in TraceInput, p Packet) TraceResult {
	t := tracer{in: in, p: p}
	res := TraceResult{Hook: "PREROUTING"}
	if p.FromNode {
		res.Hook = "OUTPUT"
	}
	var v Verdict
	for _, j := range jumps(in.Features) {
		if j.table != "nat" || j.chain != res.Hook {
			continue
		}
		// The first jump of a hook leads to the portals; the last, to
		// the NodePorts (only for local destinations with addrtype).
		ok, note := t.matches(j.rule, false)
		if !ok {
			t.nat = append(t.nat, Step{Table: "nat", Chain: res.Hook, Rule: j.ruleText(), Note: "not taken: " + note})
			continue
		}
		t.nat = append(t.nat, Step{Table: "nat", Chain: res.Hook, Rule: j.ruleText()})
		if v = t.walk("nat", target(j.rule), false, &t.nat, 0); v.Target != "" {
			break
		}
	}
	res.Nat, res.NAT, res.Walked = t.nat, v, t.walked
	// Then the filter table: OUTPUT for the node's own packets, INPUT for
	// what is delivered to the node (redirected, or to its own address),
	// FORWARD for what is routed on. A redirected packet carries the
	// conntrack state DNAT.
	redirected := v.Target == "REDIRECT" || v.Target == "DNAT"
	if redirected {
		// The filter table sees the rewritten destination: the proxy port
		// on the node (REDIRECT: the address it arrived on, which is no
		// Service address) or DNAT's.
		t.p.Dst, t.p.DstLocal = netip.Addr{}, true
		if a, err := netip.ParseAddr(v.ToAddr); err == nil {
			t.p.Dst = a
		}
		t.p.Port, _ = strconv.Atoi(v.ToPort) // a placeholder: 0
	}
	var hooks []string
	if p.FromNode {
		hooks = append(hooks, "OUTPUT")
	}
	if redirected || p.DstLocal {
		hooks = append(hooks, "INPUT")
	} else if !p.FromNode {
		hooks = append(hooks, "FORWARD")
	}
	for _, hook := range hooks {
		res.FilterHook = hook
		for _, j := range jumps(in.Features) {
			if j.table != "filter" || j.chain != hook {
				continue
			}
			if ok, _ := t.matches(j.rule, redirected); !ok {
				continue
			}
			t.guard = append(t.guard, Step{Table: "filter", Chain: hook, Rule: j.ruleText()})
			fv := t.walk("filter", target(j.rule), redirected, &t.guard, 0)
			if fv.Target == "RETURN" {
				res.Filter = fv // an exception of the guard: on to the next jump
				continue
			}
			if fv.Target != "" {
				res.Filter = fv
				res.Guard = t.guard
				return res
			}
		}
	}
	res.Guard = t.guard
	return res
}

type tracer struct {
	in         TraceInput
	p          Packet
	nat, guard []Step
	walked     int
}

// walk runs the packet through chain and the chains it jumps to; it returns
// the terminal verdict, or "" when the packet returns from chain.
func (t *tracer) walk(table, chain string, dnat bool, steps *[]Step, depth int) Verdict {
	rules := t.in.Rules.table(table)[chain]
	if depth > 32 { // our trees are log16(N) deep; a loop would be a bug
		*steps = append(*steps, Step{Table: table, Chain: chain, Note: "too deep: stopped"})
		return Verdict{}
	}
	for i, rule := range rules {
		t.walked++
		args := splitRule(rule)
		ok, note := t.matches(args, dnat)
		if note != "" && strings.HasPrefix(note, "unsupported") {
			*steps = append(*steps, Step{Table: table, Chain: chain, Rule: rule, Tested: i + 1, Note: note})
		}
		if !ok {
			continue
		}
		step := Step{Table: table, Chain: chain, Rule: rule, Tested: i + 1}
		if c, found := t.in.Counters[table+"/"+chain+" "+rule]; found {
			step.Counter = &c
		}
		*steps = append(*steps, step)
		switch tgt := target(args); tgt {
		case "REDIRECT":
			return Verdict{Target: tgt, ToPort: optionValue(args, "--to-ports")}
		case "DNAT":
			to := optionValue(args, "--to-destination")
			addr, port := to, ""
			if ap, err := netip.ParseAddrPort(to); err == nil {
				addr, port = ap.Addr().String(), strconv.Itoa(int(ap.Port()))
			} else if i := strings.LastIndex(to, ":"); i > 0 {
				addr, port = strings.Trim(to[:i], "[]"), to[i+1:]
			}
			return Verdict{Target: tgt, ToAddr: addr, ToPort: port}
		case "DROP", "ACCEPT", "REJECT":
			return Verdict{Target: tgt}
		case "RETURN":
			return Verdict{Target: "RETURN"}
		default:
			if v := t.walk(table, tgt, dnat, steps, depth+1); v.Target != "" && v.Target != "RETURN" {
				return v
			} else if v.Target == "RETURN" && table == "filter" {
				return v // the guard's exceptions end the guard
			}
		}
	}
	*steps = append(*steps, Step{Table: table, Chain: chain, Tested: len(rules), Note: "no rule matched: back to the calling chain"})
	return Verdict{}
}

// matches tests the rule's conditions against the packet; note says why not
// (or that a match is not one this tracer knows).
func (t *tracer) matches(args []string, dnat bool) (bool, string) {
	p := t.p
	for i := 0; i < len(args); i++ {
		neg := false
		if args[i] == "!" {
			neg = true
			i++
			if i >= len(args) {
				break
			}
		}
		opt := args[i]
		val := ""
		if i+1 < len(args) {
			val = args[i+1]
		}
		var ok bool
		switch opt {
		case "-j", "--to-ports", "--to-destination", "--comment", "-m":
			i++
			continue
		case "-d", "-s":
			pfx, err := netip.ParsePrefix(val)
			if err != nil {
				return false, fmt.Sprintf("unsupported address %q", val)
			}
			addr := p.Dst
			if opt == "-s" {
				addr = p.Src
			}
			ok = pfx.Contains(addr)
		case "-p":
			ok = strings.EqualFold(val, p.Protocol)
		case "--dport":
			lo, hi, err := portRange(val)
			if err != nil {
				return false, "unsupported port " + val
			}
			ok = p.Port >= lo && p.Port <= hi
		case "-i":
			if val == "lo" {
				ok = p.FromNode // the node's own packets to itself come in on lo
			} else if prefix, isPrefix := strings.CutSuffix(val, "+"); isPrefix {
				ok = !p.FromNode && p.InInterface != "" && strings.HasPrefix(p.InInterface, prefix)
			} else {
				ok = !p.FromNode && p.InInterface == val
			}
		case "--dst-type":
			ok = val == "LOCAL" && p.DstLocal
		case "--ctstate":
			// Our rules test NEW (every traced packet is a first one)
			// and DNAT (set once a nat rule redirected it).
			ok = false
			for _, s := range strings.Split(val, ",") {
				ok = ok || s == "NEW" || (s == "DNAT" && dnat)
			}
		default:
			return false, "unsupported match " + opt + " (rule not evaluated)"
		}
		i++
		if ok == neg {
			if neg {
				opt = "! " + opt
			}
			return false, fmt.Sprintf("%s %s does not match", opt, val)
		}
	}
	return true, ""
}

func portRange(s string) (lo, hi int, err error) {
	a, b, isRange := strings.Cut(s, ":")
	if lo, err = strconv.Atoi(a); err != nil {
		return 0, 0, err
	}
	hi = lo
	if isRange {
		if hi, err = strconv.Atoi(b); err != nil {
			return 0, 0, err
		}
	}
	return lo, hi, nil
}

func optionValue(args []string, opt string) string {
	for i := 0; i+1 < len(args); i++ {
		if args[i] == opt {
			return args[i+1]
		}
	}
	return ""
}
