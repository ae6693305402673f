#!/usr/bin/env bash
# make bench-tax (and the "node tax" section of make bench): what the daemon's
# rules cost the node's traffic that is NOT service traffic, and the first
# packet of a connection to a service address at scale.
#
# In one network namespace, first without the daemon, then with it serving N
# service ports from a manifests file (N = TAX_SIZES), interleaved: loopback
# TCP throughput (iperf3), TCP ping-pong latency (sockperf, median), and new
# connections/s to a local port that is no Service's (loadgen cps against an
# HTTP server on 127.0.0.1:8080); with the daemon also new connections/s
# through a ClusterIP, reported against the rate with one service port. Each
# figure is the median of RUNS runs. Prints a markdown table on stdout.
# Needs root; removes its namespace on exit.
set -u
cd "$(dirname "$0")/../.."
BIN=${BIN:-bin}
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then RUNS=1; DUR=1; LG_DUR=0.5; TAX_SIZES=${TAX_SIZES:-"1"} # every step once, within bench-smoke's minute
else RUNS=${RUNS:-5}; DUR=${DUR:-2}; TAX_SIZES=${TAX_SIZES:-"1 100 1000 10000"}; fi
LG_DUR=${LG_DUR:-$DUR} # loadgen's runs (iperf3 and sockperf take whole seconds only)
# iperf3 for DUR seconds; the smoke run, which only keeps the steps from rotting, sends a fixed 256 MB instead.
IPERF_LEN="-t $DUR"; [ "$SMOKE" = 1 ] && IPERF_LEN="-n 256M"
[ "$(id -u)" = 0 ] || { echo "nodetax needs root (network namespaces)" >&2; exit 1; }
for c in iperf3 sockperf; do
  command -v "$c" >/dev/null || { echo "nodetax needs $c (apt-get install $c; .ci/run installs it)" >&2; exit 1; }
done
ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"
. test/lab/lab.sh # wait_until
. test/bench/results.sh # record, jsonval, median, value

NS=kuptax$$
work=$(mktemp -d)
daemon_pid=
cleanup() {
  [ -n "$daemon_pid" ] && kill "$daemon_pid" 2>/dev/null && wait "$daemon_pid" 2>/dev/null
  ip netns pids "$NS" 2>/dev/null | xargs -r kill -9 2>/dev/null
  ip netns del "$NS" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
N() { ip netns exec "$NS" "$@"; }
ip netns add "$NS" || exit 1
N ip link set lo up
# A veth pair inside the namespace gives the node an address and a default
# route (service addresses must be routable before OUTPUT rewrites them); no
# traffic leaves the namespace.
N ip link add eth0 type veth peer name eth1
N ip addr add 10.250.0.1/24 dev eth0
N ip link set eth0 up
N ip link set eth1 up
N ip route add default via 10.250.0.2

# The Services' one endpoint, and the servers of the node's own traffic. The
# node's own servers run on the first CPU and their clients on the last, so
# that where the scheduler puts them does not drown what the rules cost. The
# daemon and the Services' endpoint run beside the servers: the clients'
# CPU measures the same work with and without the daemon.
srv_cpu=0; cli_cpu=$(($(nproc) - 1))
N taskset -c "$srv_cpu" "$BIN/backend" --name ep --tcp 10.250.0.1:9000 --udp "" >/dev/null 2>&1 &
N taskset -c "$srv_cpu" "$BIN/backend" --name local --tcp 127.0.0.1:8080 --udp "" >/dev/null 2>&1 &
N taskset -c "$srv_cpu" iperf3 -s -B 127.0.0.1 -p 5201 -D >/dev/null 2>&1
N taskset -c "$srv_cpu" sockperf server -i 127.0.0.1 -p 11111 --tcp >/dev/null 2>&1 &
wait_until 10 N curl -s --max-time 1 http://127.0.0.1:8080/ >/dev/null || { echo "local server down" >&2; exit 1; }
wait_until 10 N curl -s --max-time 1 http://10.250.0.1:9000/ >/dev/null || { echo "endpoint down" >&2; exit 1; }

# manifests N: the target Service lab/target (ClusterIP 10.96.0.10:80) and
# N-1 others with ClusterIPs drawn at random from 10.96.0.0/12 as the API
# server does; every fifth is a NodePort Service (30000-32767).
manifests() {
  awk -v n="$1" 'BEGIN {
    srand(42); used["10.96.0.10"] = 1
    for (i = 0; i < n; i++) {
      if (i == 0) { name = "target"; ip = "10.96.0.10" }
      else {
        do { v = int(rand() * 1048574) + 1; ip = sprintf("10.%d.%d.%d", 96 + int(v / 65536), int(v / 256) % 256, v % 256) } while (ip in used)
        used[ip] = 1; name = "s" i
      }
      spec = "{clusterIP: " ip ", ports: [{name: http, port: 80}]}"
      if (i > 0 && i % 5 == 0 && i / 5 < 2768) spec = "{type: NodePort, clusterIP: " ip ", ports: [{name: http, port: 80, nodePort: " 30000 + i / 5 "}]}"
      printf "---\napiVersion: v1\nkind: Service\nmetadata: {name: %s, namespace: tax}\nspec: %s\n", name, spec
      printf "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: %s, namespace: tax, labels: {kubernetes.io/service-name: %s}}\n", name, name
      printf "addressType: IPv4\nports: [{name: http, port: 9000}]\nendpoints: [{addresses: [10.250.0.1]}]\n"
    }
    print ip > "/dev/stderr"
  }' 2>"$work/last-ip"
}

