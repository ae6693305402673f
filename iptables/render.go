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
package iptables

import (
	"fmt"
	"hash/fnv"
	"net/netip"
	"sort"
	"strings"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// The chains. Portals (ClusterIPs, externalIPs, LoadBalancer IPs) are jumped
// to first; NodePorts last, so that a Service address that happens to be a
// node address is handled as a portal.
const (
	ChainPortalsContainer  = "KUBE-PORTALS-CONTAINER"  // nat PREROUTING: from pods and other hosts
	ChainPortalsHost       = "KUBE-PORTALS-HOST"       // nat OUTPUT: from the node itself
	ChainNodePortContainer = "KUBE-NODEPORT-CONTAINER" // nat PREROUTING, last
	ChainNodePortHost      = "KUBE-NODEPORT-HOST"      // nat OUTPUT, last
	ChainGuard             = "KUBE-PORTALS-GUARD"      // filter INPUT: proxy ports only via a redirect
	chainProbe             = "KUBE-PORTALS-PROBE"      // created and deleted while probing
)

var natChains = []string{ChainPortalsContainer, ChainPortalsHost, ChainNodePortContainer, ChainNodePortHost}

// Shards. With many service ports each of our chains is split into
// ShardCount sub-chains (KUBE-PORTALS-CONTAINER-00 … -1F) picked by a hash of
// the service port's name, and the chain itself holds one jump per shard.
// iptables-nft reads the whole chain a rule is appended to or deleted from:
// a one-Service change among 20k rules in one chain took 24 ms to append and
// ~200 ms to delete, in a shard of ~600 rules 5 ms either way. A packet
// passes at most ShardCount more jumps, next to thousands of rules.
const (
	ShardCount = 32
	// Sharding starts at shardAbove service ports of a family and stops
	// below shardBelow, so that a size near the edge does not flip the layout.
	shardAbove = 1000
	shardBelow = 500
)

// ShardsFor returns the shard count for n service ports of a family, for a
// daemon starting without rules.
func ShardsFor(n int) int {
	if n >= shardAbove {
		return ShardCount
	}
	return 0
}

// shardedChains are the chains split into shards, per table.
func shardedChains(table string, f Features) []string {
	if table == "nat" {
		return natChains
	}
	if f.Conntrack {
		return []string{ChainGuard}
	}
	return nil
}

// ShardName names shard i of chain.
func ShardName(chain string, i int) string { return fmt.Sprintf("%s-%02X", chain, i) }

// chainFor returns the chain that holds name's rules of chain.
func (o RenderOptions) chainFor(chain string, name config.ServicePortName) string {
	if o.Shards == 0 {
		return chain
	}
	h := fnv.New32a()
	h.Write([]byte(name.String()))
	return ShardName(chain, int(h.Sum32()%uint32(o.Shards)))
}

// skeleton returns the jumps from our chains into their shards (none when
// unsharded): the rules that are there whatever the frontends.
func skeleton(o RenderOptions) []chainRule {
	var out []chainRule
	for _, table := range []string{"nat", "filter"} {
		for _, c := range shardedChains(table, o.Features) {
			for i := 0; i < o.Shards; i++ {
				out = append(out, chainRule{table, c, "-j " + ShardName(c, i)})
			}
		}
	}
	return out
}

// shardChains returns every shard chain name, by table.
func shardChains(f Features) map[string][]string {
	out := map[string][]string{}
	for _, table := range []string{"nat", "filter"} {
		for _, c := range shardedChains(table, f) {
			for i := 0; i < ShardCount; i++ {
				out[table] = append(out[table], ShardName(c, i))
			}
		}
	}
	return out
}

// isShard reports whether name is a shard of one of our chains.
func isShard(name string) bool {
	for _, c := range append(append([]string(nil), natChains...), ChainGuard) {
		if rest, ok := strings.CutPrefix(name, c+"-"); ok && len(rest) == 2 && strings.ToUpper(rest) == rest {
			return true
		}
	}
	return false
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

// chainsOf returns our chains in a table for a layout.
func chainsOf(table string, o RenderOptions) map[string]bool {
	m := map[string]bool{}
	for _, c := range shardedChains(table, o.Features) {
		m[c] = true
		for i := 0; i < o.Shards; i++ {
			m[ShardName(c, i)] = true
		}
	}
	return m
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
		js = append(js, jump{"filter", "INPUT", append(comment("keep proxy ports reachable only through service addresses"), "-j", ChainGuard), true})
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
	// Shards is the number of sub-chains per chain; 0 keeps each chain whole.
	Shards int
}

// Render returns our chains' rules for the frontends of one family.
func Render(frontends []proxy.Frontend, o RenderOptions) *Ruleset {
	rs := &Ruleset{Nat: map[string][]string{}, Filter: map[string][]string{}}
	for c := range chainsOf("nat", o) {
		rs.Nat[c] = nil
	}
	for c := range chainsOf("filter", o) {
		rs.Filter[c] = nil
	}
	add := func(r chainRule) {
		if r.table == "nat" {
			rs.Nat[r.chain] = append(rs.Nat[r.chain], r.rule)
		} else {
			rs.Filter[r.chain] = append(rs.Filter[r.chain], r.rule)
		}
	}
	for _, r := range skeleton(o) {
		add(r)
	}
	for _, fe := range frontends {
		for _, r := range renderFrontend(fe, o) {
			add(r)
		}
	}
	for _, m := range []map[string][]string{rs.Nat, rs.Filter} {
		for c := range m {
			m[c] = dedupSorted(m[c])
		}
	}
	return rs
}

// chainRule is one rule of one of our chains.
type chainRule struct {
	table, chain, rule string
}

// onNodePort reports whether the frontend's listener sits on the service's
// NodePort: traffic to the NodePort then reaches it without any rule.
func onNodePort(fe proxy.Frontend) bool {
	return fe.Service.NodePort != 0 && int(fe.Listen.Port()) == fe.Service.NodePort
}

// renderFrontend returns the rules that lead one frontend's addresses to its
// listener (none for a frontend of another family or without listener).
func renderFrontend(fe proxy.Frontend, o RenderOptions) []chainRule {
	if fe.Family != o.Family || fe.Err != nil {
		return nil
	}
	sp := fe.Service
	proto := strings.ToLower(string(fe.Protocol))
	target := redirectTarget(fe, o.Placeholders)
	var out []chainRule
	rule := func(dst netip.Addr, port int) string {
		var b strings.Builder
		if dst.IsValid() {
			fmt.Fprintf(&b, "-d %s/%d ", dst, dst.BitLen())
		}
		fmt.Fprintf(&b, "-p %s ", proto)
		if o.Features.Comment {
			fmt.Fprintf(&b, "-m comment --comment %q ", sp.Name.String())
		}
		fmt.Fprintf(&b, "-m %s --dport %d %s", proto, port, target)
		return b.String()
	}
	both := func(container, host, r string) {
		out = append(out, chainRule{"nat", o.chainFor(container, sp.Name), r}, chainRule{"nat", o.chainFor(host, sp.Name), r})
	}
	if fe.Kind != proxy.KindExternal {
		for _, ip := range sp.ClusterIPs {
			if config.Family(ip) == o.Family {
				both(ChainPortalsContainer, ChainPortalsHost, rule(ip, sp.Port))
			}
		}
	}
	if fe.Kind != proxy.KindInternal {
		for _, ips := range [][]netip.Addr{sp.ExternalIPs, sp.LoadBalancerIPs} {
			for _, ip := range ips {
				if config.Family(ip) == o.Family {
					both(ChainPortalsContainer, ChainPortalsHost, rule(ip, sp.Port))
				}
			}
		}
		if sp.NodePort != 0 && fe.NodePortErr == nil && !onNodePort(fe) {
			if o.AllLocal {
				both(ChainNodePortContainer, ChainNodePortHost, rule(netip.Addr{}, sp.NodePort))
			} else {
				for _, ip := range o.NodePortAddresses {
					both(ChainNodePortContainer, ChainNodePortHost, rule(ip, sp.NodePort))
				}
			}
		}
	}
	// A listener on its NodePort is meant to be reachable from anywhere;
	// every other proxy port only through a redirect.
	if o.Features.Conntrack && !onNodePort(fe) {
		port := fmt.Sprint(fe.Listen.Port())
		if o.Placeholders {
			port = placeholder(fe)
		}
		out = append(out, chainRule{"filter", o.chainFor(ChainGuard, sp.Name),
			fmt.Sprintf("! -i lo -p %s -m %s --dport %s -m conntrack ! --ctstate DNAT -j DROP", proto, proto, port)})
	}
	return out
}

func placeholder(fe proxy.Frontend) string {
	if onNodePort(fe) {
		return fmt.Sprint(fe.Listen.Port())
	}
	return fmt.Sprintf("PROXY_PORT(%s/%s/IPv%d)", fe.Service.Name, fe.Kind, fe.Family)
}

// redirectTarget sends matching packets to the frontend's listener. With
// listeners on the unspecified address it is REDIRECT in every chain: in
// PREROUTING the packet goes to the address it arrived on, in OUTPUT to
// 127.0.0.1 (::1), which always exists — and the UDP listener answers from
// the address each datagram arrived on (IP_PKTINFO), so conntrack maps the
// reply back to the Service address. A specific --bind-address needs DNAT.
func redirectTarget(fe proxy.Frontend, placeholders bool) string {
	port := fmt.Sprint(fe.Listen.Port())
	if placeholders {
		port = placeholder(fe)
	}
	if fe.Listen.Addr().IsUnspecified() || !fe.Listen.Addr().IsValid() {
		return "-j REDIRECT --to-ports " + port
	}
	if fe.Family == 6 {
		return fmt.Sprintf("-j DNAT --to-destination [%s]:%s", fe.Listen.Addr(), port)
	}
	return fmt.Sprintf("-j DNAT --to-destination %s:%s", fe.Listen.Addr(), port)
}

func dedupSorted(rules []string) []string {
	sort.Strings(rules)
	out := rules[:0]
	for i, r := range rules {
		if i == 0 || r != rules[i-1] {
			out = append(out, r)
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

// JumpRules returns the jump rules into our chains as iptables commands.
func JumpRules(f Features) []string {
	var out []string
	for _, j := range jumps(f) {
		op := "-A"
		if j.insert {
			op = "-I"
		}
		out = append(out, fmt.Sprintf("iptables -t %s %s %s %s", j.table, op, j.chain, strings.Join(quoteComment(j.rule), " ")))
	}
	return out
}
