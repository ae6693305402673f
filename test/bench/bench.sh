#!/usr/bin/env bash
# make bench (and make bench-smoke with SMOKE=1): the data path of
# kube-userspace-proxy against direct, kernel DNAT, HAProxy, nginx (stream) and socat in one
# lab (client pod → node → backend pod over veth), interleaved A B A B, each
# figure the median of RUNS runs. Prints a table and writes it into
# docs/benchmarks.md (not in smoke mode). Needs root; cleans up on exit.
# BASE_BIN=path adds the path "base": another build of this daemon (make
# bench-ab builds one from a commit), measured interleaved with this one on the
# same service address, a fresh process of the build each time it is measured.
set -u
cd "$(dirname "$0")/../.."
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then RUNS=1; DUR=1; IDLE_NS="200"; UDP_RATES="5000"; UDP_DUR=0.5; UDP_WARMUP=0; UDP_CPU_FLOWS=1; UDP_CPU_PATHS="base proxy"; STEADY=2; LG_DUR=0.5; UDP_SIZES=64; UDP_FLOWS=1; PROG_N=100; PROG_RUNS=1; PROG_TYPES=NodePort; SETTLE=0.2
else RUNS=${RUNS:-5}; DUR=${DUR:-5}; IDLE_NS=${IDLE_NS:-"1000 5000"}; UDP_RATES=${UDP_RATES:-"10000 25000 50000 75000 100000 150000"}
  UDP_SIZES=${UDP_SIZES:-"64 1400"}; UDP_FLOWS=${UDP_FLOWS:-"1 64"}; PROG_N=${PROG_N:-1000,10000}; PROG_RUNS=${PROG_RUNS:-3}; fi
LG_DUR=${LG_DUR:-$DUR} # loadgen's runs; iperf3 takes whole seconds only
UDP_WARMUP=${UDP_WARMUP:-0.5} # seconds of the uncounted UDP try before each search
UDP_DUR=${UDP_DUR:-1}         # seconds of each counted UDP try
UDP_BURST=${UDP_BURST:-4}     # datagrams a UDP flow sends at once
UDP_CPU_RATE=${UDP_CPU_RATE:-20000} # datagrams/s of the UDP cost figures
UDP_CPU_FLOWS=${UDP_CPU_FLOWS:-"1 64"}
UDP_CPU_PATHS=${UDP_CPU_PATHS:-"nginx gofloor base proxy"} # each only when in PATHS
RATE=${RATE:-2000}
FLOWS_N=${FLOWS_N:-2000} # UDP flows of the memory count
BIN=${BIN:-bin}
[ "$(id -u)" = 0 ] || { echo "bench needs root (network namespaces)" >&2; exit 1; }
bash test/setup.sh bench # haproxy, iperf3, socat, sockperf when missing
ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"

. test/lab/lab.sh
. test/bench/results.sh # record, jsonval, median, value, cell, ratio, bench_lab, N, P, L
bench_lab kb


# Ports in TIME_WAIT are reused, as on a busy node: after 5000 idle connections through HAProxy and then
# nginx, the client and node held 10 000 ports in TIME_WAIT, and the daemon's 5000 that followed were reset.
N node sysctl -qw net.ipv4.tcp_tw_reuse=1
N client sysctl -qw net.ipv4.tcp_tw_reuse=1

# The paths, each on its own service address.
declare -A VIP=([direct]=10.251.19.12 [dnat]=10.96.9.1 [haproxy]=10.96.9.2 [socat]=10.96.9.3 [proxy]=10.96.9.4 [base]=10.96.9.4 [gofloor]=10.96.9.5 [ringfloor]=10.96.9.6 [nginx]=10.96.9.7)
# gofloor (test/bench/gofloor, the least a Go program does per connection) is
# not in the default set: add it to PATHS to see what the Go runtime costs,
# e.g. PATHS="haproxy gofloor proxy" TESTS="tput4 cps rps" (make bench-floor).
# With UDP it is the least any user-space process does per datagram (gofloor -udp):
# PATHS="direct nginx gofloor proxy" TESTS="udp udprt" (make bench-floor-udp).
# ringfloor is the same program on io_uring (gofloor -engine ring).
DEFAULT_PATHS="direct dnat haproxy nginx socat proxy"
# The smoke run keeps it under a minute: the paths whose code is ours or whose set-up can rot (the floors,
# HAProxy's and nginx's configurations), without kernel DNAT and socat (an iptables rule, a command line).
[ "$SMOKE" = 1 ] && DEFAULT_PATHS="direct haproxy nginx proxy gofloor ringfloor"
PATHS=${PATHS:-$DEFAULT_PATHS}
BASE_BIN=${BASE_BIN:-}
if [ -n "$BASE_BIN" ]; then
  [ -x "$BASE_BIN" ] || { echo "BASE_BIN=$BASE_BIN is not an executable" >&2; exit 1; }
  case " $PATHS " in
    *" base "*) ;;
    *" proxy "*) PATHS=$(for p in $PATHS; do [ "$p" = proxy ] && printf 'base '; printf '%s ' "$p"; done); PATHS=${PATHS% } ;;
    *) PATHS="$PATHS base" ;;
  esac
