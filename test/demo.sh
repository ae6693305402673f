#!/usr/bin/env bash
# make demo: the seed article's dev/devpaasy Service served by
# kube-userspace-proxy in a lab of network namespaces. With KEEP=1 (make demo
# KEEP=1) the lab and the daemon stay up to look around in; the script prints
# how to look and how to tear it down.
set -u
cd "$(dirname "$0")/.."
. test/lab/lab.sh
BIN=${BIN:-bin}
[ "$(id -u)" = 0 ] || { echo "make demo needs root (it creates network namespaces)" >&2; exit 1; }

KEEP=${KEEP:-0}
tmp=$(mktemp -d)
kept=0 # set once the demo succeeded with KEEP=1: the lab stays
trap '[ "$kept" = 1 ] || { lab_down; rm -rf "$tmp"; }' EXIT
trap 'exit 130' INT TERM
lab_up || { echo "could not build the lab" >&2; exit 1; }

for pod in pod1 pod2; do
  ip netns exec "$LAB-$pod" "$BIN/backend" --name "devpaasy-$pod" --tcp :8080 --udp "" >/dev/null 2>&1 &
done

echo "== Serving docs/examples/devpaasy.yaml (dev/devpaasy: ClusterIP 10.0.0.41:8080, NodePort 31341)"
cp docs/examples/devpaasy.yaml "$tmp/devpaasy.yaml"
ip netns exec "$LAB-node" "$BIN/kube-userspace-proxy" --manifests "$tmp/devpaasy.yaml" \
  --hostname-override node-1 --connection-log all \
  --admin-socket "$tmp/admin.sock" --handover-socket "$tmp/handover.sock" >"$tmp/proxy.log" 2>&1 &
wait_until 10 grep -q Listening "$tmp/proxy.log" || { cat "$tmp/proxy.log"; exit 1; }
wait_until 10 ip netns exec "$LAB-node" sh -c 'iptables-save -t nat | grep -q "10.0.0.41/32"' || { cat "$tmp/proxy.log"; exit 1; }

echo "== The rules it installed in the node (iptables-save, our chains)"
ip netns exec "$LAB-node" iptables-save -t nat | grep -E 'KUBE-(PORTALS|NODEPORT)' | sed 's/^/   /'

ok=0
req() { # namespace url label
  local out
  out=$(ip netns exec "$1" curl -s --max-time 5 "$2") && ok=$((ok+1))
  echo "   $3 -> ${out:-FAILED}"
}
echo "== Four requests from the client pod to the ClusterIP 10.0.0.41:8080"
for i in 1 2 3 4; do req "$LAB-client" http://10.0.0.41:8080/ "pod    -> ClusterIP"; done
echo "== Two from the node itself to the ClusterIP"
for i in 1 2; do req "$LAB-node" http://10.0.0.41:8080/ "node   -> ClusterIP"; done
echo "== Four from the external client to the NodePort 192.168.50.1:31341"
for i in 1 2 3 4; do req "$LAB-ext" http://192.168.50.1:31341/ "extern -> NodePort "; done
echo "== Two from the node to 127.0.0.1:31341 (no route_localnet needed)"
for i in 1 2; do req "$LAB-node" http://127.0.0.1:31341/ "node   -> localhost NodePort"; done
[ $ok = 12 ] || { echo "demo failed: $ok of 12 requests answered" >&2; sed 's/^/   proxy: /' "$tmp/proxy.log" >&2; exit 1; }

echo "== pod2's server dies (the manifest still lists it): no request fails, the proxy retries on pod1"
for pid in $(ip netns pids "$LAB-pod2"); do kill "$pid"; done
wait_until 5 sh -c "! ip netns exec $LAB-pod2 ss -ltn | grep -q 8080"
for i in 1 2 3 4; do req "$LAB-client" http://10.0.0.41:8080/ "pod    -> ClusterIP"; done
grep -c '"retry"\|reason=retry' "$tmp/proxy.log" | sed 's/^/   connections retried on the other pod: /'
[ $ok = 16 ] || { echo "demo failed: a request failed although pod1 was up" >&2; exit 1; }

echo "== pod2 is back; sessionAffinity: ClientIP is switched on in the manifest"
ip netns exec "$LAB-pod2" "$BIN/backend" --name "devpaasy-pod2" --tcp :8080 --udp "" >/dev/null 2>&1 &
wait_until 10 ip netns exec "$LAB-node" curl -s --max-time 1 http://10.251.19.8:8080/
sed 's/^  type: NodePort$/  type: NodePort\n  sessionAffinity: ClientIP/' docs/examples/devpaasy.yaml > "$tmp/new.yaml"
mv "$tmp/new.yaml" "$tmp/devpaasy.yaml"
wait_until 10 sh -c "grep -c 'Manifests loaded' $tmp/proxy.log | grep -q 2"
sleep 1.2 # the next sync may wait for --min-sync-period (1 s)
for i in 1 2 3 4; do req "$LAB-client" http://10.0.0.41:8080/ "pod    -> ClusterIP (sticky)"; done
[ $ok = 20 ] || { echo "demo failed" >&2; exit 1; }
echo "== Done. The proxy's log (connection lines shortened):"
grep -v 'level=debug' "$tmp/proxy.log" | sed -E 's/ (bytesDown|bytesUp|dialLatency|duration|component|protocol|attempts)=[^ ]*//g' | sed 's/^/   proxy: /' | tail -25

if [ "$KEEP" = 1 ]; then
  kept=1
  cat <<HOWTO

== The lab stays up (LAB=$LAB). Look around, as root:
   ip netns exec $LAB-node curl -s '127.0.0.1:10249/debug/services?format=text'   # listeners, endpoints, scheduler
   ip netns exec $LAB-node curl -s '127.0.0.1:10249/debug/connections?format=text'
   ip netns exec $LAB-node curl -s 127.0.0.1:10249/metrics | grep kube_userspace_proxy
   ip netns exec $LAB-node iptables-save -t nat | grep KUBE-                        # the rules
   ip netns exec $LAB-node iptables -t nat -L KUBE-PORTALS-CONTAINER -v -n          # with packet counters
   ip netns exec $LAB-node conntrack -L -p tcp                                      # REDIRECT entries
   $BIN/kube-userspace-proxy explain --manifests $tmp/devpaasy.yaml --from 10.251.19.20 --to 10.0.0.41:8080 --node-ip 192.168.50.1,10.251.19.1
   ip netns exec $LAB-node $BIN/kube-userspace-proxy explain --server http://127.0.0.1:10249 --from 10.251.19.20 --to 10.0.0.41:8080
   ip netns exec $LAB-node $BIN/kube-userspace-proxy explain --server http://127.0.0.1:10249 --from 192.168.50.2 --to 192.168.50.1:31341
   The live page: forward it to this machine's loopback and open http://127.0.0.1:10249/ in a browser here:
   socat TCP-LISTEN:10249,bind=127.0.0.1,reuseaddr,fork EXEC:"ip netns exec $LAB-node socat STDIO TCP\:127.0.0.1\:10249"
   ip netns exec $LAB-client curl -s http://10.0.0.41:8080/                         # a pod -> the ClusterIP
   ip netns exec $LAB-ext curl -s http://192.168.50.1:31341/                        # outside -> the NodePort
   The manifest it serves: $tmp/devpaasy.yaml (edit it: changes apply within a second); its log: $tmp/proxy.log
== Tear it down:
   LAB=$LAB bash -c '. test/lab/lab.sh && lab_down' && rm -rf $tmp
HOWTO
fi
