#!/usr/bin/env bash
# The one place that installs what this project needs on a Debian machine
# (run as root). make demo, make test, make bench* and .ci/run call it with
# the job they are about to run; it installs only what is missing and says
# what it installs.
#
#   test/setup.sh demo    the lab and the daemon: iptables, iproute2, curl, …
#   test/setup.sh test    + the tests' peers: nc, dig, HAProxy, nginx, iperf3, …
#   test/setup.sh bench   + the benchmarks' tools (sockperf, socat, perf)
#   test/setup.sh bench-cluster  bench + nftables (kube-proxy's nftables mode)
#   test/setup.sh ci      test + Chromium for the live page's browser test
#                         (installed only here: make test never installs a browser)
#   test/setup.sh conformance  test + what a kubelet node needs: runc, the CNI
#                         plugins, nftables (kube-proxy's reference mode),
#                         busybox and gcc (the lab's images)
#   test/setup.sh check   Go and the linter only (make check, make lint)
#
# Go: when `go` (in PATH or /usr/local/go/bin) is missing or older than go.mod
# asks (Debian 12's golang-go is 1.19), the toolchain go.mod names is fetched
# from the Go module proxy (golang.org/toolchain, over HTTPS) into
# /usr/local/go (GO_DIR overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
job=${1:-test}

# command:package pairs per job.
demo=(iptables-restore:iptables ip:iproute2 curl:curl sysctl:procps make:make git:git conntrack:conntrack unzip:unzip)
test_=("${demo[@]}" nc:netcat-openbsd dig:dnsutils haproxy:haproxy nginx:nginx-light iperf3:iperf3 socat:socat sockperf:sockperf
  /usr/lib/nginx/modules/ngx_stream_module.so:libnginx-mod-stream) # a path: a file, not a command
conformance=(runc:runc /usr/lib/cni/bridge:containernetworking-plugins nft:nftables busybox:busybox-static
  gcc:gcc nsenter:util-linux wget:wget)
case "$job" in
  demo) want=("${demo[@]}") ;;
  test) want=("${test_[@]}") ;;
  bench) want=("${test_[@]}" perf:linux-perf) ;;
  bench-cluster) want=("${test_[@]}" perf:linux-perf nft:nftables) ;;
  ci) want=("${test_[@]}" chromium:chromium "${conformance[@]}") ;;
  conformance) want=("${test_[@]}" "${conformance[@]}") ;;
  check) want=(make:make git:git) ;;
  *) echo "usage: $0 demo|test|bench|bench-cluster|ci|conformance|check" >&2; exit 2 ;;
esac

need=()
for pair in "${want[@]}"; do
  what=${pair%%:*}
  case "$what" in
    /*) [ -e "$what" ] || need+=("${pair#*:}") ;;
    *) command -v "$what" >/dev/null 2>&1 || need+=("${pair#*:}") ;;
  esac
done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup: missing Debian packages ${need[*]}; run as root to install them" >&2
    exit 1
  fi
  echo "setup: installing Debian packages: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # The packages' own services (nginx, haproxy) must not start: the tests
  # start their own copies inside their namespaces.
  made_policy=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
  fi
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  [ -z "$made_policy" ] || rm -f /usr/sbin/policy-rc.d
fi

# go_version_ok VERSION: the go in PATH is at least VERSION (1.26.0).
want_go=$(sed -n 's/^go \([0-9.]*\)$/\1/p' go.mod)
go_version_ok() {
  local have
  have=$(go env GOVERSION 2>/dev/null | sed 's/^go//') || return 1
  [ -n "$have" ] && [ "$(printf '%s\n%s\n' "$1" "$have" | sort -V | head -1)" = "$1" ]
}
GO_DIR=${GO_DIR:-/usr/local/go}
export PATH=$GO_DIR/bin:$PATH
if ! go_version_ok "$want_go"; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup: Go $want_go or newer is needed (have: $(go version 2>/dev/null || echo none)); run as root to install it" >&2
    exit 1
  fi
  arch=$(dpkg --print-architecture)
  mod="golang.org/toolchain@v0.0.1-go$want_go.linux-$arch"
  echo "setup: installing Go $want_go into $GO_DIR (from the Go module proxy: $mod)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  curl -fsSL -o "$tmp/go.zip" "https://proxy.golang.org/golang.org/toolchain/@v/v0.0.1-go$want_go.linux-$arch.zip"
  unzip -q "$tmp/go.zip" -d "$tmp"
  rm -rf "$GO_DIR"
  mv "$tmp/$mod" "$GO_DIR"
  chmod +x "$GO_DIR"/bin/* "$GO_DIR"/pkg/tool/*/* 2>/dev/null || true
  go_version_ok "$want_go" || { echo "setup: the installed Go does not run" >&2; exit 1; }
fi

# The linter (make lint, part of make check and make test): golangci-lint of
# the version the Makefile names, built from the module proxy into bin/tools
# (~2 minutes the first time).
case "$job" in
  test|ci|check)
    lint_version=$(sed -n 's/^LINT_VERSION *:= *//p' Makefile)
    if ! bin/tools/golangci-lint version 2>/dev/null | grep -q "version ${lint_version#v} "; then
      echo "setup: building golangci-lint $lint_version into bin/tools"
      GOBIN=$PWD/bin/tools go install "github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$lint_version"
    fi
    ;;
esac
