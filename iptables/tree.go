package iptables

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"net/netip"
	"slices"
	"strings"
)

// Rule trees. The first packet of every new connection to or through the
// node walks our nat chains, so they must not grow with the number of
// service ports. Each tree sorts its rules by a key — the destination
// address for portals, the destination port for NodePorts — and splits them
// by the key's next 4 bits (a nibble) into up to 16 children, one chain per
// child that is too big to sit in its parent: a chain holds either rules or
// `-d 10.96.0.0/16 -j KUBE-PT-0A60`-style jumps to the chains of the
// prefixes below it, so a packet passes at most ~16 rules per level and
// there are about log16(N) levels. A packet for no service address fails
// the first test. Only basic matches (-d, -p, --dport) are used.
//
// A chain's prefix is always nibble-aligned and tightened to the longest
// prefix its keys share, so a chain's name and content depend only on the
// keys below its prefix: adding or removing a Service rewrites the few
// chains on its path and nothing else.
const (
	treeStride = 4  // bits per level: 16 children
	leafMax    = 16 // rules a chain holds directly before it is split
	inlineMax  = 2  // a child with at most this many rules sits in its parent
)

// treeKey is a big-endian key: an address (4 or 16 bytes) or a port (2 bytes).
type treeKey [16]byte

func addrKey(a netip.Addr) treeKey {
	var k treeKey
	if a.Is4() {
		b := a.As4()
		copy(k[:], b[:])
	} else {
		b := a.As16()
		copy(k[:], b[:])
	}
	return k
}

func portKey(p int) treeKey {
	var k treeKey
	binary.BigEndian.PutUint16(k[:], uint16(p))
	return k
}

// nibble returns the i-th 4-bit group of k.
func (k treeKey) nibble(i int) byte {
	b := k[i/2]
	if i%2 == 0 {
		return b >> 4
	}
	return b & 0xF
}

// treeItem is one rule at the bottom of a tree, placed by its key.
type treeItem struct {
	key  treeKey
	rule string
}

// treeSpec describes one tree: its key width, how a prefix of keys is matched
// and how its chains are named.
type treeSpec struct {
	bits        int    // key width: 32, 128 (addresses) or 16 (ports)
	chainPrefix string // KUBE-PT- or KUBE-NP-TCP- …
	// match renders the test for keys sharing k's first plen bits.
	match func(k treeKey, plen int) string
}

func portalTree(family int) treeSpec {
	bits := 32
	if family == 6 {
		bits = 128
	}
	return treeSpec{bits: bits, chainPrefix: chainPortalTree, match: func(k treeKey, plen int) string {
		var a netip.Addr
		if bits == 32 {
			a = netip.AddrFrom4([4]byte(k[:4]))
		} else {
			a = netip.AddrFrom16(k)
		}
		return "-d " + netip.PrefixFrom(a, plen).Masked().String()
	}}
}

// rangeTree is the portal tree's shape for the source-range drops (filter).
func rangeTree(family int) treeSpec {
	s := portalTree(family)
	s.chainPrefix = chainRangeTree
	return s
}

func localPortalTree(family int) treeSpec {
	s := portalTree(family)
	s.chainPrefix = chainLocalPortalTree
	return s
}

func localNodePortTree(proto string) treeSpec {
	s := nodePortTree(proto)
	s.chainPrefix = chainLocalNodePortTree + strings.ToUpper(proto) + "-"
	return s
}

func nodePortTree(proto string) treeSpec {
	return treeSpec{bits: 16, chainPrefix: chainNodePortTree + strings.ToUpper(proto) + "-", match: func(k treeKey, plen int) string {
		lo := int(binary.BigEndian.Uint16(k[:2])) &^ (1<<(16-plen) - 1)
		hi := lo | (1<<(16-plen) - 1)
		return fmt.Sprintf("-p %s -m %s --dport %d:%d", proto, proto, lo, hi)
	}}
}

// chainName names the chain of keys sharing k's first plen bits (plen is a
// multiple of the stride): the prefix in hex, or a hash where the name would
// pass iptables' 28 characters (long IPv6 prefixes).
func (s treeSpec) chainName(k treeKey, plen int) string {
	const hex = "0123456789ABCDEF"
	n := plen / treeStride
	if len(s.chainPrefix)+n <= maxChainName {
		b := make([]byte, 0, len(s.chainPrefix)+n)
		b = append(b, s.chainPrefix...)
		for i := 0; i < n; i++ {
			b = append(b, hex[k.nibble(i)])
		}
		return string(b)
	}
	h := fnv.New64a()
	for i := 0; i < plen/treeStride; i++ {
		h.Write([]byte{k.nibble(i)})
	}
	fmt.Fprintf(h, "/%d", plen)
	return fmt.Sprintf("%sH%016X", s.chainPrefix, h.Sum64())
}

// maxChainName is the longest chain name iptables accepts.
const maxChainName = 28

// buildTree returns the rules of the tree's root, to be placed in an entry
// chain, and adds the chains below it to chains. items must be sorted by key.
func buildTree(s treeSpec, items []treeItem, chains map[string][]string) []string {
	if len(items) <= leafMax {
		return itemRules(items)
	}
	p := tighten(s, items, 0)
	if p == 0 {
		return s.content(items, 0, chains)
	}
	name := s.chainName(items[0].key, p)
	chains[name] = s.content(items, p, chains)
	return []string{s.match(items[0].key, p) + " -j " + name}
}

// content returns the rules of the chain for items, which share their first
// plen bits, and adds the chains below it to chains.
func (s treeSpec) content(items []treeItem, plen int, chains map[string][]string) []string {
	if len(items) <= leafMax || plen >= s.bits {
		return itemRules(items)
	}
	var out []string
	for len(items) > 0 {
		n := 1
		first := items[0].key.nibble(plen / treeStride)
		for n < len(items) && items[n].key.nibble(plen/treeStride) == first {
			n++
		}
		group := items[:n]
		items = items[n:]
		if len(group) <= inlineMax {
			out = append(out, itemRules(group)...)
			continue
		}
		p := tighten(s, group, plen+treeStride)
		name := s.chainName(group[0].key, p)
		chains[name] = s.content(group, p, chains)
		out = append(out, s.match(group[0].key, p)+" -j "+name)
	}
	return out
}

// tighten returns the longest nibble-aligned prefix length, at least plen,
// that every item's key shares (items are sorted: the first and the last
// tell).
func tighten(s treeSpec, items []treeItem, plen int) int {
	first, last := items[0].key, items[len(items)-1].key
	for plen < s.bits && first.nibble(plen/treeStride) == last.nibble(plen/treeStride) {
		plen += treeStride
	}
	return plen
}

func itemRules(items []treeItem) []string {
	out := make([]string, len(items))
	for i, it := range items {
		out[i] = it.rule
	}
	return out
}

// sortItems orders items by key, then rule.
func sortItems(items []treeItem) { slices.SortFunc(items, compareItems) }

func compareItems(a, b treeItem) int {
	if c := bytes.Compare(a.key[:], b.key[:]); c != 0 {
		return c
	}
	return strings.Compare(a.rule, b.rule)
}
