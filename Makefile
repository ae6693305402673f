# kube-userspace-proxy — see README.md.
SHELL := /bin/bash
GO    ?= go
BIN   ?= bin
PKGS  := ./...
# The Go that test/setup.sh installs when the machine has none new enough.
export PATH := /usr/local/go/bin:$(PATH)
# One build configuration for every build but the race detector's: static and
# -trimpath, the same test/cluster.GoCommand gives the programs the tests and
# the labs build. Go's build cache reuses a compiled package only for the same
# flags (and module versions: test/cluster/modules_test.go), so a fresh
# machine compiles client-go and the rest once for the daemon, vet, the tests
# and Kubernetes' programs, not once per configuration.
export CGO_ENABLED := 0
export GOFLAGS := $(strip $(filter-out -trimpath,$(GOFLAGS)) -trimpath)

.PHONY: all build demo test fuzz check lint differential soak conformance-specs test-basic-kernel test-real-kernel vet fmt-check clean conformance conformance-short bench-programming bench-handover bench-crash cluster image image-check bench bench-smoke bench-floor bench-floor-udp bench-tax bench-sched bench-guard bench-tools bench-ab bench-cluster bench-cluster-smoke

all: build

build:
	@mkdir -p $(BIN)
	CGO_ENABLED=0 $(GO) build -trimpath -o $(BIN)/kube-userspace-proxy ./cmd/kube-userspace-proxy
	CGO_ENABLED=0 $(GO) build -trimpath -o $(BIN)/backend ./test/backend

# The main job on the built-in example (needs root: it creates network namespaces).
# KEEP=1 leaves the lab and the daemon up and prints how to look around.
demo: setup-demo build
	BIN=$(BIN) KEEP=$(KEEP) ./test/demo.sh

# The linter beyond vet (.golangci.yml says what it checks and why).
LINT_VERSION := v2.15.0
lint: setup-check
	$(BIN)/tools/golangci-lint run ./...

# The fast loop while working (~2 minutes once the linter is built):
# formatting, build, vet, the linter, the import rule and the unit tests of
# the packages below the proxier (docs/architecture.md).
LEAF_PKGS := ./config/ ./proxy/balance/ ./proxy/proxyproto/ ./proxy/ports/ ./proxy/clientaddr/ ./proxy/syncrunner/ \
	./proxy/kernel/ ./proxy/healthcheck/ ./proxy/handover/ ./proxy/dataplane/ ./cmd/kube-userspace-proxy/internal/options/ ./test/layers/
check: setup-check fmt-check build vet lint
	CGO_ENABLED=1 $(GO) test -race -count=1 $(LEAF_PKGS)

# The whole suite (test/suite.sh): formatting, vet, the linter, every test
# with the race detector, the end-to-end tests once more as on a kernel
# without netfilter extras, the demo, the benchmarks' smoke runs and the
# few-minute subset of Kubernetes' own e2e suite (docs/conformance.md);
# Kubernetes' programs build beside it at the lowest priority.
test: setup-test
	GO=$(GO) BIN=$(BIN) MAKE=$(MAKE) bash test/suite.sh

# The manifests parser under the fuzzer (FUZZTIME, 1m by default; its seed
# corpus runs in every make test as an ordinary test).
fuzz:
	$(GO) test -run '^$$' -fuzz FuzzParseManifests -fuzztime $(or $(FUZZTIME),1m) ./config/

# The end-to-end tests again as on a kernel without netfilter extras: no
# optional match, no conntrack netlink (a seccomp filter), legacy iptables
# (docs/iptables.md; root, ~10 minutes; part of make test).
test-basic-kernel:
	KUP_E2E_KERNEL=basic $(GO) test -count=1 -timeout 30m ./test/e2e/

# A few end-to-end tests on a real kernel without the netfilter extras (Debian's,
# modules removed, booted in qemu; docs/iptables.md; root, ~5 minutes a test,
# TESTS=pattern picks; not part of make test).
test-real-kernel:
	TESTS='$(TESTS)' bash test/realkernel.sh

# Installs what a job lacks on Debian (packages; Go when missing or too old),
# saying what: test/setup.sh demo|test|bench.
setup-%:
	@bash test/setup.sh $*

vet:
	$(GO) vet $(PKGS)

