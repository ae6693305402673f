#!/usr/bin/env bash
# make test-real-kernel: end-to-end tests on a real kernel that lacks the
# netfilter extras, not a simulation of one (docs/iptables.md, "Tested as a
# target"). Debian's kernel, whose netfilter is modules, boots in qemu with
# its module tree minus xt_conntrack, xt_comment, xt_addrtype, xt_state,
# xt_MASQUERADE, xt_mark, xt_CT, nf_conntrack_netlink and br_netfilter; its
# root is this machine's / (9p, read-only, under a tmpfs overlay), so the
# tests run as here: KUP_E2E_KERNEL=basic-real, binaries built here, the
# legacy iptables binaries. Emulated (ACCEL=tcg): KVM under this machine's
# own virtualisation hung the guest at boot. Root; a few minutes per test;
# TESTS picks them (a -test.run pattern). Not part of make test.
set -eu
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "test-real-kernel needs root" >&2; exit 1; }
TESTS=${TESTS:-'^(TestBasicNetfilterOnly|TestClusterIPOnlyUDPNotReachableViaProxyPort|TestAllServiceAddressesByTraffic|TestBackendSeesTheClient|TestUDPConntrackFollowsListeners|TestExplainPredictsTheNextConnection|TestKill9RestartLeavesOneCopy)$'}
ACCEL=${ACCEL:-tcg,thread=multi}
W=/opt/kup-realkernel # vminit's paths
missing=""
for c in qemu-system-x86_64:qemu-system-x86 modprobe:kmod cpio:cpio; do command -v "${c%%:*}" >/dev/null || missing="$missing ${c#*:}"; done
if [ -n "$missing" ]; then
  echo "installing:$missing" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing >/dev/null
fi
mkdir -p "$W"
if [ ! -d "$W/root/boot" ]; then # the kernel package, unpacked, never installed
  pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/ {print $2; exit}')
  (cd "$W" && apt-get download "$pkg" 2>/dev/null && dpkg-deb -x "$pkg"_*.deb root && rm -f "$pkg"_*.deb)
fi
kver=$(ls "$W/root/lib/modules" | head -1)
depmod -b "$W/root" "$kver" # the package's own tree, for the initramfs' list below
rm -rf "$W/mods" && mkdir -p "$W/mods/lib/modules" && cp -a "$W/root/lib/modules/$kver" "$W/mods/lib/modules/"
for m in nf_conntrack_netlink xt_conntrack xt_comment xt_addrtype xt_state xt_MASQUERADE xt_mark xt_CT br_netfilter; do
  find "$W/mods/lib/modules/$kver" -name "$m.ko*" -delete
done
depmod -b "$W/mods" "$kver"
# The initramfs: vminit and what it needs to reach the host's root.
rm -rf "$W/initrd" && mkdir -p "$W/initrd/mods"
CGO_ENABLED=0 go build -o "$W/initrd/init" ./test/cmd/vminit
for m in virtio_pci 9pnet_virtio 9p overlay; do modprobe -d "$W/root" -S "$kver" --show-depends "$m" | awk '{print $2}'; done |
  awk '!seen[$0]++' | while read -r ko; do cp "$ko" "$W/initrd/mods/"; echo "/mods/$(basename "$ko")"; done >"$W/initrd/modules.list"
[ "$(wc -l <"$W/initrd/modules.list")" -ge 4 ] || { echo "no module list for the initramfs" >&2; exit 1; }
(cd "$W/initrd" && find . | cpio -o -H newc 2>/dev/null | gzip) >"$W/initrd.gz"
mkdir -p "$W/bin"
CGO_ENABLED=0 go build -o "$W/bin/kube-userspace-proxy" ./cmd/kube-userspace-proxy
CGO_ENABLED=0 go build -tags crashtest -o "$W/bin/kube-userspace-proxy-crashtest" ./cmd/kube-userspace-proxy
CGO_ENABLED=0 go build -o "$W/bin/backend" ./test/backend
go test -c -o "$W/e2e.test" ./test/e2e/
cat >"$W/run.sh" <<RUN
export HOME=/root
echo "kernel \$(uname -r); nf_conntrack_netlink.ko: \$(ls /lib/modules/*/kernel/net/netfilter/nf_conntrack_netlink.ko 2>&1 | tail -1)"
cd $PWD/test/e2e
KUP_E2E_BIN_DIR=$W/bin KUP_E2E_KERNEL=basic-real KUP_REQUIRE_ROOT_TESTS=1 $W/e2e.test -test.v -test.timeout 90m -test.run '$TESTS' 2>&1
echo "modules loaded: \$(awk '{print \$1}' /proc/modules | sort | tr '\n' ' ')"
RUN
echo "booting $kver under qemu ($ACCEL); the console goes to $W/console.log" >&2
qemu-system-x86_64 -accel "$ACCEL" -smp 2 -m 8G -nographic -no-reboot \
  -kernel "$W/root/boot/vmlinuz-$kver" -initrd "$W/initrd.gz" -append "console=ttyS0 panic=-1 nokaslr loglevel=4" \
  -fsdev local,id=hr,path=/,security_model=passthrough,readonly=on,multidevs=remap -device virtio-9p-pci,fsdev=hr,mount_tag=hostroot \
  </dev/null >"$W/console.log" 2>&1
grep -E '^(kernel |modules loaded|--- |    [a-z_]+_test\.go|PASS|FAIL)' "$W/console.log" || true
grep -qx 'PASS' <(tr -d '\r' <"$W/console.log")
