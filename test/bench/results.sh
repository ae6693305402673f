# Shared by the benchmark scripts: figures recorded as "metric key value"
# lines in $results, read back as the median over runs; and the lab setup of
# bench.sh and sched.sh.
record() { echo "$1 $2 $3" >>"$results"; } # metric key value
jsonval() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; } # a number from loadgen's JSON on stdin
median() { sort -g | awk '{v[NR]=$1} END{if(NR==0){print "—"}else{print v[int((NR+1)/2)]}}'; }
value() { awk -v m="$1" -v p="$2" '$1==m && $2==p {print $3}' "$results" | median; } # metric key → median

# bench_lab PREFIX: the lab of test/lab/lab.sh (sourced before) under the name
# $LAB when set, else PREFIX<pid>, a work directory $work, both removed on
# exit; N NS CMD… runs a command in one of the lab's namespaces.
bench_lab() {
  [ -n "${LAB_GIVEN:-}" ] || LAB=$1$$
  work=$(mktemp -d)
  trap 'lab_down; rm -rf "$work"' EXIT
  trap 'exit 130' INT TERM
  lab_up || { echo "lab_up failed" >&2; exit 1; }
}
N() { ip netns exec "$LAB-$1" "${@:2}"; }
