#!/usr/bin/env bash
# make bench-sched: new connections/s through the daemon with each scheduler
# (rr, lc, sh, random; two endpoints), with the PROXY protocol v2 on and off
# (the same HAProxy behind, with and without accept-proxy), and with the
# backend seeing the client's address (the conntrack source NAT: the client
# is a pod of this node by --cluster-cidr) or the node's (the annotation; also
# keep-alive requests/s, the NAT's cost per packet), in one lab and one
# daemon, interleaved, each figure the median of RUNS runs of DUR seconds
# with their spread, pinned as make bench: the daemon on the last CPU, the
# load generator and the backends on the others. Needs root; cleans up on
# exit.
set -u
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-5}; DUR=${DUR:-5}; BIN=${BIN:-bin}
[ "$(id -u)" = 0 ] || { echo "bench needs root (network namespaces)" >&2; exit 1; }
command -v haproxy >/dev/null || { echo "haproxy is needed (apt-get install haproxy)" >&2; exit 1; }
ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"
. test/lab/lab.sh
. test/bench/results.sh # record, jsonval, value, cell, ratio, bench_lab, N, P, L
bench_lab ks

for pod in pod1 pod2; do L "$pod" "$BIN/backend" --name "$pod" --tcp :8080 --udp "" >/dev/null 2>&1 & done
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
L pod1 haproxy -f "$work/haproxy.cfg" >"$work/haproxy.log" 2>&1 &

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
declare -A VIP=([rr]=10.96.8.1 [lc]=10.96.8.2 [sh]=10.96.8.3 [random]=10.96.8.4 [pp-off]=10.96.8.5 [pp-v2]=10.96.8.6
  [src-node]=10.96.8.7 [src-client]=10.96.8.8)
node="kube-userspace-proxy.io/backend-source-address: node" # all but src-client
{
  for s in rr lc sh random; do
    svc "s-$s" "${VIP[$s]}" "kube-userspace-proxy.io/scheduler: $s, $node" 8080 10.251.19.12 10.251.19.8
  done
  svc pp-off "${VIP[pp-off]}" "$node" 8091 10.251.19.12
  svc pp-v2 "${VIP[pp-v2]}" "kube-userspace-proxy.io/proxy-protocol: v2, $node" 8090 10.251.19.12
  svc src-node "${VIP[src-node]}" "$node" 8091 10.251.19.12
  svc src-client "${VIP[src-client]}" "" 8091 10.251.19.12
} >"$work/svc.yaml"
P "$BIN/kube-userspace-proxy" --manifests "$work/svc.yaml" --connection-log none --log-level warn \
  --cluster-cidr 10.251.19.0/24 --metrics-bind-address "" --healthz-bind-address "" >"$work/proxy.log" 2>&1 &
PATHS="rr lc sh random pp-off pp-v2 src-node src-client"
for p in $PATHS; do
  wait_until 10 N client curl -s --max-time 1 "http://${VIP[$p]}:8080/" || { echo "$p does not answer" >&2; cat "$work/proxy.log" "$work/haproxy.log" >&2; exit 1; }
done
results="$work/results"
: >"$results"
for run in $(seq "$RUNS"); do
  for p in $PATHS; do
    echo "run $run/$RUNS: $p" >&2
    out=$(L client "$BIN/loadgen" -mode cps -addr "${VIP[$p]}:8080" -d "${DUR}s" -c 32)
    record cps "$p" "$(echo "$out" | jsonval perSecond)"
  done
  for p in src-node src-client; do
    echo "run $run/$RUNS: $p keep-alive" >&2
    out=$(L client "$BIN/loadgen" -mode rps -addr "${VIP[$p]}:8080" -d "${DUR}s" -c 32)
    record rps "$p" "$(echo "$out" | jsonval perSecond)"
  done
done
# The backend saw whom it should: conntrack keeps the connections to HAProxy
# (pod1:8091) of the last run, replying to the client's address (src-client)
# and to the node's (src-node).
for seen in 10.251.19.20 10.251.19.1; do
  n=$(N node conntrack -L -p tcp --reply-src 10.251.19.12 --reply-port-src 8091 --reply-dst "$seen" 2>/dev/null | grep -c '^tcp')
  [ "$n" -gt 0 ] || { echo "no connection to HAProxy showed it $seen" >&2; exit 1; }
done
echo
echo "| scheduler / header | new connections/s | ÷ rr (or ÷ header off) |"
echo "|---|---:|---:|"
for p in rr lc sh random; do echo "| $p | $(cell cps "$p") | $(ratio "$(value cps "$p")" "$(value cps rr)") |"; done
echo "| PROXY v2 off (HAProxy, one endpoint) | $(cell cps pp-off) | — |"
echo "| PROXY v2 on (HAProxy accept-proxy) | $(cell cps pp-v2) | $(ratio "$(value cps pp-v2)" "$(value cps pp-off)") |"
echo
echo "| the backend sees (HAProxy, one endpoint) | new connections/s | ÷ node's | keep-alive requests/s | ÷ node's |"
echo "|---|---:|---:|---:|---:|"
echo "| the node's address (the annotation) | $(cell cps src-node) | — | $(cell rps src-node) | — |"
echo "| the client's (conntrack source NAT) | $(cell cps src-client) | $(ratio "$(value cps src-client)" "$(value cps src-node)") | $(cell rps src-client) | $(ratio "$(value rps src-client)" "$(value rps src-node)") |"
