package daemon

// The explain answer in words, for a person at a terminal.

import (
	"fmt"
	"io"
	"net/netip"
	"strings"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
)

// writeExplainText prints an answer for people, step by step.
func writeExplainText(w io.Writer, a explainAnswer) {
	what := "connection"
	if a.Protocol == config.UDP {
		what = "flow (its first datagram)"
	}
	fmt.Fprintf(w, "A new %s %s from %s to %s", a.Protocol, what, a.From, a.To)
	if a.Offline {
		fmt.Fprintf(w, " (explained from manifests, node %q: nothing is running)", a.Node)
	}
	fmt.Fprintln(w)
	step := 0
	say := func(format string, args ...any) {
		step++
		fmt.Fprintf(w, "%2d. %s\n", step, fmt.Sprintf(format, args...))
	}
	if r := a.Rules; r != nil {
		if a.Origin == "node" {
			say("The node itself sends it: its first packet enters nat OUTPUT.")
		} else {
			say("It comes from a pod or another host: its first packet enters nat PREROUTING.")
		}
		for _, s := range r.Nat {
			describeStep(say, s)
		}
		switch r.NAT.Target {
		case "REDIRECT", "DNAT":
		default:
			say("No rule of ours in nat matched (%s of ours tested).", plural(r.Walked, "rule"))
		}
		for _, s := range r.Guard {
			describeStep(say, s)
		}
	}
	say("%s.", upperFirst(a.Delivery))
	if x := a.Service; x != nil {
		listen := x.Listen
		if listen == "" {
			listen = "(not open: offline)"
		}
		say("Listener %s serves %s %s (IPv%d, %s): %s is its %s.", listen, x.Service, x.Protocol, x.Family, x.Kind, a.To, x.As)
		policy := "traffic policy " + x.TrafficPolicy
		if x.TrafficPolicy == "Local" {
			policy += fmt.Sprintf(" (only endpoints on node %q)", x.Node)
		}
		if x.LocalClient {
			policy += " (externalTrafficPolicy is Local, but the client is on this node: every endpoint, as kube-proxy's short-circuit)"
		}
		say("It dials one endpoint of the Service port: %s, scheduler %s.", policy, x.Scheduler)
		switch {
		case x.Topology != "":
			say("Topology: the endpoints' hints are used (%s): only those hinted for this node (%s, zone %q) are picked.", x.Topology, x.Node, x.Zone)
		case x.TrafficDistribution != "" && x.TrafficPolicy == "Cluster":
			say("Topology: trafficDistribution %s, but the hints are not used (not every endpoint has them, or none is for this node's zone %q): every endpoint counts.", x.TrafficDistribution, x.Zone)
		}
		for _, e := range x.Endpoints {
			state := "not selected"
			if e.Selected {
				state = "SELECTED"
			}
			line := fmt.Sprintf("      %-24s %-12s %s", e.Address, state, e.Why)
			if e.Node != "" {
				line += ", node " + e.Node
			}
			if h := e.Health; h != nil {
				line += fmt.Sprintf(", %d open", h.Active)
				if h.EjectedUntil != nil {
					line += fmt.Sprintf(", EJECTED until %s", h.EjectedUntil.Format(time.RFC3339))
				} else if h.Failures > 0 {
					line += fmt.Sprintf(", %d failed dial(s) in a row", h.Failures)
				}
				if h.Drained {
					line += ", DRAINED"
				}
			}
			fmt.Fprintln(w, line)
		}
		describeNext(say, a.From, x)
	}
	for _, n := range a.Notes {
		fmt.Fprintf(w, "Note: %s\n", n)
	}
}

func describeStep(say func(string, ...any), s iptables.Step) {
	counter := ""
	if s.Counter != nil {
		counter = fmt.Sprintf("  [%d packets, %d bytes so far]", s.Counter.Packets, s.Counter.Bytes)
	}
	switch {
	case s.Rule == "" && s.Chain == iptables.ChainGuard:
		say("%s %s: no rule matched, the packet passes (%s tested).", s.Table, s.Chain, plural(s.Tested, "rule"))
	case s.Rule == "":
		say("%s %s: %s (%s tested).", s.Table, s.Chain, s.Note, plural(s.Tested, "rule"))
	case strings.HasPrefix(s.Note, "not taken"):
		say("%s %s: our jump is %s: -A %s %s", s.Table, s.Chain, s.Note, s.Chain, s.Rule)
	case s.Note != "":
		say("%s %s: %s: -A %s %s", s.Table, s.Chain, s.Note, s.Chain, s.Rule)
	case s.Tested == 0:
		say("%s %s jumps to our chain: -A %s %s%s", s.Table, s.Chain, s.Chain, s.Rule, counter)
	default:
		say("%s %s, rule %d matches: -A %s %s%s", s.Table, s.Chain, s.Tested, s.Chain, s.Rule, counter)
	}
}

func describeNext(say func(string, ...any), client string, x *proxy.Explanation) {
	n := x.Next
	if x.BackendSees != "" {
		say("The backend sees %s.", x.BackendSees)
	}
	if n.Pin != nil {
		if n.PinIgnored != "" {
			say(
				"Affinity: %s was pinned to %s until %s; the pin is not followed: %s.",
				client,
				n.Pin.Endpoint,
				n.Pin.Expires.Format(time.RFC3339),
				n.PinIgnored,
			)
		} else {
			say("Affinity: %s is pinned to %s until %s (ClientIP, timeout %s).", client, n.Pin.Endpoint, n.Pin.Expires.Format(time.RFC3339), x.AffinityTimeout)
		}
	} else if x.AffinityTimeout != "" {
		say("Affinity: ClientIP for %s; %s has no pin yet, so the connection it makes pins it.", x.AffinityTimeout, client)
	}
	switch {
	case n.Endpoint != nil:
		why := string(n.Reason)
		if n.Position != nil && n.Reason != balance.ReasonAffinity {
			why += fmt.Sprintf(", rotation at index %d of the sorted endpoints", *n.Position)
		}
		say("The next connection from %s goes to %s (%s).", client, *n.Endpoint, why)
	case len(n.Candidates) > 0 && x.Scheduler == balance.SchedRandom:
		say("The next connection goes to one of %d endpoints, at random: %s.", len(n.Candidates), joinAddrs(n.Candidates))
	case len(n.Candidates) > 0:
		say("The first connection goes to one of %s (%s): a new listener starts its rotation at a random endpoint, so that nodes do not all pick the same one first; the running daemon's explain (--server) knows which.",
			joinAddrs(n.Candidates), n.Reason)
	default:
		say("No endpoint can take it: the connection is refused (TCP reset) or the datagram dropped.")
	}
}

func joinAddrs(a []netip.AddrPort) string {
	s := make([]string, len(a))
	for i, x := range a {
		s[i] = x.String()
	}
	return strings.Join(s, " ")
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

func upperFirst(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}
