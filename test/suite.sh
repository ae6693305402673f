#!/usr/bin/env bash
# make test: the whole suite, in order — formatting, vet, the linter, the
# image's build stage, every Go test with the race detector, the end-to-end
# tests again as on a kernel without netfilter extras, the demo, the
# benchmarks' smoke runs and the few-minute subset of Kubernetes' own e2e
# suite (docs/conformance.md).
#
# Kubernetes' programs (the e2e lab's control plane, then the conformance
X
# to build on a fresh 2-core machine and nothing on a warm one. They build
# beside the steps, at the lowest CPU priority, so that they use the time
# the end-to-end tests spend waiting on their labs instead of adding to the
# run; a step that needs one before it is ready waits for it (the cache's
# lock). This script owns that build: it stops it when the suite stops
# early, and the suite fails when it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
BIN=${BIN:-bin}
MAKE=${MAKE:-make}

mkdir -p "$BIN"
prebuild_log=$BIN/prebuild.log
"$GO" build -o "$BIN/conformance" ./test/conformance
# Its own session, so that stopping it stops the go commands under it. A
# new session is a new scheduling autogroup, which competes with this one
# as an equal whatever its members' nice: the group's own nice, set from
# inside it, is what makes it yield (sched(7), "The autogroup feature").
setsid bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null; exec nice -n 19 "$0" -build-only' "$BIN/conformance" >"$prebuild_log" 2>&1 &
prebuild=$!
basic=
# stop_background stops what this script started beside its steps.
stop_background() {
	for pid in "$prebuild" $basic; do
		if kill -0 "$pid" 2>/dev/null; then
			kill -TERM -- "-$pid" 2>/dev/null || true
			wait "$pid" 2>/dev/null || true
			if [ "$pid" = "$basic" ]; then
				echo "suite: stopped the basic-kernel leg; its log so far: $basic_log" >&2
			fi
		fi
	done
}
trap stop_background EXIT
trap 'exit 143' TERM INT # so that the EXIT trap runs
echo "suite: building Kubernetes' programs in the background at nice 19 (pid $prebuild, log $prebuild_log)"

step() {
	echo "suite: $* ($(date +%T))"
	"$@"
}

step "$MAKE" --no-print-directory fmt-check vet lint build image-check
# Every Go test under the race detector (go test runs two packages at a
# time: the unit tests beside the end-to-end lab's), and beside them the
# end-to-end tests again as on a kernel without netfilter extras (make
# test-basic-kernel): both legs spend most of their time waiting on their
# labs (whose namespaces, ports and files are their own), and a loaded
# machine is one every test must pass on.
basic_log=$BIN/e2e-basic.log
echo "suite: KUP_E2E_KERNEL=basic $GO test -count=1 -timeout 30m ./test/e2e/, beside the next step (log $basic_log)"
KUP_E2E_KERNEL=basic setsid "$GO" test -count=1 -timeout 30m ./test/e2e/ >"$basic_log" 2>&1 &
basic=$!
# (The race detector needs cgo: the one build configuration the Makefile
# exports is static, so this step alone compiles the dependencies again.)
step env CGO_ENABLED=1 "$GO" test -race -count=1 -timeout 40m ./...
echo "suite: waiting for the basic-kernel leg ($(date +%T))"
basic_rc=0
wait "$basic" || basic_rc=$?
cat "$basic_log"
if [ "$basic_rc" -ne 0 ]; then
	echo "suite: the basic-kernel leg failed" >&2
	exit 1
fi
step env BIN="$BIN" ./test/demo.sh
step "$MAKE" --no-print-directory bench-smoke
step "$MAKE" --no-print-directory bench-cluster-smoke

echo "suite: waiting for the background build ($(date +%T))"
if ! wait "$prebuild"; then
	echo "suite: the background build of Kubernetes' programs failed; its log ($prebuild_log):" >&2
	tail -n 50 "$prebuild_log" >&2
	exit 1
fi
step "$MAKE" --no-print-directory conformance-short
echo "suite: all green ($(date +%T))"