fi
# TESTS picks figures (all by default), e.g. TESTS="cps rps" PATHS="haproxy proxy" for a quick A/B.
# The smoke run leaves out tput4 (tput128 runs the same code) and counts idle connections through the daemon
# alone (the count is the same code for every path).
[ "$SMOKE" = 1 ] && TESTS=${TESTS:-"tput128 cps rps latency sys udp idle prog tax"}
TESTS=${TESTS:-"tput128 tput4 cps rps latency sys udp idle flows prog tax"}
want() { case " $TESTS " in *" $1 "*) return 0 ;; esac; return 1; }
runs() { case " $PATHS " in *" $1 "*) return 0 ;; esac; return 1; } # path $1 is measured
ours() { [ "$1" = proxy ] || [ "$1" = base ]; } # path $1 is a build of this daemon
N node iptables -w -t nat -A PREROUTING -d 10.96.9.1 -j DNAT --to-destination 10.251.19.12
for p in 8080:18080 9000:19000 5201:15201; do
  N node iptables -w -t nat -A PREROUTING -d 10.96.9.2 -p tcp --dport "${p%%:*}" -j REDIRECT --to-ports "${p#*:}"
  N node iptables -w -t nat -A PREROUTING -d 10.96.9.3 -p tcp --dport "${p%%:*}" -j REDIRECT --to-ports "2${p#*:1}"
  N node iptables -w -t nat -A PREROUTING -d 10.96.9.5 -p tcp --dport "${p%%:*}" -j REDIRECT --to-ports "3${p#*:1}"
  N node iptables -w -t nat -A PREROUTING -d 10.96.9.6 -p tcp --dport "${p%%:*}" -j REDIRECT --to-ports "4${p#*:1}"
  N node iptables -w -t nat -A PREROUTING -d 10.96.9.7 -p tcp --dport "${p%%:*}" -j REDIRECT --to-ports "5${p#*:1}"
done
N node iptables -w -t nat -A PREROUTING -d 10.96.9.3 -p udp --dport 8081 -j REDIRECT --to-ports 28081
N node iptables -w -t nat -A PREROUTING -d 10.96.9.7 -p udp --dport 8081 -j REDIRECT --to-ports 58081
N node iptables -w -t nat -A PREROUTING -d 10.96.9.5 -p udp --dport 8081 -j REDIRECT --to-ports 38081
start_haproxy() { P haproxy -f "$work/haproxy.cfg" >>"$work/haproxy.log" 2>&1 & }
start_nginx() { P nginx -c "$work/nginx.conf" -e "$work/nginx.log" >>"$work/nginx.log" 2>&1 & }
# The daemon serves /metrics on the node's loopback: the bench reads the Go
# runtime's figures around each run (runtimetail).
METRICS=127.0.0.1:10249
# Which build serves the service address: proxy (this one, $BIN's) or base
# (BASE_BIN's, copied under the same name so that proxypid finds either).
DAEMON=proxy
daemon_bin() { if [ "$DAEMON" = base ]; then echo "$work/base/kube-userspace-proxy"; else echo "$BIN/kube-userspace-proxy"; fi; }
if [ -n "$BASE_BIN" ]; then mkdir -p "$work/base" && cp "$BASE_BIN" "$work/base/kube-userspace-proxy"; fi
start_proxy() { # extra daemon flags in $@
  P env ${PROXY_ENV:-} "$(daemon_bin)" --manifests "$work/svc.yaml" --connection-log none --log-level warn \
    --metrics-bind-address "$METRICS" --healthz-bind-address "" ${PROXY_ARGS:-} "$@" >>"$work/proxy.log" 2>&1 &
}
# serve_paths: the backend pod (HTTP 8080, UDP echo 8081, TCP echo 9000, iperf3 5201) and every path of PATHS,
# started under the current pinning (results.sh); stop_paths ends them all.
serve_paths() {
  L pod1 "$BIN/backend" --name pod1 --tcp :8080 --udp :8081 --echo :9000 ${BACKEND_UDP_BUFFER:+--udp-buffer "$BACKEND_UDP_BUFFER"} >/dev/null 2>&1 &
  L pod1 iperf3 -s -p 5201 -D >/dev/null 2>&1
  wait_until 10 N node curl -s --max-time 1 http://10.251.19.12:8080/ || { echo "backend down" >&2; exit 1; }
  # HAProxy as its documentation tunes it for L4 splicing: pipes as large as
  # ours (tune.pipesize; the kernel's default is 64 KiB against our 1 MiB),
  # one thread per CPU it runs on, splicing both ways when it pays.
  cat > "$work/haproxy.cfg" <<EOF
global
  maxconn 7000
  nbthread $PROXY_NCPU
  tune.pipesize 1048576
defaults
  mode tcp
  option splice-auto
  timeout connect 5s
  timeout client 1h
  timeout server 1h
listen http
  bind :18080
  server pod1 10.251.19.12:8080
listen echo
  bind :19000
  server pod1 10.251.19.12:9000
listen iperf
  bind :15201
  server pod1 10.251.19.12:5201
EOF
  start_haproxy
  # nginx's stream module: a second L4 peer, and the one for UDP. One worker
  # per CPU it runs on, as HAProxy's threads; reuseport on every listener, as
  # nginx's documentation asks for UDP (a client's datagrams then stay with one
  # worker, so one session per client address and port, as the daemon's flows).
  cat > "$work/nginx.conf" <<EOF
load_module /usr/lib/nginx/modules/ngx_stream_module.so;
daemon off;
worker_processes $PROXY_NCPU;
worker_rlimit_nofile 20000;
pid $work/nginx.pid;
error_log $work/nginx.log warn;
events { worker_connections 16000; } # 5000 idle connections are 10 000 (client and upstream) in one worker
stream {
  server { listen 58080 reuseport; proxy_pass 10.251.19.12:8080; }
  server { listen 59000 reuseport; proxy_pass 10.251.19.12:9000; proxy_timeout 1h; }
  server { listen 55201 reuseport; proxy_pass 10.251.19.12:5201; proxy_timeout 1h; }
  server { listen 58081 udp reuseport; proxy_pass 10.251.19.12:8081; proxy_timeout 30s; }
}
EOF
  runs nginx && start_nginx
  for p in 8080:28080 9000:29000 5201:25201; do
    P socat TCP-LISTEN:"${p#*:}",fork,reuseaddr TCP:10.251.19.12:"${p%%:*}" >/dev/null 2>&1 &
  done
  P socat UDP-LISTEN:28081,fork,reuseaddr UDP:10.251.19.12:8081 >/dev/null 2>&1 &
  if runs gofloor; then
    P "$BIN/gofloor" -listen :38080=10.251.19.12:8080 -listen :39000=10.251.19.12:9000 -listen :35201=10.251.19.12:5201 -udp :38081=10.251.19.12:8081 \
      >"$work/gofloor.log" 2>&1 &
  fi
  if runs ringfloor; then
    P "$BIN/gofloor" -engine ring -listen :48080=10.251.19.12:8080 -listen :49000=10.251.19.12:9000 -listen :45201=10.251.19.12:5201 \
      >"$work/ringfloor.log" 2>&1 &
  fi
  cat > "$work/svc.yaml" <<'EOF'
apiVersion: v1
kind: Service
metadata: {name: bench, namespace: bench}
spec:
  clusterIP: 10.96.9.4
  ports:
  - {name: http, port: 8080, protocol: TCP}
  - {name: echo, port: 9000, protocol: TCP}
  - {name: iperf, port: 5201, protocol: TCP}
  - {name: udp, port: 8081, protocol: UDP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: bench, namespace: bench, labels: {kubernetes.io/service-name: bench}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}, {name: echo, port: 9000, protocol: TCP}, {name: iperf, port: 5201, protocol: TCP}, {name: udp, port: 8081, protocol: UDP}]