start_daemon() { # N: serve N service ports; returns when the first and the last answer
  mkdir -p "$work/m$1"
  manifests "$1" >"$work/m$1/services.yaml"
  # Not through N: $! must be the daemon (ip netns exec and taskset exec it), not a subshell.
  # --sync-period: the periodic check must not put back the jumps that
  # jumps_off takes out.
  ip netns exec "$NS" taskset -c "$srv_cpu" "$BIN/kube-userspace-proxy" --manifests "$work/m$1" --connection-log none --log-level warn --sync-period 1h \
    --metrics-bind-address "" --healthz-bind-address "" >>"$work/daemon.log" 2>&1 &
  daemon_pid=$!
  local last; last=$(cat "$work/last-ip")
  wait_until 120 N curl -s --max-time 1 "http://$last:80/" >/dev/null &&
    wait_until 30 N curl -s --max-time 1 http://10.96.0.10:80/ >/dev/null ||
    { echo "daemon with $1 service ports did not serve:" >&2; tail -20 "$work/daemon.log" >&2; exit 1; }
  [ "$SMOKE" = 1 ] || sleep 1 # its first sync's garbage collected, its threads idle
}

stop_daemon() {
  kill "$daemon_pid"; wait "$daemon_pid" 2>/dev/null; daemon_pid=
  if pgrep -f "kube-userspace-proxy --manifests $work" >/dev/null; then echo "the daemon did not stop" >&2; exit 1; fi
  N "$BIN/kube-userspace-proxy" --cleanup >/dev/null 2>&1
  if N iptables-save | grep -q KUBE-; then echo "rules left after the daemon stopped" >&2; exit 1; fi
}

# jumps_off takes the jumps into our chains out of the built-in chains, so
# that traffic meets none of our rules while conntrack and the nat hooks stay
# as they are; jumps_on puts them back, in their order.
jumps_off() {
  N iptables-save | awk '/^\*/{t=substr($1,2)} /^-A (PREROUTING|OUTPUT|INPUT) .*-j KUBE-/{print t" "$0}' >"$work/jumps"
  while read -r t _ chain rest; do eval "N iptables -w -t $t -D $chain $rest"; done <"$work/jumps"
  if N iptables-save | grep -qE '^-A (PREROUTING|OUTPUT|INPUT) .*-j KUBE-'; then echo "jumps_off left a jump" >&2; exit 1; fi
}
jumps_on() {
  while read -r t _ chain rest; do eval "N iptables -w -t $t -A $chain $rest"; done <"$work/jumps"
}

results="$work/results"
: >"$results"

measure() { # label: the node's own traffic, not through any Service
  local bps lat cps
  bps=$(N taskset -c "$cli_cpu" iperf3 -c 127.0.0.1 -p 5201 $IPERF_LEN -J 2>/dev/null | awk '/"sum_received"/{f=1} f&&/"bits_per_second"/{gsub(/[,]/,"");print $2;exit}')
  record tput "$1" "$(awk -v b="${bps:-0}" 'BEGIN{printf "%.2f", b/1e9}')"
  lat=$(N taskset -c "$cli_cpu" sockperf ping-pong -i 127.0.0.1 -p 11111 --tcp -t "$DUR" 2>&1 | awk '/percentile 50.000/{print $NF}')
  record lat "$1" "${lat:-0}"
  cps=$(N taskset -c "$cli_cpu" "$BIN/loadgen" -mode cps -addr 127.0.0.1:8080 -d "${LG_DUR}s" -c 32 | jsonval perSecond)
  record cps "$1" "$(printf "%.0f" "${cps:-0}")"
}

