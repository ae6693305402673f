package config

import (
	"errors"
	"strings"
	"testing"
)

// A piece missing for one use is missing, whatever another use said
// before or after; its costs gather without repeating; the summary names
// only missing pieces, sorted; a nil report takes everything and says
// nothing.
func TestKernelReport(t *testing.T) {
	r := &KernelReport{}
	r.Present(PieceCommentMatch)
	r.Present(PieceConntrackNL)
	r.Lacks(PieceConntrackNL, "backends see the node's address", errors.New("socket: protocol not supported"))
	r.Present(PieceConntrackNL) // another use found it: still missing
	r.Lacks(PieceConntrackNL, "UDP proxy ports answer other hosts", nil)
	r.Lacks(PieceConntrackNL, "backends see the node's address", nil)
	r.Lacks(PieceAddrtypeMatch, "every connection enters the NodePort chains", nil)

	pieces := r.Pieces()
	for piece, want := range map[KernelPiece]bool{PieceCommentMatch: true, PieceConntrackNL: false, PieceAddrtypeMatch: false} {
		if got, ok := pieces[piece]; !ok || got != want {
			t.Errorf("Pieces()[%s] = %v, %v; want %v", piece, got, ok, want)
		}
	}
	m, ok := r.Missing(PieceConntrackNL)
	if !ok || m.Costs != "backends see the node's address; UDP proxy ports answer other hosts" || m.Err == nil {
		t.Errorf("Missing(conntrack-netlink) = %+v, %v", m, ok)
	}
	want := "no addrtype-match: every connection enters the NodePort chains; no conntrack-netlink: backends see the node's address; UDP proxy ports answer other hosts"
	if got := r.Summary(); got != want {
		t.Errorf("Summary() = %q\nwant      %q", got, want)
	}
	if strings.Contains(r.Summary(), string(PieceCommentMatch)) {
		t.Error("the summary names a piece that is there")
	}

	var none *KernelReport
	none.Present(PieceCommentMatch)
	none.Lacks(PieceCommentMatch, "x", nil)
	if none.Summary() != "" || len(none.Pieces()) != 0 {
		t.Error("a nil report said something")
	}
}
