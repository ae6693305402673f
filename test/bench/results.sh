# Shared by the benchmark scripts: figures recorded as "metric key value"
# lines in $results, read back as the median over runs (with their spread);
# the pinning of proxies and load; and the lab setup of bench.sh and sched.sh.
# record METRIC KEY VALUE keeps one figure. A value that is not a number, or
# is outside what a working measurement of METRIC can read on any machine
# (sane_range), stops the script: a renamed field or a failed measurement
# must not print 0.00× or inf× and pass.
record() {
  local lo hi
  read -r lo hi <<<"$(sane_range "$1")"
  if ! awk -v v="$3" -v lo="$lo" -v hi="$hi" 'BEGIN{exit !(v ~ /^-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?$/ && v+0 >= lo+0 && v+0 <= hi+0)}'; then
    echo "bench: the figure $1 of $2 is '$3', not a number in [$lo, $hi]: the measurement broke" >&2
    exit 1
  fi
  echo "$1 $2 $3" >>"$results"
}
# sane_range METRIC: "lo hi", the bounds of a working measurement.
sane_range() {
  case $1 in
    tput*) echo "0.01 10000" ;;                   # Gbit/s
    cpu_per_gb_*) echo "0 1000" ;;                # CPU seconds per GB
    cps | rps | svc) echo "1 100000000" ;;        # per second
    cpu_per_*) echo "0 100000000" ;;              # CPU µs per operation
    p50 | p99 | p999 | lat) echo "0.1 100000000" ;; # µs
    steal_ms) echo "0 100000000" ;;               # ms
    runq_us | softirq_us | sched_p99 | sched_p999 | pause_max | pause_total) echo "0 100000000" ;; # µs
    gc_cycles) echo "0 1000000" ;;
    alloc_b_*) echo "0 100000000" ;;              # bytes per operation
    sys_per_* | cs_per_*) echo "0.001 100000" ;;  # per operation (a path that made no system call measured nothing)
    udp_per_core_*) echo "1 1000000000000" ;;     # datagrams per CPU-second
    udp_rt_us_*) echo "0.01 1000000000" ;;        # machine CPU µs per round trip
    udp_flow_kib | idle_kib_*) echo "-64 100000" ;; # KiB (a heap handing memory back reads a little below 0)
    idle_fd_*) echo "0.5 16" ;;                   # descriptors per connection
    udp_*) echo "0 1000000000000" ;;              # datagrams/s (0: not even the lowest rate passed)
    *) echo "-1000000000000000000 1000000000000000000" ;;
  esac
}
jsonval() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; } # a number from loadgen's JSON on stdin
median() { sort -g | awk '{v[NR]=$1} END{if(NR==0){print "—"}else{print v[int((NR+1)/2)]}}'; }
value() { awk -v m="$1" -v p="$2" '$1==m && $2==p {print $3}' "$results" | median; } # metric key → median
# cell METRIC KEY: the median and, with more than one run, the spread of the runs (min–max).
cell() {
  awk -v m="$1" -v p="$2" '$1==m && $2==p {print $3}' "$results" | sort -g |
    awk '{v[NR]=$1} END{if(NR==0){print "—"} else if(NR==1 || v[1]==v[NR]){print v[int((NR+1)/2)]} else {printf "%s (%s–%s)\n", v[int((NR+1)/2)], v[1], v[NR]}}'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN{if(a=="—"||b=="—"||b==0){print "—"}else{printf "%.2f×", a/b}}'; }

# A pinned lab: the proxy under test (ours or a peer) on PROXY_CPUS, the load
# generators and the backend on LOAD_CPUS, the same for every path, so that
# neither steals the other's CPU (floating, "proxy ÷ direct" read above 1).
# The shared setting pins nothing, as on a node, where the proxy shares its
# cores with the pods it serves: every process may run on every CPU, and a
# proxy runs one thread or worker per CPU of the machine.
NCPU=$(nproc)
PROXY_CPUS=${PROXY_CPUS:-$((NCPU - 1))}
LOAD_CPUS=${LOAD_CPUS:-$([ "$NCPU" -gt 1 ] && echo "0-$((NCPU - 2))" || echo 0)}
# pinning pinned|shared: how P and L start processes from now on; PROXY_NCPU
# is the number of CPUs a proxy may run on (its threads or workers).
pinning() {
  SETTING=$1
  case $1 in
    pinned)
      PROXY_NCPU=$(taskset -c "$PROXY_CPUS" nproc)
      P() { N node taskset -c "$PROXY_CPUS" "$@"; }     # a proxy under test, in the node
      L() { N "$1" taskset -c "$LOAD_CPUS" "${@:2}"; } # a load generator or backend, in namespace $1
      ;;
    shared)
      PROXY_NCPU=$NCPU
      P() { N node "$@"; }
      L() { N "$1" "${@:2}"; }
      ;;
    *) echo "pinning: '$1' is neither pinned nor shared" >&2; exit 1 ;;
  esac
}
pinning pinned

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