endpoints: [{addresses: [10.251.19.12]}]
EOF
  start_proxy
  for p in $PATHS; do
    wait_until 10 N client curl -s --max-time 1 "http://${VIP[$p]}:8080/" || { echo "path $p does not answer" >&2; cat "$work/proxy.log" "$work/haproxy.log" >&2; exit 1; }
  done
}
stop_paths() {
  local ns pid
  for ns in node pod1; do
    for pid in $(ip netns pids "$LAB-$ns"); do kill "$pid" 2>/dev/null; done
  done
  wait_until 10 sh -c "[ -z \"\$(ip netns pids $LAB-node; ip netns pids $LAB-pod1)\" ]" || { echo "the paths did not stop" >&2; exit 1; }
  rm -f "$work/nginx.pid"
}
proxypid() { # the process serving a path, for CPU and memory
  case $1 in
    proxy | base) pgrep -f "kube-userspace-proxy --manifests $work" | head -1 ;;
    haproxy) pgrep -f "haproxy -f $work" | tail -1 ;;
    gofloor) pgrep -f "$BIN/gofloor -listen :38080" | head -1 ;;
    ringfloor) pgrep -f "$BIN/gofloor -engine ring" | head -1 ;;
    nginx) pgrep -P "$(cat "$work/nginx.pid" 2>/dev/null || echo 0)" | tr '\n' ' ' ;; # its workers
  esac
}
cputicks() { local p; for p in $1; do cat "/proc/$p/stat"; done | awk '{t+=$14+$15} END{print t}'; } # of each pid in $1
HZ=$(getconf CLK_TCK)
cpusince() { awk -v t=$(($(cputicks "$1") - $2)) -v hz="$HZ" 'BEGIN{printf "%.4f", t/hz}'; } # pid ticks0 → CPU seconds since