fmt-check:
	@out=$$(gofmt -l $$(git ls-files -co --exclude-standard '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

clean:
	rm -rf $(BIN)

# Rule and listener programming at 1k and 10k service ports (root; its own netns).
bench-programming: setup-test build
	$(GO) build -o $(BIN)/progbench ./test/bench/progbench
	$(BIN)/progbench -daemon $(BIN)/kube-userspace-proxy -n 1000,10000 -runs 5

# A handover at 1 000 and 10 000 service ports with live connections (10 000
# listeners leave descriptors for 4 000 under the machine's 20 000).
bench-handover: setup-test build
	$(GO) build -o $(BIN)/handoverbench ./test/bench/handoverbench
	$(BIN)/handoverbench -daemon $(BIN)/kube-userspace-proxy -n 1000,10000 -c 5000,4000 -runs 3

# kill -9 of the serving process of a daemon run under its keeper, at 1 000
# and 10 000 service ports under a prober's new connection every millisecond.
bench-crash: setup-test build
	$(GO) build -o $(BIN)/handoverbench ./test/bench/handoverbench
	$(BIN)/handoverbench -crash -daemon $(BIN)/kube-userspace-proxy -n 1000,10000 -c 1000,1000 -runs 3

# A real control plane on loopback to try the daemon against (first run builds it, ~10 minutes).
cluster: build
	$(GO) run ./test/cmd/cluster

IMAGE ?= kube-userspace-proxy:dev
# Needs a Docker engine (none runs on the CI machines): see README.
image:
	docker build -t $(IMAGE) .

# Runs the Dockerfile's build-stage commands as written and checks that the
# result is a static binary, so the image build cannot rot unnoticed.
image-check:
	$(GO) mod download
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w" -o $(BIN)/image/kube-userspace-proxy ./cmd/kube-userspace-proxy
	@if ldd $(BIN)/image/kube-userspace-proxy >/dev/null 2>&1; then echo "not a static binary"; exit 1; fi
	@grep -q 'ldflags "-s -w" -o /out/kube-userspace-proxy ./cmd/kube-userspace-proxy' Dockerfile || { echo "Dockerfile build command changed: update image-check"; exit 1; }
	@echo "image-check: build stage OK, static binary"

bench-tools: setup-bench build
	CGO_ENABLED=0 $(GO) build -o $(BIN)/loadgen ./test/bench/loadgen
	CGO_ENABLED=0 $(GO) build -o $(BIN)/gofloor ./test/bench/gofloor
	CGO_ENABLED=0 $(GO) build -o $(BIN)/runtimetail ./test/bench/runtimetail

# The data path against direct, kernel DNAT, HAProxy, nginx and socat; writes docs/benchmarks.md (root, ~60 minutes).
bench: bench-tools
	BIN=$(BIN) ./test/bench/bench.sh

# This build against another, BASE (a commit: the build before a change), in
# one lab: HAProxy, nginx and both builds interleaved, pinned by default, each
# figure with its spread and the ratio "proxy ÷ base" (root; ~45 minutes;
# SETTINGS, TESTS and PATHS as for make bench).
bench-ab: bench-tools
	@[ -n "$(BASE)" ] || { echo "bench-ab: name the build to compare with, e.g. make bench-ab BASE=HEAD~1" >&2; exit 2; }
	rm -rf $(BIN)/base && mkdir -p $(BIN)/base/src
	git archive "$(BASE)" | tar -x -C $(BIN)/base/src
	cd $(BIN)/base/src && CGO_ENABLED=0 $(GO) build -trimpath -o ../kube-userspace-proxy ./cmd/kube-userspace-proxy
	BASE_BIN=$(BIN)/base/kube-userspace-proxy SETTINGS="$(or $(SETTINGS),pinned)" PATHS="$(or $(PATHS),haproxy nginx proxy)" \
		TESTS="$(or $(TESTS),tput128 tput4 cps rps latency sys udp idle flows)" BIN=$(BIN) ./test/bench/bench.sh

# HAProxy, the least a Go program does per connection (test/bench/gofloor, on
# epoll and on io_uring) and this proxy, for the TCP figures, 3 interleaved
# runs in both settings: what the Go runtime costs (~15 minutes).
bench-floor: bench-tools
	PATHS="haproxy gofloor ringfloor proxy" TESTS="tput128 tput4 cps rps latency sys" RUNS=$(or $(RUNS),3) BIN=$(BIN) ./test/bench/bench.sh

# The UDP figures (64 B and 1 400 B, 1 and 64 flows) and the machine's CPU per
# round trip for direct, nginx, the least a user-space process does per
# datagram (gofloor -udp) and this proxy: how close to direct any user-space
# UDP proxy comes on this machine; 3 interleaved searches, both settings (~25 minutes).
bench-floor-udp: bench-tools
	PATHS="direct nginx gofloor proxy" TESTS="udp udprt" UDP_SIZES="64 1400" RUNS=$(or $(RUNS),3) BIN=$(BIN) ./test/bench/bench.sh

# What our rules cost the node's other traffic: loopback throughput, ping-pong
# and new connections/s without and with 1, 100, 1000 and 10000 service ports,
# and connections/s through a ClusterIP at scale (~6 minutes).
bench-tax: bench-tools
	BIN=$(BIN) bash test/bench/nodetax.sh

# New connections/s with the guard of the proxy ports in the filter table
# and at accept (basic netfilter), beside HAProxy (~6 minutes).
bench-guard: bench-tools
	BIN=$(BIN) bash test/bench/guard.sh

# New connections/s with each scheduler and with the PROXY protocol v2 on and
# off, in one run (~2 minutes).
bench-sched: bench-tools
	BIN=$(BIN) bash test/bench/sched.sh

# N Services × M endpoints (default 10000 × 5) on the real control plane of
# test/cluster, for our daemon and kube-proxy (nftables mode, iptables mode on
# iptables-nft and on the legacy binaries),
# each in its own namespace: memory, start → serving, one change's latency, a
# churn of endpoint changes, the node tax at that scale; writes its table into
# docs/benchmarks.md (root, ~20 minutes; PROXIES=kube-userspace-proxy for ours alone).
bench-cluster: setup-bench-cluster build
	CGO_ENABLED=0 $(GO) build -o $(BIN)/loadgen ./test/bench/loadgen
	CGO_ENABLED=0 $(GO) build -o $(BIN)/clusterbench ./test/bench/clusterbench
	$(BIN)/clusterbench -bin $(BIN) -n $(or $(N),10000) -m $(or $(M),5) $(if $(PROXIES),-proxies $(PROXIES)) -write docs/benchmarks.md

# The same at 200 Services and a 5 s churn, every proxy, so that it cannot rot (part of make test).
bench-cluster-smoke: setup-bench-cluster build
	CGO_ENABLED=0 $(GO) build -o $(BIN)/loadgen ./test/bench/loadgen
	CGO_ENABLED=0 $(GO) build -o $(BIN)/clusterbench ./test/bench/clusterbench
	$(BIN)/clusterbench -bin $(BIN) -n 200 -m 5 -churn 5s -runs 2 -page 3s -tax-runs 1 -tax-dur 1

# The same harness briefly (just under a minute), so that it cannot rot (part of make test).
bench-smoke: bench-tools
	SMOKE=1 BIN=$(BIN) ./test/bench/bench.sh

# Kubernetes' own e2e suite (test/e2e/network: Services, Conntrack,
# Networking, KubeProxy, EndpointSlice) on a three-node cluster built here —
# kubelets, containerd, CoreDNS — with our DaemonSet from docs/deploy, then
# with kube-proxy (nftables, iptables) in its place; writes the table in
# docs/conformance.md and fails on a spec kube-proxy passes and we fail
# unless test/conformance/known-differences.txt lists it (root; first run
# builds for ~20 minutes, a full run of the three takes ~50). PROXIES=... picks.
conformance: setup-conformance
	$(GO) run ./test/conformance $(if $(PROXIES),-proxies $(PROXIES))

# The few-minute subset of the same (part of make test).
conformance-short: setup-conformance
	$(GO) run ./test/conformance -short -proxies kube-userspace-proxy

# After a Kubernetes upgrade: rewrite test/conformance/upstream-specs.txt,
# the specs upstream's whole e2e binary selects for the lab's focus, which
# every run checks the lab's network-only binary against (builds upstream's
# binary: ~15 minutes on two cores; no root).
conformance-specs:
	$(GO) run ./test/conformance -write-upstream-specs

# The differential (docs/conformance.md): SHAPES random Service and
# EndpointSlice shapes (200) from SEED (a new one, printed, when unset),
# each observed from seven clients over every address with ours and then
# with kube-proxy (nftables) on the same three-node lab; fails on a
# difference test/conformance/differential-known.txt does not list, each
# printed as a reproduction reduced to the smallest shape that still
# differs. CASE=N reruns one case of SEED; a full run writes its table in
# docs/conformance.md (~35 minutes for 200 shapes).
differential: setup-conformance
	$(GO) run ./test/conformance -differential $(if $(SEED),-seed $(SEED)) $(if $(SHAPES),-shapes $(SHAPES)) \
		$(if $(CASE),-case $(CASE))

# Hours of mixed load on the e2e cluster lab while the world misbehaves
# (test/e2e/soak_test.go): SOAK=2h by default, the record (samples.tsv,
# errors.txt, curves.svg) in RECORD=docs/soak. make test runs a 5-minute form.
soak: setup-test
	KUP_SOAK=$(or $(SOAK),2h) KUP_SOAK_RECORD=$(abspath $(or $(RECORD),docs/soak)) \
		$(GO) test -count=1 -run '^TestSoak$$' -v -timeout 24h ./test/e2e/
