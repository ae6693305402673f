#!/usr/bin/env bash
# make bench-guard: what guarding the proxy ports costs a new connection.
# With the conntrack match the guard is one filter-table rule; without it
# (--iptables-basic-only: every optional match off, as on a kernel without
# netfilter extras) the daemon guards the ports itself, one getsockname per
# accepted connection beside the SO_ORIGINAL_DST it reads anyway. make
# bench's pinned new-connections/s figure (RUNS runs of DUR s, HAProxy in the
# same run as the baseline) for each, ROUNDS rounds alternating; each cell
# the median over the rounds with its min–max. Root; ~2 minutes a round.
set -eu
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-3}; RUNS=${RUNS:-3}; BIN=${BIN:-bin}
out=$(mktemp); trap 'rm -f "$out"' EXIT
for round in $(seq "$ROUNDS"); do
  for mode in filter accept; do
    args=""; [ "$mode" = accept ] && args=--iptables-basic-only
    echo "round $round/$ROUNDS: guard in the $mode" >&2
    table=$(PATHS="haproxy proxy" TESTS=cps RUNS=$RUNS PROXY_ARGS="$args" BIN=$BIN bash test/bench/bench.sh)
    # | metric | HAProxy | this proxy | …: the medians (a cell is "median (min–max)").
    cps=$(echo "$table" | awk -F'|' '/^\| new connections\/s/ {split($3, h, " "); split($4, p, " "); print h[1], p[1]}')
    cpu=$(echo "$table" | awk -F'|' '/^\| proxy CPU µs per connection/ {split($4, p, " "); print p[1]}')
    [ -n "$cps" ] && [ -n "$cpu" ] || { echo "bench-guard: no figure in the table:" >&2; echo "$table" >&2; exit 1; }
    echo "$mode $cps $cpu" >>"$out"
  done
done
cell() { sort -g | awk -v f="$1" '{v[NR]=$1} END{printf f " (" f "–" f ")", v[int((NR+1)/2)], v[1], v[NR]}'; } # FORMAT
echo
echo "| guard of the proxy ports | this proxy, new connections/s | HAProxy, same runs | ours ÷ HAProxy | proxy CPU µs per connection |"
echo "|---|---:|---:|---:|---:|"
for mode in filter accept; do
  label=$([ "$mode" = filter ] && echo "filter table (conntrack match)" || echo "at accept (basic netfilter)")
  echo "| $label | $(awk -v m=$mode '$1==m {print $3}' "$out" | cell %.0f) | $(awk -v m=$mode '$1==m {print $2}' "$out" | cell %.0f) | $(awk -v m=$mode '$1==m {print $3/$2}' "$out" | cell %.2f)× | $(awk -v m=$mode '$1==m {print $4}' "$out" | cell %.1f) |"
done