iperf() { # path writesize → Gbit/s; CPU s/GB of the proxy process
  local p=$1 len=$2 pid t0 out bps bytes
  pid=$(proxypid "$p"); [ -n "$pid" ] && t0=$(cputicks "$pid")
  out=$(L client iperf3 -c "${VIP[$p]}" -p 5201 -t "$DUR" -l "$len" -J 2>/dev/null)
  bps=$(echo "$out" | awk '/"sum_received"/{f=1} f&&/"bits_per_second"/{gsub(/[,]/,"");print $2;exit}')
  bytes=$(echo "$out" | awk '/"sum_received"/{f=1} f&&/"bytes"/{gsub(/[,]/,"");print $2;exit}')
  record "tput_${len}" "$p" "$(awk -v b="${bps:-0}" 'BEGIN{printf "%.2f", b/1e9}')"
  if [ -n "$pid" ] && [ -n "${bytes:-}" ]; then
    record "cpu_per_gb_${len}" "$p" "$(awk -v c="$(cpusince "$pid" "$t0")" -v b="$bytes" 'BEGIN{printf "%.2f", c/(b/1e9)}')"
  fi
}
rate() { # path mode → operations/s; CPU µs per operation of the proxy process
  local p=$1 mode=$2 pid t0 out
  pid=$(proxypid "$p"); [ -n "$pid" ] && t0=$(cputicks "$pid")
  ours "$p" && scrape "$work/before.prom"
  out=$(L client "$BIN/loadgen" -mode "$mode" -addr "${VIP[$p]}:8080" -d "${LG_DUR}s" -c 32)
  record "$mode" "$p" "$(echo "$out" | jsonval perSecond)"
  if [ -n "$pid" ]; then
    record "cpu_per_$mode" "$p" "$(awk -v c="$(cpusince "$pid" "$t0")" -v n="$(echo "$out" | jsonval count)" 'BEGIN{if(n>0) printf "%.1f", c/n*1e6}')"
  fi
  if ours "$p"; then
    scrape "$work/after.prom"
    record "alloc_b_$mode" "$p" "$(runtimetail -ops "$(echo "$out" | jsonval count)" | jsonval allocBytesPerOp | awk '{printf "%.0f", $1}')"
  fi
}
# The tail apart (latency runs): what the kernel says of every path's serving process — how long its threads
# waited for a CPU per time slice (/proc/PID/task/*/schedstat: run-queue wait, slices) — and the machine's softirq
# time per request; of this proxy also the Go runtime's view (runtimetail): how long a runnable goroutine waited
# for a thread (p99, p99.9), the collections and the longest stop-the-world pause in the run.
runq() { local p; for p in $1; do cat /proc/"$p"/task/*/schedstat 2>/dev/null; done | awk '{w+=$2; n+=$3} END{print w+0, n+0}'; }
softirq() { awk '/^cpu /{print $8}' /proc/stat; }
steal() { awk '/^cpu /{print $9}' /proc/stat; } # time the hypervisor ran another guest on our CPUs
scrape() { N node curl -sf --max-time 5 "http://$METRICS/metrics" >"$1" || { echo "bench: cannot read the daemon's /metrics" >&2; exit 1; }; }
runtimetail() { "$BIN/runtimetail" -before "$work/before.prom" -after "$work/after.prom" "$@"; }
latency() { # path → p50/p99/p99.9 at RATE req/s, and the tail's parts
  local p=$1 pid q0 q1 si0 st0 lat n tail
  pid=$(proxypid "$p"); q0=$(runq "$pid"); si0=$(softirq); st0=$(steal)
  ours "$p" && scrape "$work/before.prom"
  lat=$(L client "$BIN/loadgen" -mode latency -addr "${VIP[$p]}:8080" -d "${LG_DUR}s" -c 16 -rate "$RATE")
  q1=$(runq "$pid")
  record p50 "$p" "$(echo "$lat" | jsonval p50us)"
  record p99 "$p" "$(echo "$lat" | jsonval p99us)"
  record p999 "$p" "$(echo "$lat" | jsonval p999us)"
  n=$(awk -v r="$RATE" -v d="$LG_DUR" 'BEGIN{printf "%.0f", r*d}')
  record softirq_us "$p" "$(awk -v t=$(($(softirq) - si0)) -v hz="$HZ" -v n="$n" 'BEGIN{printf "%.1f", t/hz/n*1e6}')"
  record steal_ms "$p" "$(awk -v t=$(($(steal) - st0)) -v hz="$HZ" 'BEGIN{printf "%.0f", t/hz*1e3}')"
  if [ -n "$pid" ]; then
    record runq_us "$p" "$(awk -v a="$q0" -v b="$q1" 'BEGIN{split(a,x," "); split(b,y," "); s=y[2]-x[2]; printf "%.1f", (s>0 ? (y[1]-x[1])/s/1000 : 0)}')"
  fi
  if ours "$p"; then
    scrape "$work/after.prom"
    tail=$(runtimetail)
    record sched_p99 "$p" "$(echo "$tail" | jsonval schedP99us)"
    record sched_p999 "$p" "$(echo "$tail" | jsonval schedP999us)"
    record gc_cycles "$p" "$(echo "$tail" | jsonval gcCycles)"
    record pause_max "$p" "$(echo "$tail" | jsonval pauseMaxUs)"
  fi
}

# The system calls and context switches of each path's serving process per connection (cps) and per keep-alive
# request (rps), counted by perf stat in runs of their own: a tracepoint on every system call costs the process a
# little, so the rate figures are measured without it. perf attaches as the load starts: the first milliseconds
# of a 5-second run may go uncounted, the same for every path.
syscounts() { # path mode
  local p=$1 mode=$2 pids perfpid out n
  pids=$(proxypid "$p" | tr -s ' \n' ',' | sed 's/,$//')
  [ -n "$pids" ] || return 0
  perf stat -x, -e raw_syscalls:sys_enter,context-switches -p "$pids" -o "$work/perf.out" 2>/dev/null &
  perfpid=$!
  out=$(L client "$BIN/loadgen" -mode "$mode" -addr "${VIP[$p]}:8080" -d "${LG_DUR}s" -c 32)
  kill -INT "$perfpid"; wait "$perfpid"
  n=$(echo "$out" | jsonval count)
  record "sys_per_$mode" "$p" "$(awk -F, -v n="$n" '$3=="raw_syscalls:sys_enter" && n>0 {printf "%.2f", $1/n}' "$work/perf.out")"
  record "cs_per_$mode" "$p" "$(awk -F, -v n="$n" '$3=="context-switches" && n>0 {printf "%.2f", $1/n}' "$work/perf.out")"
}
# The same per MB moved with 4 KiB writes: how many wake-ups a stream of small writes costs each path.
syscounts_stream() { # path
  local p=$1 pids perfpid out bytes
  pids=$(proxypid "$p" | tr -s ' \n' ',' | sed 's/,$//')
  [ -n "$pids" ] || return 0
  perf stat -x, -e raw_syscalls:sys_enter,context-switches -p "$pids" -o "$work/perf.out" 2>/dev/null &
  perfpid=$!
  out=$(L client iperf3 -c "${VIP[$p]}" -p 5201 -t "$DUR" -l 4K -J 2>/dev/null)
  kill -INT "$perfpid"; wait "$perfpid"
  bytes=$(echo "$out" | awk '/"sum_received"/{f=1} f&&/"bytes"/{gsub(/[,]/,"");print $2;exit}')
  record sys_per_mb_4K "$p" "$(awk -F, -v b="${bytes:-0}" '$3=="raw_syscalls:sys_enter" && b>0 {printf "%.1f", $1/(b/1e6)}' "$work/perf.out")"
  record cs_per_mb_4K "$p" "$(awk -F, -v b="${bytes:-0}" '$3=="context-switches" && b>0 {printf "%.2f", $1/(b/1e6)}' "$work/perf.out")"
}
measure_tcp() {
for run in $(seq "$RUNS"); do
  for p in $PATHS; do
    echo "run $run/$RUNS: $p" >&2
    serve_with "$p"
    want tput128 && iperf "$p" 128K
    want tput4 && iperf "$p" 4K
    want cps && rate "$p" cps
    want rps && rate "$p" rps
    want latency && latency "$p"
    if want sys; then syscounts "$p" cps; syscounts "$p" rps; syscounts_stream "$p"; fi
  done
done
}

# UDP: the highest rate with < 0.1 % loss, one flow and 64 flows, each figure the median of RUNS searches with the
# paths interleaved (one search per path, then the next run): one search per path, minutes apart, moved the direct
# path's own figure by 1.8× from run to run. The load generator paces each flow by the clock in sends of
# UDP_BURST datagrams (loadgen -burst): a millisecond's worth at once overflowed the backend's socket at rates the
# path carried, and made the figures a tail of the scheduler (docs/benchmarks-history.md, fourteenth round).
# udp_search PATH SIZE FLOWS: the rates step up until one loses ≥ 0.1 %; then three halvings of the gap between the
# last rate that passed and the first that failed (the steps alone made every figure one of a few values, and a
# ratio of two neighbours a step apart read as a 0.5× or a 2×). A rate fails only when it fails twice in a row, after
# an uncounted warm-up try: one try in three or four of the first size change lost a few dozen datagrams in the
# backend's socket at a rate four times lower than the path carried.
# udp_once RATE [SECONDS] and udp_try RATE run inside udp_search and see its p, size, flows and best.
udp_once() {
  out=$(L client "$BIN/loadgen" -mode udp -addr "${VIP[$p]}:8081" -d "${2:-$UDP_DUR}s" -size "$size" -flows "$flows" -burst "$UDP_BURST" -rate "$1")
  loss=$(echo "$out" | jsonval loss); pps=$(echo "$out" | jsonval pps)
  awk -v l="${loss:-1}" 'BEGIN{exit !(l < 0.001)}' || return 1
  best=$(awk -v a="$best" -v b="$pps" 'BEGIN{printf "%.0f", (b > a ? b : a)}')
}
udp_try() { udp_once "$1" || udp_once "$1"; }
udp_search() {
  local p=$1 size=$2 flows=$3 r mid pass=0 fail=0 best=0
  [ "$UDP_WARMUP" = 0 ] || udp_once "${UDP_RATES%% *}" "$UDP_WARMUP" || true
  best=0
  for r in $UDP_RATES; do
    if udp_try "$r"; then pass=$r; else fail=$r; break; fi
  done
  if [ "$fail" != 0 ]; then
    for _ in 1 2 3; do
      mid=$(((pass + fail) / 2))
      if udp_try "$mid"; then pass=$mid; else fail=$mid; fi
    done
  fi
  record "udp_${size}_${flows}" "$p" "$best"
}
measure_udp() {
if want udp; then
  for size in $UDP_SIZES; do
    for flows in $UDP_FLOWS; do
      for run in $(seq "$RUNS"); do
        for p in direct dnat nginx socat gofloor base proxy; do
          runs "$p" && serve_with "$p" && udp_search "$p" "$size" "$flows"
        done
      done
    done
  done
fi

# UDP cost: the serving process's CPU per datagram at a fixed rate that every path carries (64 B, one flow and 64
# flows; requests and replies both count), reported as datagrams per CPU-second, for nginx and the daemon
# interleaved. With 64 flows paced by the clock a flow rarely has two datagrams queued, so nothing can be sent
# as a batch: the figure is the cost of one datagram at a time.
if want udp; then
  for run in $(seq "$RUNS"); do
    for flows in $UDP_CPU_FLOWS; do
      for p in $UDP_CPU_PATHS; do
        runs "$p" || continue
        serve_with "$p"
        pid=$(proxypid "$p"); t0=$(cputicks "$pid")
        out=$(L client "$BIN/loadgen" -mode udp -addr "${VIP[$p]}:8081" -d "${LG_DUR}s" -size 64 -flows "$flows" -burst "$UDP_BURST" -rate "$UDP_CPU_RATE")
        record "udp_per_core_$flows" "$p" "$(awk -v c="$(cpusince "$pid" "$t0")" -v s="$(echo "$out" | jsonval sent)" -v r="$(echo "$out" | jsonval received)" 'BEGIN{if(c>0) printf "%.0f", (s+r)/c}')"
      done
    done
  done
fi

# udprt (not in the default set): all CPU time of the machine (/proc/stat: user, nice, system, irq, softirq) per UDP
# round trip at a rate every path carries, 1 400 B, one flow and 64: what a path costs the machine, which is the
# ceiling of its UDP figures where the CPUs are the limit (docs/benchmarks-history.md, fourteenth round).
# e.g. TESTS=udprt PATHS="direct dnat nginx proxy" test/bench/bench.sh
busyticks() { awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat; }
if want udprt; then
  for run in $(seq "$RUNS"); do
    for flows in 1 64; do
      for p in direct dnat nginx socat gofloor base proxy; do
        runs "$p" || continue
        serve_with "$p"
        b0=$(busyticks)
        out=$(L client "$BIN/loadgen" -mode udp -addr "${VIP[$p]}:8081" -d "${LG_DUR}s" -size 1400 -flows "$flows" -burst "$UDP_BURST" -rate "${UDPRT_RATE:-10000}")
        record "udp_rt_us_$flows" "$p" "$(awk -v t=$(($(busyticks) - b0)) -v hz="$HZ" -v r="$(echo "$out" | jsonval received)" 'BEGIN{if(r>0) printf "%.1f", t/hz/r*1e6}')"
      done
    done
  done
fi
}

# Idle connections: descriptors and RSS per connection of the serving process
# (of nginx's workers together).
fds() { local p; for p in $1; do ls "/proc/$p/fd"; done | wc -l; }
rss() { local p; for p in $1; do cat "/proc/$p/status"; done | awk '/VmRSS/{t+=$2} END{print t}'; }
# The RSS once it stops moving (within 64 KiB for STEADY samples 200 ms apart, a second by default; at most 6 s): a fresh daemon still hands startup memory
# back for a moment, which read as a negative cost per connection once an idle one cost ~2 KiB (and, with a
# window of 200 ms, still did once in three counts of 1000).
steady_rss() {
  local a b i still=0
  a=$(rss "$1")
  for i in $(seq 30); do
    sleep 0.2; b=$(rss "$1")
    if [ $((b > a ? b - a : a - b)) -le 64 ]; then
      still=$((still + 1)); [ "$still" -ge "${STEADY:-5}" ] && break
    else
      still=0; a=$b
    fi
  done
  echo "$b"
}
# A fresh daemon (flags in $@).
restart_proxy() {
  kill "$(proxypid proxy)"; wait_until 10 sh -c "! pgrep -f 'kube-userspace-proxy --manifests $work' >/dev/null"
  start_proxy "$@"
  wait_until 10 N client curl -s --max-time 1 "http://${VIP[proxy]}:8080/" >/dev/null || { echo "$DAEMON did not come back" >&2; exit 1; }
}
# restart_build BUILD [flags]: a fresh process of that build (proxy or base) on the service address.
restart_build() { DAEMON=$1; shift; restart_proxy "$@"; }
# serve_with PATH: when PATH is a build of this daemon other than the one serving, that build takes over.
serve_with() { ours "$1" && [ "$1" != "$DAEMON" ] || return 0; restart_build "$1"; }
# A fresh process for path $1 before a memory count, the same for every path:
# one that carried the throughput tests holds what it grew meanwhile.
restart_path() {
  case $1 in
    proxy | base) restart_build "$1" ;;
    haproxy)
      kill "$(proxypid haproxy)"; wait_until 10 sh -c "! pgrep -f 'haproxy -f $work' >/dev/null"
      start_haproxy ;;
    nginx)
      local master; master=$(cat "$work/nginx.pid")
      kill "$master"; wait_until 10 sh -c "! pgrep -P $master >/dev/null && ! [ -e $work/nginx.pid ]"
      start_nginx ;;
  esac
  wait_until 10 N client curl -s --max-time 1 "http://${VIP[$1]}:8080/" >/dev/null || { echo "$1 did not come back" >&2; exit 1; }
}
measure_memory() {
for p in haproxy nginx base proxy; do
  want idle || break
  runs "$p" || continue
  [ "$SMOKE" = 1 ] && ! ours "$p" && continue
  for n in $IDLE_NS; do
    # A fresh process: the one that ran the throughput tests has a grown heap that the Go runtime may hand back
    # while the connections open, which made the RSS delta meaningless (even negative).
    restart_path "$p"
    pid=$(proxypid "$p")
    fd0=$(fds "$pid"); rss0=$(steady_rss "$pid")
    mkfifo "$work/hold"
    L client "$BIN/loadgen" -mode idle -addr "${VIP[$p]}:9000" -n "$n" <"$work/hold" >"$work/idle.out" 2>&1 &
    lg=$!
    exec 9>"$work/hold"
    wait_until 120 grep -q ready "$work/idle.out" || { echo "idle $p $n failed: $(cat "$work/idle.out")" >&2; }
    sleep 1
    fd1=$(fds "$pid"); rss1=$(rss "$pid")
    record "idle_fd_$n" "$p" "$(awk -v a="$fd0" -v b="$fd1" -v n="$n" 'BEGIN{printf "%.2f", (b-a)/n}')"
    record "idle_kib_$n" "$p" "$(awk -v a="$rss0" -v b="$rss1" -v n="$n" 'BEGIN{printf "%.1f", (b-a)/n}')"
    exec 9>&-
    wait "$lg"
    rm -f "$work/hold"
    sleep "${SETTLE:-2}" # the closed connections leave before the next count
  done
done

# UDP flows: RSS per live flow once flows have come and gone, from the fresh process (FLOWS_N clients, each a
# flow sending 1 400 B datagrams for 1.5 s, twice). The daemon's flows of the first round expire before the second
# (--udp-timeout 2s for this count, and the count waits until their sockets are closed): memory a flow left behind is
# what the next one reuses, and a buffer the heap hands over zeroed is resident whatever the datagrams touch. nginx
# keeps its 30 s timeout and holds both rounds. Live flows are counted as the descriptors they added (one socket a
# flow in the daemon; nginx added ~1.5 a session).
for p in nginx base proxy; do
  want flows || break
  runs "$p" || continue
  if ours "$p"; then restart_build "$p" --udp-timeout 2s; else restart_path "$p"; fi
  pid=$(proxypid "$p")
  fd0=$(fds "$pid"); rss0=$(steady_rss "$pid")
  for round in 1 2; do
    L client "$BIN/loadgen" -mode udp -addr "${VIP[$p]}:8081" -d 1.5s -size 1400 -flows "$FLOWS_N" -rate "$((FLOWS_N * 4))" >/dev/null
    if ours "$p" && [ "$round" = 1 ]; then
      wait_until 20 sh -c "[ \$(for q in $pid; do ls /proc/\$q/fd; done | wc -l) -le $fd0 ]" || echo "UDP flows of $p did not expire" >&2
    fi
  done
  fd1=$(fds "$pid"); rss1=$(rss "$pid")
  record udp_flow_kib "$p" "$(awk -v a="$rss0" -v b="$rss1" -v f="$((fd1 - fd0))" 'BEGIN{if(f>0) printf "%.1f", (b-a)/f}')"
done
}


# The settings: pinned (every proxy on PROXY_CPUS, load and backend on LOAD_CPUS) and shared (nothing pinned, as
# on a node). Idle connections, UDP flows' memory, rule programming and the node tax are the same code in both and
# run once, in the first setting.
SETTINGS=${SETTINGS:-"pinned shared"}
for setting in $SETTINGS; do
  pinning "$setting"
  results="$work/results.$setting"
  : >"$results"
  echo "== $setting" >&2
  serve_paths
  measure_tcp
  measure_udp
  [ "$setting" = "${SETTINGS%% *}" ] && measure_memory
  stop_paths
done

# table_of SETTING: the table of one setting's figures.
table_of() {
  results="$work/results.$1"
  table="$work/table.$1.md"
{
  declare -A LABEL=([direct]=direct [dnat]="kernel DNAT" [haproxy]=HAProxy [socat]=socat [proxy]="this proxy" [base]="this proxy, base build" [gofloor]="Go floor" [ringfloor]="Go ring floor" [nginx]="nginx stream")
  head="| metric"; rule="|---"
  for p in $PATHS; do head="$head | ${LABEL[$p]}"; rule="$rule|---:"; done
  if runs gofloor; then head="$head | Go floor ÷ HAProxy | proxy ÷ Go floor"; rule="$rule|---:|---:"; fi
  if runs ringfloor; then head="$head | ring floor ÷ HAProxy | ring floor ÷ Go floor"; rule="$rule|---:|---:"; fi
  if runs base; then head="$head | proxy ÷ base"; rule="$rule|---:"; fi
  echo "$head | proxy ÷ direct | proxy ÷ HAProxy | proxy ÷ nginx |"
  echo "$rule|---:|---:|---:|"
  while read -r m label; do
    grep -q "^$m " "$results" || continue # a figure this run did not measure
    row="| $label"
    for p in $PATHS; do row="$row | $(cell "$m" "$p")"; done
    if runs gofloor; then
      row="$row | $(ratio "$(value "$m" gofloor)" "$(value "$m" haproxy)") | $(ratio "$(value "$m" proxy)" "$(value "$m" gofloor)")"
    fi
    if runs ringfloor; then
      row="$row | $(ratio "$(value "$m" ringfloor)" "$(value "$m" haproxy)") | $(ratio "$(value "$m" ringfloor)" "$(value "$m" gofloor)")"
    fi
    if runs base; then row="$row | $(ratio "$(value "$m" proxy)" "$(value "$m" base)")"; fi
    row="$row | $(ratio "$(value "$m" proxy)" "$(value "$m" direct)") | $(ratio "$(value "$m" proxy)" "$(value "$m" haproxy)") | $(ratio "$(value "$m" proxy)" "$(value "$m" nginx)") |"
    echo "$row"
  done <<EOF
tput_128K TCP throughput, 128 KiB writes (Gbit/s)
tput_4K TCP throughput, 4 KiB writes (Gbit/s)
cpu_per_gb_128K proxy CPU seconds per GB, 128 KiB writes
cpu_per_gb_4K proxy CPU seconds per GB, 4 KiB writes
cps new connections/s (HTTP, Connection: close, 32 clients)
cpu_per_cps proxy CPU µs per connection
alloc_b_cps Go: bytes allocated per connection
rps keep-alive requests/s (32 connections)
cpu_per_rps proxy CPU µs per keep-alive request
alloc_b_rps Go: bytes allocated per keep-alive request
sys_per_cps system calls per connection (perf stat, a run of its own)
cs_per_cps context switches per connection
sys_per_rps system calls per keep-alive request
cs_per_rps context switches per keep-alive request
sys_per_mb_4K system calls per MB moved, 4 KiB writes (perf stat, a run of its own)
cs_per_mb_4K context switches per MB moved, 4 KiB writes
p50 p50 latency at $RATE req/s (µs)
p99 p99 latency at $RATE req/s (µs)
p999 p99.9 latency at $RATE req/s (µs)
runq_us the latency run: the serving process's wait for a CPU per time slice (µs, kernel schedstat)
softirq_us the latency run: the machine's softirq CPU per request (µs)
steal_ms the latency run: time the hypervisor gave the machine's CPUs to another guest (ms, both CPUs, /proc/stat steal)
sched_p99 the latency run, Go: a runnable goroutine's wait for a thread, p99 (µs, buckets a power of 2 apart)
sched_p999 the latency run, Go: the same wait, p99.9 (µs)
gc_cycles the latency run, Go: collections
pause_max the latency run, Go: the longest stop-the-world pause (µs, bucket bound)
udp_64_1 UDP 64 B, 1 flow: pps at < 0.1 % loss
udp_64_64 UDP 64 B, 64 flows: pps at < 0.1 % loss
udp_1400_1 UDP 1400 B, 1 flow: pps at < 0.1 % loss
udp_1400_64 UDP 1400 B, 64 flows: pps at < 0.1 % loss
udp_per_core_1 UDP datagrams forwarded per proxy CPU-second (64 B, 1 flow at $UDP_CPU_RATE/s, both directions)
udp_per_core_64 UDP datagrams forwarded per proxy CPU-second (64 B, 64 flows at $UDP_CPU_RATE/s, both directions)
udp_rt_us_1 machine CPU µs per UDP round trip (1 400 B, 1 flow at ${UDPRT_RATE:-10000}/s)
udp_rt_us_64 machine CPU µs per UDP round trip (1 400 B, 64 flows at ${UDPRT_RATE:-10000}/s)
$(for n in $IDLE_NS; do echo "idle_fd_$n descriptors per idle connection ($n open)"; echo "idle_kib_$n RSS KiB per idle connection ($n open)"; done)
udp_flow_kib RSS KiB per UDP flow ($FLOWS_N live, after $FLOWS_N others came and went)
EOF
} >"$table"
}
for setting in $SETTINGS; do
  table_of "$setting"
  echo
  echo "$setting:"
  cat "$table"
done
echo
if want prog; then
  echo "Rule programming (progbench):"
  go build -o "$BIN/progbench" ./test/bench/progbench && "$BIN/progbench" -daemon "$BIN/kube-userspace-proxy" -n "$PROG_N" -runs "$PROG_RUNS" -types "${PROG_TYPES:-ClusterIP,NodePort}" >"$work/prog.md" 2>"$work/prog.err" ||
    { echo "progbench failed:" >&2; tail -20 "$work/prog.err" >&2; exit 1; }
  cat "$work/prog.md"
fi

if want tax; then
  echo "Node tax (test/bench/nodetax.sh):"
  SMOKE=$SMOKE BIN=$BIN bash test/bench/nodetax.sh >"$work/tax.md" || { echo "nodetax failed" >&2; exit 1; }
  cat "$work/tax.md"
fi

# Only a full run (all paths, all figures) replaces the published table.
if [ "$SMOKE" != 1 ] && [ "$PATHS" = "$DEFAULT_PATHS" ] && [ "$TESTS" = "tput128 tput4 cps rps latency sys udp idle flows prog tax" ] && [ "$SETTINGS" = "pinned shared" ]; then
  doc=docs/benchmarks.md
  {
    sed '/<!-- bench:start -->/,$d' "$doc" # what comes before the table
    echo "<!-- bench:start -->"
    echo "## Data path (make bench)"
    echo
    echo "Run $(date -u +%Y-%m-%d) on $(nproc) vCPU $(awk -F': ' '/model name/{print $2; exit}' /proc/cpuinfo), $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo), Linux $(uname -r);"
    echo "$(haproxy -v | head -1 | cut -d' ' -f1-3), $(nginx -v 2>&1 | sed 's/^nginx version: //'), $(iperf3 --version | head -1 | cut -d' ' -f1-2), $(socat -V | sed -n 's/^socat version \([^ ]*\).*/socat \1/p')."
    echo "Command: \`make bench\` (test/bench/bench.sh: $RUNS interleaved runs of ${DUR} s per figure, median; a UDP figure the median of $RUNS interleaved searches of ${UDP_DUR} s tries, each client flow paced by the clock in sends of $UDP_BURST datagrams). Lab: client pod → node → backend pod over veth in network namespaces;"
    pinned_ncpu=$(taskset -c "$PROXY_CPUS" nproc)
    echo "Two settings, each with its own table: **pinned**, each proxy (this one, HAProxy, nginx, socat, the Go floors) on CPU $PROXY_CPUS, load generators and the backend on CPU $LOAD_CPUS;"
    echo "and **shared cores**, nothing pinned, as on a node where the proxy shares its cores with the pods it serves. Each cell is the median with the runs' spread (min–max)."
    echo "HAProxy (mode tcp, splice-auto, \`tune.pipesize 1048576\` as our pipes, \`nbthread\` the CPUs it may use: $pinned_ncpu pinned, $NCPU shared), nginx (stream module, TCP and UDP, \`worker_processes\` the same, \`reuseport\` on every listener) and socat listen behind the same kind of REDIRECT as this proxy;"
    echo "kernel DNAT is what kube-proxy's iptables mode does. The latency run's tail rows are read in \"The tail apart\" above."
    for setting in $SETTINGS; do
      echo
      case $setting in pinned) echo "### Pinned" ;; shared) echo "### Shared cores" ;; esac
      echo
      cat "$work/table.$setting.md"
    done
    echo
    echo "The peers' configurations in this run (the last setting's):"
    echo
    echo '```'
    echo "# haproxy -f haproxy.cfg"
    cat "$work/haproxy.cfg"
    echo "# nginx -c nginx.conf"
    sed "s|$work/||" "$work/nginx.conf"
    echo '```'
    echo
    echo "socat: \`socat TCP-LISTEN:PORT,fork,reuseaddr TCP:BACKEND\` (and \`UDP-LISTEN\`); this proxy: \`kube-userspace-proxy --manifests svc.yaml --connection-log none\`."
    echo
    echo "Rule programming in the same run:"
    echo
    cat "$work/prog.md"
    echo
    echo "Node tax in the same run (test/bench/nodetax.sh): the node's own traffic that is no Service's, in a namespace"
    echo "without and with the daemon serving N service ports (ClusterIPs at random in 10.96.0.0/12, every fifth a NodePort),"
    echo "each ratio the median of per-run ratios; and new connections/s through a ClusterIP, against the rate with one service port."
    echo
    cat "$work/tax.md"
    echo "<!-- bench:end -->"
    sed '1,/<!-- bench:end -->/d' "$doc" # what comes after it
  } >"$work/doc.md"
  cp "$work/doc.md" "$doc"
  echo "wrote $doc"
fi
