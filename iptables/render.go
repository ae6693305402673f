// Package iptables redirects Service addresses into the proxy's listeners with
// nat-table rules written in bulk by iptables-restore, checks them against
// iptables-save every sync period, and removes them on --cleanup.
//
// Typical use:
//
//	r, err := iptables.New(iptables.Config{Log: log})   // probes the kernel
//	p := proxy.New(proxy.Config{Rules: r, ...})          // the proxier calls r.Sync
//	iptables.Cleanup(log)                                // --cleanup
//
// The rule text comes from Render, a pure function, so the rules for a
// manifests file can be shown without root (--show-rules).
//
// It owns the nat and filter rules it installs and the UDP conntrack
// entries it cleans; it imports config and the kernel layer (package
// proxy/kernel), never package proxy: cmd wires the two.
package iptables

import (
	"fmt"
	"net/netip"
	"sort"
	"strings"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
)

// The chains. Portals (ClusterIPs, externalIPs, LoadBalancer IPs) are jumped
// to first; NodePorts last, so that a Service address that happens to be a
// node address is handled as a portal.
const (
	ChainPortalsContainer  = "KUBE-PORTALS-CONTAINER"  // nat PREROUTING: from pods and other hosts
	ChainPortalsHost       = "KUBE-PORTALS-HOST"       // nat OUTPUT: from the node itself
	ChainNodePortContainer = "KUBE-NODEPORT-CONTAINER" // nat PREROUTING, last
	ChainNodePortHost      = "KUBE-NODEPORT-HOST"      // nat OUTPUT, last
	// ChainLocalPortals and ChainLocalNodePorts send clients on this node
	// (the node itself, pods the local-traffic detection finds) to the
	// frontend with every endpoint when they reach the external addresses
	// of an externalTrafficPolicy: Local Service: kube-proxy's
	// short-circuit. Jumped to first from the chains above, for such
	// clients only; they exist while they have rules.
	ChainLocalPortals   = "KUBE-PORTALS-LOCAL"
	ChainLocalNodePorts = "KUBE-NODEPORT-LOCAL"
	ChainGuard          = "KUBE-PORTALS-GUARD" // filter INPUT: proxy ports only via a redirect
	// ChainSourceRanges drops what reaches a LoadBalancer IP with
	// loadBalancerSourceRanges without having been redirected: the clients
	// outside the ranges (filter INPUT, FORWARD and OUTPUT).
	ChainSourceRanges = "KUBE-SOURCE-RANGES"
	chainProbe        = "KUBE-PORTALS-PROBE" // created and deleted while probing
)

var natChains = []string{ChainPortalsContainer, ChainPortalsHost, ChainNodePortContainer, ChainNodePortHost}

// Name prefixes of the tree chains below the entry chains (see tree.go).
const (
	chainPortalTree   = "KUBE-PT-" // + the address prefix in hex
	chainRangeTree    = "KUBE-SR-" // + the address prefix in hex (source ranges)
	chainNodePortTree = "KUBE-NP-" // + TCP-/UDP- + the port prefix in hex
	// The trees of the short-circuit for clients on this node.
	chainLocalPortalTree   = "KUBE-LPT-" // + the address prefix in hex
	chainLocalNodePortTree = "KUBE-LNP-" // + TCP-/UDP- + the port prefix in hex
)

// isOurs reports whether a chain of table is one the daemon creates, this
// version or an earlier one (whose 32 shard chains, KUBE-PORTALS-HOST-1F and
// the like, --cleanup and a full rewrite remove).
func isOurs(table, name string) bool {
	switch table {
	case "nat":
		if name == chainProbe || name == ChainLocalPortals || name == ChainLocalNodePorts ||
			strings.HasPrefix(name, chainPortalTree) || strings.HasPrefix(name, chainNodePortTree) ||
			strings.HasPrefix(name, chainLocalPortalTree) || strings.HasPrefix(name, chainLocalNodePortTree) {
			return true
		}
		for _, c := range natChains {
			if name == c || isShardOf(name, c) {
				return true
			}
		}
	case "filter":
		return name == ChainGuard || isShardOf(name, ChainGuard) || name == ChainSourceRanges || strings.HasPrefix(name, chainRangeTree)
	}
	return false
}

