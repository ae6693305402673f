#!/usr/bin/env bash
# make demo: the seed article's dev/devpaasy Service served by
# kube-userspace-proxy in a lab of network namespaces.
set -u
cd "$(dirname "$0")/.."
. test/lab/lab.sh
BIN=${BIN:-bin}
[ "$(id -u)" = 0 ] || { echo "make demo needs root (it creates network namespaces)" >&2; exit 1; }

trap 'lab_down; rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM
tmp=$(mktemp -d)
lab_up || { echo "could not build the lab" >&2; exit 1; }

for pod in pod1 pod2; do
  ip netns exec "$LAB-$pod" "$BIN/backend" --name "devpaasy-$pod" --tcp :8080 --udp "" >/dev/null 2>&1 &
done

echo "== Serving docs/examples/devpaasy.yaml (dev/devpaasy: ClusterIP 10.0.0.41:8080, NodePort 31341)"
ip netns exec "$LAB-node" "$BIN/kube-userspace-proxy" --manifests docs/examples/devpaasy.yaml \
  --hostname-override node-1 >"$tmp/proxy.log" 2>&1 &
wait_until 10 grep -q Listening "$tmp/proxy.log" || { cat "$tmp/proxy.log"; exit 1; }
port=$(sed -n 's/.*msg=Listening.* listen=\([0-9]*\).*/\1/p' "$tmp/proxy.log" | head -1)
sed 's/^/   proxy: /' "$tmp/proxy.log"

echo "== Six requests from the client pod to the proxy port (10.251.19.1:$port)"
ok=0
for i in 1 2 3 4 5 6; do
  out=$(ip netns exec "$LAB-client" curl -s --max-time 5 "http://10.251.19.1:$port/") && ok=$((ok+1))
  echo "   request $i -> ${out:-FAILED}"
done
[ $ok = 6 ] || { echo "demo failed: $ok of 6 requests answered" >&2; exit 1; }
echo "== Done: requests alternate between the two pods"