for run in $(seq "$RUNS"); do
  for n in $TAX_SIZES; do
    echo "nodetax run $run/$RUNS: $n service ports" >&2
    measure "base$n"
    start_daemon "$n"
    measure "with$n"
    jumps_off
    measure "off$n"
    jumps_on
    record svc "$n" "$(printf "%.0f" "$(N "$BIN/loadgen" -mode cps -addr 10.96.0.10:80 -d "${LG_DUR}s" -c 32 | jsonval perSecond)")"
    stop_daemon
  done
done

ratios() { # metric with base → "median min max" of the per-run ratios (base and with measured back to back)
  paste <(awk -v m="$1" -v p="$2" '$1==m && $2==p {print $3}' "$results") <(awk -v m="$1" -v p="$3" '$1==m && $2==p {print $3}' "$results") |
    awk '$2>0 {printf "%.4f\n", $1/$2}' | sort -g | awk '{v[NR]=$1} END{if(NR==0){print "—"}else{print v[int((NR+1)/2)], v[1], v[NR]}}'
}
fmt() { # "median min max" → "1.02× (0.97–1.10×)"
  echo "$1" | awk '$1=="—"{print "—"; next} {if (NF==3 && $2!=$3) printf "%.2f× (%.2f–%.2f×)\n", $1, $2, $3; else printf "%.2f×\n", $1}'
}

first=$(echo "$TAX_SIZES" | awk '{print $1}')
rel() { awk -v a="$1" -v b="$2" 'BEGIN{if(a=="—"||b=="—"||b==0){print "—"}else{printf "%.2f×", a/b}}'; }
echo "Without the daemon → with it serving N service ports (each ratio the median of per-run ratios, their min–max beside it):"
echo
echo "| service ports | loopback throughput, Gbit/s | ping-pong p50, µs | new connections/s to a non-service port | connections/s through a ClusterIP |"
echo "|---:|---|---|---|---:|"
for n in $TAX_SIZES; do
  printf "| %s | %s → %s (%s) | %s → %s (%s) | %s → %s (%s) | %s |\n" "$n" \
    "$(value tput "base$n")" "$(value tput "with$n")" "$(fmt "$(ratios tput "with$n" "base$n")")" \
    "$(value lat "base$n")" "$(value lat "with$n")" "$(fmt "$(ratios lat "with$n" "base$n")")" \
    "$(value cps "base$n")" "$(value cps "with$n")" "$(fmt "$(ratios cps "with$n" "base$n")")" \
    "$(value svc "$n")"
done
echo
echo "With our rules in the path ÷ with them taken out of it (the daemon serving N service ports, the jumps into its chains"
echo "deleted and put back; conntrack and the nat hooks on in both, so this is what our rules cost; median of per-run ratios, min–max):"
echo
echo "| service ports | loopback throughput | ping-pong p50 | new connections/s to a non-service port |"
echo "|---:|---:|---:|---:|"
for n in $TAX_SIZES; do
  printf "| %s | %s | %s | %s |\n" "$n" "$(fmt "$(ratios tput "with$n" "off$n")")" "$(fmt "$(ratios lat "with$n" "off$n")")" "$(fmt "$(ratios cps "with$n" "off$n")")"
done
echo
echo "With N service ports against with $first (ratios of the medians above):"
echo
echo "| service ports | loopback throughput | ping-pong p50 | new connections/s to a non-service port | connections/s through a ClusterIP |"
echo "|---:|---:|---:|---:|---:|"
for n in $TAX_SIZES; do
  printf "| %s | %s | %s | %s | %s |\n" "$n" "$(rel "$(value tput "with$n")" "$(value tput "with$first")")" \
    "$(rel "$(value lat "with$n")" "$(value lat "with$first")")" "$(rel "$(value cps "with$n")" "$(value cps "with$first")")" \
    "$(rel "$(value svc "$n")" "$(value svc "$first")")"
done
