# Shared by make demo and make bench: a throwaway lab of network namespaces.
#
#   client pod 10.251.19.20 ─┐
#   pod1       10.251.19.12 ─┼─ br0 10.251.19.1 [node] 192.168.50.1 ── 192.168.50.2 external client
#   pod2       10.251.19.8  ─┘
#
# IPv6: pods fd00:251::<last octet>/64 behind br0 fd00:251::1; node fd00:50::1
# and external client fd00:50::2. The external client routes 203.0.113.0/24
# (externalIPs and LoadBalancer IPs in tests) and fd00:96::/64 via the node.
#
# Every name carries LAB (a per-run prefix) so that parallel runs and
# leftovers of a killed run never collide; lab_down removes everything.

LAB_GIVEN=${LAB:+1} # bench_lab keeps a name the caller gave
LAB=${LAB:-kup$$}

lab_ns() { echo "$LAB-$1"; }

lab_up() {
  set -e
  ip netns add "$LAB-node"
  ip netns exec "$LAB-node" ip link set lo up
  ip netns exec "$LAB-node" sysctl -qw net.ipv4.ip_forward=1
  ip netns exec "$LAB-node" sysctl -qw net.ipv6.conf.all.forwarding=1
  ip netns exec "$LAB-node" ip link add br0 type bridge
  ip netns exec "$LAB-node" ip addr add 10.251.19.1/24 dev br0
  ip netns exec "$LAB-node" ip addr add fd00:251::1/64 dev br0 nodad
  ip netns exec "$LAB-node" ip link set br0 up
  local pod ip i=0
  for pod in pod1:10.251.19.12 pod2:10.251.19.8 client:10.251.19.20; do
    ip=${pod#*:}; pod=${pod%%:*}; i=$((i+1))
    ip netns add "$LAB-$pod"
    ip link add "$LAB-v$i" type veth peer name eth0 netns "$LAB-$pod"
    ip link set "$LAB-v$i" netns "$LAB-node"
    ip netns exec "$LAB-node" ip link set "$LAB-v$i" master br0 up
    ip netns exec "$LAB-$pod" ip link set lo up
    ip netns exec "$LAB-$pod" ip addr add "$ip/24" dev eth0
    ip netns exec "$LAB-$pod" ip link set eth0 up
    ip netns exec "$LAB-$pod" ip route add default via 10.251.19.1
    ip netns exec "$LAB-$pod" ip addr add "fd00:251::${ip##*.}/64" dev eth0 nodad
    ip netns exec "$LAB-$pod" ip -6 route add default via fd00:251::1
  done
  ip netns add "$LAB-ext"
  ip link add "$LAB-x" type veth peer name eth0 netns "$LAB-ext"
  ip link set "$LAB-x" netns "$LAB-node"
  ip netns exec "$LAB-node" ip addr add 192.168.50.1/24 dev "$LAB-x"
  ip netns exec "$LAB-node" ip link set "$LAB-x" up
  ip netns exec "$LAB-ext" ip link set lo up
  ip netns exec "$LAB-ext" ip addr add 192.168.50.2/24 dev eth0
  ip netns exec "$LAB-node" ip addr add fd00:50::1/64 dev "$LAB-x" nodad
  ip netns exec "$LAB-ext" ip link set eth0 up
  ip netns exec "$LAB-ext" ip addr add fd00:50::2/64 dev eth0 nodad
  # Like a real node, ours has a default route (towards the external client),
  # so that it can route packets to service addresses before OUTPUT rewrites them.
  ip netns exec "$LAB-node" ip route add default via 192.168.50.2
  ip netns exec "$LAB-node" ip -6 route add default via fd00:50::2
  ip netns exec "$LAB-ext" ip route add 203.0.113.0/24 via 192.168.50.1
  ip netns exec "$LAB-ext" ip -6 route add fd00:96::/64 via fd00:50::1
  set +e
}

# lab_node2: a second node, 10.251.19.40 (fd00:251::40) on the pods' bridge,
# for tests of what differs per node (traffic policies, health check node
# ports, topology). Its daemon reaches the API server at 10.251.19.1.
lab_node2() {
  set -e
  ip netns add "$LAB-node2"
  ip link add "$LAB-v9" type veth peer name eth0 netns "$LAB-node2"
  ip link set "$LAB-v9" netns "$LAB-node"
  ip netns exec "$LAB-node" ip link set "$LAB-v9" master br0 up
  ip netns exec "$LAB-node2" ip link set lo up
  ip netns exec "$LAB-node2" ip addr add 10.251.19.40/24 dev eth0
  ip netns exec "$LAB-node2" ip addr add fd00:251::40/64 dev eth0 nodad
  ip netns exec "$LAB-node2" ip link set eth0 up
  ip netns exec "$LAB-node2" ip route add default via 10.251.19.1
  ip netns exec "$LAB-node2" ip -6 route add default via fd00:251::1
  set +e
}

# lab_far: a node of its own behind a link of its own, as another node of a
# routed cluster: far 192.168.60.2 (fd00:60::2) on the node's 192.168.60.1
# (fd00:60::1), its pods' bridge 10.252.0.1/24 (fd00:252::1/64) with pod3
# 10.252.0.5 (fd00:252::5). Each node routes the other's pods via the other,
# so pod3's replies come back through the node's netfilter, not past it.
lab_far() {
  set -e
  ip netns add "$LAB-far"
  ip netns add "$LAB-pod3"
  ip link add "$LAB-f" type veth peer name eth0 netns "$LAB-far"
  ip link set "$LAB-f" netns "$LAB-node"
  ip netns exec "$LAB-node" ip addr add 192.168.60.1/24 dev "$LAB-f"
  ip netns exec "$LAB-node" ip addr add fd00:60::1/64 dev "$LAB-f" nodad
  ip netns exec "$LAB-node" ip link set "$LAB-f" up
  ip netns exec "$LAB-node" ip route add 10.252.0.0/24 via 192.168.60.2
  ip netns exec "$LAB-node" ip -6 route add fd00:252::/64 via fd00:60::2
  ip netns exec "$LAB-far" ip link set lo up
  ip netns exec "$LAB-far" sysctl -qw net.ipv4.ip_forward=1
  ip netns exec "$LAB-far" sysctl -qw net.ipv6.conf.all.forwarding=1
  ip netns exec "$LAB-far" ip addr add 192.168.60.2/24 dev eth0
  ip netns exec "$LAB-far" ip addr add fd00:60::2/64 dev eth0 nodad
  ip netns exec "$LAB-far" ip link set eth0 up
  ip netns exec "$LAB-far" ip route add default via 192.168.60.1
  ip netns exec "$LAB-far" ip -6 route add default via fd00:60::1
  ip netns exec "$LAB-far" ip link add br0 type bridge
  ip netns exec "$LAB-far" ip addr add 10.252.0.1/24 dev br0
  ip netns exec "$LAB-far" ip addr add fd00:252::1/64 dev br0 nodad
  ip netns exec "$LAB-far" ip link set br0 up
  ip link add "$LAB-p3" type veth peer name eth0 netns "$LAB-pod3"
  ip link set "$LAB-p3" netns "$LAB-far"
  ip netns exec "$LAB-far" ip link set "$LAB-p3" master br0 up
  ip netns exec "$LAB-pod3" ip link set lo up
  ip netns exec "$LAB-pod3" ip addr add 10.252.0.5/24 dev eth0
  ip netns exec "$LAB-pod3" ip addr add fd00:252::5/64 dev eth0 nodad
  ip netns exec "$LAB-pod3" ip link set eth0 up
  ip netns exec "$LAB-pod3" ip route add default via 10.252.0.1
  ip netns exec "$LAB-pod3" ip -6 route add default via fd00:252::1
  set +e
}

# lab_down ends the lab's processes and removes its namespaces. It spares
# its caller, which a thread inside a namespace can make look like one of
# them (ip netns pids reads the main thread's).
lab_down() {
  local ns pid
  for ns in node node2 far pod1 pod2 pod3 client ext; do
    if ip netns list | grep -qw "$LAB-$ns"; then
      for pid in $(ip netns pids "$LAB-$ns" 2>/dev/null); do [ "$pid" = "$PPID" ] || kill "$pid" 2>/dev/null; done
    fi
  done
  sleep 0.2
  for ns in node node2 far pod1 pod2 pod3 client ext; do
    if ip netns list | grep -qw "$LAB-$ns"; then
      for pid in $(ip netns pids "$LAB-$ns" 2>/dev/null); do [ "$pid" = "$PPID" ] || kill -9 "$pid" 2>/dev/null; done
      ip netns del "$LAB-$ns" 2>/dev/null
    fi
  done
}

# wait_until SECONDS CMD...: run CMD until it succeeds or SECONDS pass.
wait_until() {
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -ge $deadline ] && return 1
    sleep 0.1
  done
}
