package config

import (
	"slices"
	"strings"
	"sync"
)

// KernelPiece names an optional piece of the kernel the daemon uses beyond
// the nat table and REDIRECT/DNAT, which every kernel it runs on has.
type KernelPiece string

// The optional pieces, each probed where it is used (docs/iptables.md, "What
// the daemon uses of the kernel").
const (
	PieceCommentMatch    KernelPiece = "comment-match"     // iptables -m comment
	PieceAddrtypeMatch   KernelPiece = "addrtype-match"    // iptables -m addrtype
	PieceConntrackMatch  KernelPiece = "conntrack-match"   // iptables -m conntrack
	PieceIPv6Rules       KernelPiece = "ip6tables"         // the IPv6 nat table
	PieceConntrackNL     KernelPiece = "conntrack-netlink" // nf_conntrack_netlink: read and delete entries
	PieceSourceNAT4      KernelPiece = "source-nat-ipv4"   // entries created with a source NAT over ctnetlink
	PieceSourceNAT6      KernelPiece = "source-nat-ipv6"
	PieceBridgeNetfilter KernelPiece = "br-netfilter"      // net.bridge.bridge-nf-call-ip(6)tables = 1
	PieceReservedPorts   KernelPiece = "reserved-ports"    // net.ipv4.ip_local_reserved_ports writable
	PieceConntrackSysctl KernelPiece = "conntrack-sysctls" // net.netfilter.nf_conntrack_* writable
)

// KernelReport gathers what the probes found: the pieces present and, for
// each missing one, what its absence costs the user. Safe for concurrent
// use; a nil report gathers nothing.
type KernelReport struct {
	mu      sync.Mutex
	present map[KernelPiece]bool
	missing map[KernelPiece]Missing
}

// Missing is a piece the daemon goes on without: what that costs, and the
// probe's error.
type Missing struct {
	Costs string
	Err   error
}

// Present records that piece works.
func (r *KernelReport) Present(piece KernelPiece) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.present == nil {
		r.present = map[KernelPiece]bool{}
	}
	if _, gone := r.missing[piece]; !gone {
		r.present[piece] = true
	}
}

// Lacks records that piece is missing, what that costs and why (err may be
// nil: off by a flag). A piece missing for one use is missing.
func (r *KernelReport) Lacks(piece KernelPiece, costs string, err error) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.missing == nil {
		r.missing = map[KernelPiece]Missing{}
	}
	delete(r.present, piece)
	if m, ok := r.missing[piece]; ok {
		if !strings.Contains(m.Costs, costs) {
			m.Costs += "; " + costs
		}
		if m.Err == nil {
			m.Err = err
		}
		r.missing[piece] = m
		return
	}
	r.missing[piece] = Missing{Costs: costs, Err: err}
}

// Pieces are the pieces probed, each with whether it works.
func (r *KernelReport) Pieces() map[KernelPiece]bool {
	if r == nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[KernelPiece]bool{}
	for p := range r.present {
		out[p] = true
	}
	for p := range r.missing {
		out[p] = false
	}
	return out
}

// MissingPieces are the missing pieces, sorted by name.
func (r *KernelReport) MissingPieces() []KernelPiece {
	if r == nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []KernelPiece
	for p := range r.missing {
		out = append(out, p)
	}
	slices.Sort(out)
	return out
}

// Missing is what piece's absence costs (ok false: not missing).
func (r *KernelReport) Missing(piece KernelPiece) (Missing, bool) {
	if r == nil {
		return Missing{}, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	m, ok := r.missing[piece]
	return m, ok
}

// Summary says every missing piece and its cost in one line: "" when none
// is missing.
func (r *KernelReport) Summary() string {
	var parts []string
	for _, p := range r.MissingPieces() {
		m, _ := r.Missing(p)
		parts = append(parts, "no "+string(p)+": "+m.Costs)
	}
	return strings.Join(parts, "; ")
}
