#!/usr/bin/env bash
# make bench-sched: new connections/s through the daemon with each scheduler
# (rr, lc, sh, random; two endpoints) and with the PROXY protocol v2 on and
# off (the same HAProxy behind, with and without accept-proxy), in one lab and
# one daemon, interleaved, each figure the median of RUNS runs of DUR seconds.
# Needs root; cleans up on exit.
set -u
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-3}; DUR=${DUR:-5}; BIN=${BIN:-bin}
[ "$(id -u)" = 0 ] || { echo "bench needs root (network namespaces)" >&2; exit 1; }
command -v haproxy >/dev/null || { echo "haproxy is needed (apt-get install haproxy)" >&2; exit 1; }
ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"
. test/lab/lab.sh
. test/bench/results.sh # record, jsonval, median, value, bench_lab, N
bench_lab ks

for pod in pod1 pod2; do N "$pod" "$BIN/backend" --name "$pod" --tcp :8080 --udp "" >/dev/null 2>&1 & done
cat > "$work/haproxy.cfg" <<'CFG'
global
  maxconn 7000
defaults
  mode http
  timeout connect 5s
  timeout client 10s
  timeout server 10s
frontend plain
  bind :8091
  http-request return status 200 content-type text/plain string "ok"
frontend proxied
  bind :8090 accept-proxy
  http-request return status 200 content-type text/plain string "ok"
CFG
N pod1 haproxy -f "$work/haproxy.cfg" >"$work/haproxy.log" 2>&1 &

svc() { # name vip annotations target-port endpoints...
  local name=$1 vip=$2 ann=$3 port=$4; shift 4
  printf -- '---\napiVersion: v1\nkind: Service\nmetadata: {name: %s, namespace: bench, annotations: {%s}}\n' "$name" "$ann"
  printf 'spec: {clusterIP: %s, ports: [{port: 8080, targetPort: %s, protocol: TCP}]}\n' "$vip" "$port"
  printf -- '---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: %s, namespace: bench, labels: {kubernetes.io/service-name: %s}}\n' "$name" "$name"
  printf 'addressType: IPv4\nports: [{port: %s, protocol: TCP}]\nendpoints: [' "$port"
  local sep=""
  for ip in "$@"; do printf '%s{addresses: [%s]}' "$sep" "$ip"; sep=", "; done
  printf ']\n'
}
declare -A VIP=([rr]=10.96.8.1 [lc]=10.96.8.2 [sh]=10.96.8.3 [random]=10.96.8.4 [pp-off]=10.96.8.5 [pp-v2]=10.96.8.6)
{
  for s in rr lc sh random; do
    svc "s-$s" "${VIP[$s]}" "kube-userspace-proxy.io/scheduler: $s" 8080 10.251.19.12 10.251.19.8
  done
  svc pp-off "${VIP[pp-off]}" "" 8091 10.251.19.12
  svc pp-v2 "${VIP[pp-v2]}" "kube-userspace-proxy.io/proxy-protocol: v2" 8090 10.251.19.12
} >"$work/svc.yaml"
N node "$BIN/kube-userspace-proxy" --manifests "$work/svc.yaml" --connection-log none --log-level warn \
  --metrics-bind-address "" --healthz-bind-address "" >"$work/proxy.log" 2>&1 &
PATHS="rr lc sh random pp-off pp-v2"
for p in $PATHS; do
  wait_until 10 N client curl -s --max-time 1 "http://${VIP[$p]}:8080/" || { echo "$p does not answer" >&2; cat "$work/proxy.log" "$work/haproxy.log" >&2; exit 1; }
done
results="$work/results"
: >"$results"
for run in $(seq "$RUNS"); do
  for p in $PATHS; do
    echo "run $run/$RUNS: $p" >&2
    out=$(N client "$BIN/loadgen" -mode cps -addr "${VIP[$p]}:8080" -d "${DUR}s" -c 32)
    record cps "$p" "$(echo "$out" | jsonval perSecond)"
  done
done
ratio() { awk -v a="$1" -v b="$2" 'BEGIN{if(b>0) printf "%.2f×", a/b; else print "—"}'; }
echo
echo "| scheduler / header | new connections/s | ÷ rr (or ÷ header off) |"
echo "|---|---:|---:|"
for p in rr lc sh random; do echo "| $p | $(value cps "$p") | $(ratio "$(value cps "$p")" "$(value cps rr)") |"; done
echo "| PROXY v2 off (HAProxy, one endpoint) | $(value cps pp-off) | — |"
echo "| PROXY v2 on (HAProxy accept-proxy) | $(value cps pp-v2) | $(ratio "$(value cps pp-v2)" "$(value cps pp-off)") |"