// isShardOf reports whether name is a shard chain of an earlier version.
func isShardOf(name, chain string) bool {
	rest, ok := strings.CutPrefix(name, chain+"-")
	return ok && len(rest) == 2 && strings.Trim(rest, "0123456789ABCDEF") == ""
}

// deleteChainsInput renders an iptables-restore --noflush input that deletes
// chains, per table, whether or not they exist: declaring a chain creates or
// flushes it, after which -X can delete it (nothing may jump to it any more).
func deleteChainsInput(chains map[string][]string) string {
	var b strings.Builder
	for _, table := range []string{"nat", "filter"} {
		if len(chains[table]) == 0 {
			continue
		}
		fmt.Fprintf(&b, "*%s\n", table)
		for _, c := range chains[table] {
			fmt.Fprintf(&b, ":%s - [0:0]\n", c)
		}
		for _, c := range chains[table] {
			fmt.Fprintf(&b, "-X %s\n", c)
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}

// Features are the optional netfilter matches found on this kernel.
type Features struct {
	Comment   bool // -m comment: rules carry namespace/name:port
	Addrtype  bool // -m addrtype: NodePorts on every local address without listing them
	Conntrack bool // -m conntrack: the guard that keeps proxy ports off-node
}

// jump is a rule in a built-in chain that leads into one of ours.
type jump struct {
	table, chain string
	rule         []string // without "-A chain"
	insert       bool     // first in the chain (else last)
}

func jumps(f Features) []jump {
	comment := func(text string) []string {
		if !f.Comment {
			return nil
		}
		return []string{"-m", "comment", "--comment", text}
	}
	local := []string(nil)
	if f.Addrtype {
		local = []string{"-m", "addrtype", "--dst-type", "LOCAL"}
	}
	portals := comment("handle ClusterIPs; NOTE: this must be before the NodePort rules")
	nodeports := append(local, comment("handle service NodePorts; NOTE: this must be the last rule in the chain")...)
	js := []jump{
		{"nat", "PREROUTING", append(portals, "-j", ChainPortalsContainer), true},
		{"nat", "OUTPUT", append(append([]string(nil), portals...), "-j", ChainPortalsHost), true},
		{"nat", "PREROUTING", append(nodeports, "-j", ChainNodePortContainer), false},
		{"nat", "OUTPUT", append(append([]string(nil), nodeports...), "-j", ChainNodePortHost), false},
	}
	if f.Conntrack {
		// Only a connection's first packet is looked at: established
		// traffic passes one rule of ours, however many service ports.
		guard := append([]string{"-m", "conntrack", "--ctstate", "NEW"}, comment("keep proxy ports reachable only through service addresses")...)
		js = append(js, jump{"filter", "INPUT", append(guard, "-j", ChainGuard), true})
	}
	// Source ranges: a first packet to a LoadBalancer IP that was not
	// redirected came from outside the ranges. Every packet without
	// conntrack; the chain is a tree on the destination either way.
	var ranges []string
	if f.Conntrack {
		ranges = []string{"-m", "conntrack", "--ctstate", "NEW"}
	}
	ranges = append(ranges, comment("loadBalancerSourceRanges: drop clients outside the ranges")...)
	for _, hook := range []string{"INPUT", "FORWARD", "OUTPUT"} {
		js = append(js, jump{"filter", hook, append(append([]string(nil), ranges...), "-j", ChainSourceRanges), true})
	}
	return js
}

// Ruleset is the content of our chains for one IP family: table → chain →
// rules, each rule as iptables-save prints it without the "-A CHAIN " prefix.
type Ruleset struct {
	Nat    map[string][]string
	Filter map[string][]string
}

// Count returns the number of rules per table.
func (rs *Ruleset) Count() (nat, filter int) {
	for _, r := range rs.Nat {
		nat += len(r)
	}
	for _, r := range rs.Filter {
		filter += len(r)
	}
	return nat, filter
}

// table returns the chains of a table.
func (rs *Ruleset) table(name string) map[string][]string {
	if name == "nat" {
		return rs.Nat
	}
	return rs.Filter
}

// RenderOptions shape the rules.
type RenderOptions struct {
	Family   int
	Features Features
	// NodePortAddresses limits NodePorts to these node addresses. Empty
	// means every local address (addrtype LOCAL, or LocalAddrs when the
	// kernel lacks addrtype).
	NodePortAddresses []netip.Addr
	// AllLocal is true when NodePortAddresses is empty and addrtype is used.
	AllLocal bool
	// Placeholders prints proxy ports as PROXY_PORT(name) (for showing rules
	// before any listener exists).
	Placeholders bool
	// ProxyPorts is the range every listener port off a NodePort is drawn
	// from (--proxy-port-range): the guard drops new connections to it from
	// other hosts that were not redirected, with one rule per protocol.
	ProxyPorts config.PortRange
	// LocalTraffic tells this node's pods among the packets arriving from
	// outside its own stack (--detect-local-mode), for the short-circuit.
	LocalTraffic config.LocalTraffic
}

// Render returns our chains' rules for the frontends of one family.
func Render(frontends []config.Frontend, o RenderOptions) *Ruleset {
	var leaves []leafRule
	for _, fe := range frontends {
		leaves = append(leaves, renderFrontend(fe, o)...)
	}
	return assemble(leaves, o)
}

// leafRule is one rule of one frontend, placed in a tree by its key.
type leafRule struct {
	tree string // treePortals, treeNodePorts+protocol or treeGuard
	key  treeKey
	rule string
}

const (
	treePortals      = "portals"
	treeNodePorts    = "nodeports/"   // + tcp or udp
	treeGuard        = "guard"        // exceptions to the guard, before its drops
	treeSourceRanges = "sourceranges" // drops of LoadBalancer IPs with source ranges
	// The short-circuit for clients on this node: external addresses and
	// NodePorts of externalTrafficPolicy: Local Services.
	treeLocalPortals   = "localportals"
	treeLocalNodePorts = "localnodeports/" // + tcp or udp
)

// guardedProtocols are the protocols whose proxy ports the guard covers.
var guardedProtocols = []string{"tcp", "udp"}

// assemble turns the frontends' rules into our chains.
func assemble(leaves []leafRule, o RenderOptions) *Ruleset {
	return assembleTrees(sortedTrees(leaves), o)
}

// sortedTrees groups leaves by tree, each sorted by key and rule.
func sortedTrees(leaves []leafRule) map[string][]treeItem {
	byTree := map[string][]treeItem{}
	for _, l := range leaves {
		byTree[l.tree] = append(byTree[l.tree], treeItem{l.key, l.rule})
	}
	for tree, items := range byTree {
		sortItems(items)
		byTree[tree] = dedupItems(items)
	}
	return byTree
}

// assembleTrees builds our chains from the sorted rules of each tree: the
// portal and NodePort trees under their entry chains, and the guard.
func assembleTrees(byTree map[string][]treeItem, o RenderOptions) *Ruleset {
	rs := &Ruleset{Nat: map[string][]string{}, Filter: map[string][]string{}}
	portals := buildTree(portalTree(o.Family), byTree[treePortals], rs.Nat)
	localPortals := buildTree(localPortalTree(o.Family), byTree[treeLocalPortals], rs.Nat)
	if len(localPortals) > 0 {
		rs.Nat[ChainLocalPortals] = localPortals
	}
	rs.Nat[ChainPortalsContainer], rs.Nat[ChainPortalsHost] = localFirst(portals, len(localPortals) > 0, ChainLocalPortals, o)
	var nodePorts, localNodePorts []string
	for _, proto := range guardedProtocols {
		nodePorts = append(nodePorts, buildTree(nodePortTree(proto), byTree[treeNodePorts+proto], rs.Nat)...)
		localNodePorts = append(localNodePorts, buildTree(localNodePortTree(proto), byTree[treeLocalNodePorts+proto], rs.Nat)...)
	}
	if len(localNodePorts) > 0 {
		rs.Nat[ChainLocalNodePorts] = localNodePorts
	}
	rs.Nat[ChainNodePortContainer], rs.Nat[ChainNodePortHost] = localFirst(nodePorts, len(localNodePorts) > 0, ChainLocalNodePorts, o)
	if o.Features.Conntrack {
		guard := itemRules(byTree[treeGuard])
		if o.ProxyPorts.Size > 0 {
			ports := fmt.Sprint(o.ProxyPorts.Base)
			if o.ProxyPorts.Size > 1 {
				ports = fmt.Sprintf("%d:%d", o.ProxyPorts.Base, o.ProxyPorts.Base+o.ProxyPorts.Size-1)
			}
			for _, proto := range guardedProtocols {
				guard = append(guard, fmt.Sprintf("! -i lo -p %s -m %s --dport %s -m conntrack ! --ctstate DNAT -j DROP", proto, proto, ports))
			}
		}
		rs.Filter[ChainGuard] = guard
	}
	rs.Filter[ChainSourceRanges] = buildTree(rangeTree(o.Family), byTree[treeSourceRanges], rs.Filter)
	for _, m := range []map[string][]string{rs.Nat, rs.Filter} {
		for c, rules := range m {
			if rules == nil {
				m[c] = []string{}
			}
		}
	}
	return rs
}

// localFirst returns the content of an entry chain pair, container
// (PREROUTING) and host (OUTPUT): rules, after a jump into local (while it has
// rules) for the clients on this node — every packet of the host chain, the
// detected pods' in the container chain.
func localFirst(rules []string, hasLocal bool, local string, o RenderOptions) (container, host []string) {
	if !hasLocal {
		return rules, append([]string(nil), rules...)
	}
	for _, m := range o.LocalTraffic.Matches(o.Family) {
		container = append(container, m+" -j "+local)
	}
	container = append(container, rules...)
	host = append([]string{"-j " + local}, rules...)
	return container, host
}

func dedupItems(items []treeItem) []treeItem {
	out := items[:0]
	for i, it := range items {
		if i == 0 || it != items[i-1] {
			out = append(out, it)
		}
	}
	return out
}

// RestoreInput renders a full iptables-restore --noflush input: declaring
// each chain flushes it, so the whole table's share is replaced atomically.
func (rs *Ruleset) RestoreInput() string {
	var b strings.Builder
	for _, t := range []struct {
		name   string
		chains map[string][]string
	}{{"nat", rs.Nat}, {"filter", rs.Filter}} {
		if len(t.chains) == 0 {
			continue
		}
		names := sortedKeys(t.chains)
		fmt.Fprintf(&b, "*%s\n", t.name)
		for _, c := range names {
			fmt.Fprintf(&b, ":%s - [0:0]\n", c)
		}
		for _, c := range names {
			for _, r := range t.chains[c] {
				fmt.Fprintf(&b, "-A %s %s\n", c, r)
			}
		}
		b.WriteString("COMMIT\n")
	}
	return b.String()
}

func sortedKeys(m map[string][]string) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// JumpRules returns the jump rules into our chains as iptables (family 4)
// or ip6tables (6) commands.
func JumpRules(f Features, family int) []string {
	bin := "iptables"
	if family == 6 {
		bin = "ip6tables"
	}
	var out []string
	for _, j := range jumps(f) {
		op := "-A"
		if j.insert {
			op = "-I"
		}
		out = append(out, fmt.Sprintf("%s -t %s %s %s %s", bin, j.table, op, j.chain, strings.Join(quoteComment(j.rule), " ")))
	}
	return out
}
