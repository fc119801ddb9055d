# dsec — make targets. `make demo` and `make test` do all set-up on a fresh
# Debian machine with Go: missing Debian packages are installed first.

GO       ?= go
BIN      := bin/dsec
FULL_BIN := bin/dsecd
INIT_BIN := bin/dsec-init
DOCS_BIN := bin/dsec-docs
VERSION  ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
APT_PKGS := erofs-utils busybox-static attr xfsprogs e2fsprogs btrfs-progs python3 python3-pytest protobuf-compiler debootstrap \
	qemu-system-x86 qemu-utils ovmf xz-utils openssl iproute2 umoci curl
FUZZTIME ?= 60s

.PHONY: all deps cluster-deps cluster-tools image kernel build install docs-bin demo test vet docs check-docs proto-bin proto check-proto bench bench-table fuzz clean

all: build

# deps installs the Debian packages the tests and the demo use, only when
# one is missing, so it is idempotent and quiet on a prepared machine.
deps:
	@command -v $(GO) >/dev/null || { echo "make: Go is missing: install Go >= 1.26 first" >&2; exit 1; }
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	command -v npm >/dev/null || missing="$$missing nodejs npm"; \
	if [ -n "$$missing" ]; then \
		echo "make: installing Debian packages:$$missing" >&2; \
		if [ "$$(id -u)" = 0 ]; then sudo=; else sudo=sudo; fi; \
		$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq $$missing >/dev/null; \
	fi

# cluster-deps installs what the cluster tests' nodes run: Debian's
# containerd, runc and CNI plugins (idempotent, as deps).
CLUSTER_PKGS := containerd runc containernetworking-plugins
cluster-deps: deps
	@missing=""; for p in $(CLUSTER_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "make: installing Debian packages:$$missing" >&2; \
		if [ "$$(id -u)" = 0 ]; then sudo=; else sudo=sudo; fi; \
		$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq $$missing >/dev/null; \
	fi

# cluster-tools builds the Kubernetes binaries (kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet, kubectl) and etcd the
# cluster tests start, from the modules pinned in tools/, into
# CLUSTER_CACHE, kept between runs: about 27 minutes the first time on
# two cores, nothing once built (scripts/cluster-tools.sh).
CLUSTER_CACHE ?= /var/cache/dsec/cluster-tools
cluster-tools: cluster-deps
	./scripts/cluster-tools.sh $(CLUSTER_CACHE)

# image writes the OCI image archives Kubernetes runs (deploy/kubernetes):
# bin/dsec-image.tar, localhost/dsec:$(IMAGE_TAG), the static binaries
# alone (the worker and the gateway; no base image), and the pause image
# of the cluster tests' pods. Load one with
# ctr -n k8s.io images import --base-name localhost/dsec bin/dsec-image.tar,
# or push it with skopeo copy oci-archive:bin/dsec-image.tar docker://REGISTRY/dsec:TAG.
IMAGE       := bin/dsec-image.tar
PAUSE_IMAGE := bin/pause-image.tar
IMAGE_TAG   ?= dev
image: build
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w" -o bin/pause ./tools/pause
	./scripts/image.sh $(IMAGE) localhost/dsec:$(IMAGE_TAG) $(FULL_BIN):/opt/dsec/bin/dsecd $(BIN):/opt/dsec/bin/dsec $(INIT_BIN):/opt/dsec/bin/dsec-init
	./scripts/image.sh $(PAUSE_IMAGE) localhost/dsec/pause:1 bin/pause:/pause

# kernel unpacks the microVM backend's guest kernel, Debian's, into
# bin/microvm (where dsecd looks, beside itself): the package
# linux-image-amd64 depends on today, fetched with apt-get download
# (verified against the signed archive), never installed. Idempotent: a
# bin/microvm holding today's package's kernel stays as it is.
kernel: deps
	./scripts/microvm-kernel.sh bin/microvm

# build makes the three binaries dsec is: bin/dsecd, the complete one (the
# worker, layer, snap, policy and pool commands); bin/dsec, the client (the
# front build tag: run, exec, ps, inspect, logs, cp, stop, start and rm in
# a binary that starts in two thirds of the time), which hands every other
# command to the dsecd next to it; and bin/dsec-init, the sandboxes' init,
# which the worker next to it starts (a third of dsecd's start). Static (no
# cgo): a dynamically linked start costs the loader's ~1.5 ms here.
build: deps kernel
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-X main.version=$(VERSION)" -o $(FULL_BIN) ./cmd/dsec
	CGO_ENABLED=0 $(GO) build -trimpath -tags front -ldflags "-X main.version=$(VERSION)" -o $(BIN) ./cmd/dsec
	CGO_ENABLED=0 $(GO) build -trimpath -o $(INIT_BIN) ./cmd/dsec-init

# install puts the binaries (dsec finds dsecd beside it, dsecd dsec-init), the man pages, the docs,
# the completions and the worker's systemd unit under DESTDIR/PREFIX.
PREFIX ?= /usr/local
install: build
	install -D -m 0755 -t $(DESTDIR)$(PREFIX)/bin $(BIN) $(FULL_BIN) $(INIT_BIN)
	install -D -m 0644 -t $(DESTDIR)$(PREFIX)/share/man/man1 man/man1/*.1
	install -D -m 0644 -t $(DESTDIR)$(PREFIX)/share/man/man5 man/man5/*.5
	install -D -m 0644 completions/dsec.bash $(DESTDIR)$(PREFIX)/share/bash-completion/completions/dsec
	install -D -m 0644 completions/dsec.zsh $(DESTDIR)$(PREFIX)/share/zsh/site-functions/_dsec
	install -D -m 0644 completions/dsec.fish $(DESTDIR)$(PREFIX)/share/fish/vendor_completions.d/dsec.fish
	install -D -m 0644 contrib/systemd/dsec.service $(DESTDIR)$(PREFIX)/lib/systemd/system/dsec.service
	rm -rf $(DESTDIR)$(PREFIX)/share/doc/dsec && mkdir -p $(DESTDIR)$(PREFIX)/share/doc/dsec && \
		cp -a README.md docs $(DESTDIR)$(PREFIX)/share/doc/dsec/
	rm -rf $(DESTDIR)$(PREFIX)/lib/dsec/microvm && mkdir -p $(DESTDIR)$(PREFIX)/lib/dsec && cp -a bin/microvm $(DESTDIR)$(PREFIX)/lib/dsec/microvm

# docs-bin is dsec with the gen-docs command (the gendocs build tag), which
# the installed binary leaves out.
docs-bin: deps
	$(GO) build -trimpath -tags gendocs -ldflags "-X main.version=$(VERSION)" -o $(DOCS_BIN) ./cmd/dsec

demo: build
	./scripts/demo.sh $(BIN)

vet:
	@test -z "$$(gofmt -l .)" || { echo "make: gofmt needed on:"; gofmt -l .; exit 1; }
	$(GO) vet ./...
	GOOS=darwin $(GO) vet ./...
	$(GO) vet -tags gendocs ./cmd/dsec
	$(GO) vet -tags front ./cmd/dsec

# docs regenerates the man pages and shell completions from the command tree,
# the policy JSON schema from the api types, and the references under
# docs/reference, which are generated only (never edit them): cli/*.md, a
# page per command (cobra's markdown; dsec.md the root's), config.md, every
# config key with its type, default, DSEC_* variable and description (from
# Config's fields, their doc tags and the loader's defaults, cmd/dsec/app.go),
# and api.md, the API's routes, error classes and types (from api.Routes and
# the api package's types and comments).
docs: docs-bin
	rm -rf man/man1 completions docs/policy.schema.json docs/reference
	$(DOCS_BIN) gen-docs .

# check-docs fails, naming the first stale file, when what gen-docs writes
# differs from what is committed (make test runs it).
check-docs: docs-bin
	@tmp=$$(mktemp -d); trap 'rm -rf $$tmp' EXIT; $(DOCS_BIN) gen-docs $$tmp || exit 1; \
	for d in man/man1 completions docs/policy.schema.json docs/reference; do \
		stale=$$(diff -rq $$tmp/$$d $$d 2>&1 | head -n 1 | sed -e 's|^Files .* and \(.*\) differ$$|\1|' \
			-e 's|^Only in \(.*\): \(.*\)$$|\1/\2|' -e 's|^diff: \(.*\): .*$$|\1|' -e "s|^$$tmp/||"); \
		if [ -n "$$stale" ]; then \
			echo "make: $$stale is stale: run 'make docs' and commit the result" >&2; exit 1; fi; \
	done

# proto regenerates the envd RPC code (the E2B front's) from its .proto
# files, with protoc (Debian's) and the two plugins built from the module
# versions go.mod pins; the result is committed.
PROTOS := internal/e2b/envd/process/process.proto internal/e2b/envd/filesystem/filesystem.proto
proto-bin: deps
	$(GO) build -o bin/protoc-gen-go google.golang.org/protobuf/cmd/protoc-gen-go
	$(GO) build -o bin/protoc-gen-connect-go connectrpc.com/connect/cmd/protoc-gen-connect-go

proto: proto-bin
	PATH=$(CURDIR)/bin:$$PATH protoc -I internal/e2b/envd --go_out=internal/e2b/envd --go_opt=paths=source_relative \
		--connect-go_out=internal/e2b/envd --connect-go_opt=paths=source_relative $(PROTOS:internal/e2b/envd/%=%)

# check-proto fails when the committed code is not what proto makes (the
# protoc version line aside).
check-proto: proto-bin
	@tmp=$$(mktemp -d); trap 'rm -rf $$tmp' EXIT; \
	PATH=$(CURDIR)/bin:$$PATH protoc -I internal/e2b/envd --go_out=$$tmp --go_opt=paths=source_relative \
		--connect-go_out=$$tmp --connect-go_opt=paths=source_relative $(PROTOS:internal/e2b/envd/%=%); \
	for f in $$(cd $$tmp && find . -name '*.go' | sed 's,^\./,,'); do \
		diff -q -I '^// 	protoc ' $$tmp/$$f internal/e2b/envd/$$f >/dev/null || { \
		echo "make: internal/e2b/envd/$$f is stale: run 'make proto' and commit the result" >&2; exit 1; }; done

# A package's tests get 60 minutes: the vm backend's boots some fifteen
# full VMs under TCG here, some 35 minutes with the race detector beside
# the sdk package's.
test: deps kernel vet check-docs check-proto image cluster-tools
	DSEC_CLUSTER_TOOLS=$$(./scripts/cluster-tools.sh $(CLUSTER_CACHE)) DSEC_IMAGE=$(CURDIR)/$(IMAGE) DSEC_PAUSE_IMAGE=$(CURDIR)/$(PAUSE_IMAGE) \
		$(GO) test -race -count=1 -timeout 60m ./...

BENCH_PKGS := pv debootstrap runc containerd

# bench runs every figure next to its baseline; each script records what it
# prints in bench/results.json (scripts/bench-lib.sh, through
# scripts/benchtable), and the table at the top of BENCHMARKS.md is
# rendered from that file last. bench-table renders it alone (no benchmark
# runs); the benchtable tests fail when it is stale.
bench: export BENCHTABLE := $(CURDIR)/bin/benchtable
bench: build
	$(GO) build -o bin/benchtable ./scripts/benchtable
	@missing=""; for p in $(BENCH_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then sudo=; else sudo=sudo; fi; \
		$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq $$missing >/dev/null; \
	fi
	./scripts/bench.sh $(BIN)
	./scripts/bench-lazy.sh $(BIN)
	./scripts/bench-run.sh $(BIN)
	./scripts/bench-snap.sh $(BIN)
	./scripts/bench-idle.sh $(BIN)
	./scripts/bench-policy.sh
	./scripts/bench-density.sh
	./scripts/bench-remote.sh
	./scripts/bench-e2b.sh
	./scripts/bench-microvm.sh
	./scripts/bench-egress.sh
	./scripts/bench-gateway.sh
	./scripts/bench-vmsnap.sh
	./scripts/bench-image.sh
	./scripts/bench-vm.sh
	bin/benchtable render

bench-table:
	$(GO) run ./scripts/benchtable render

fuzz: deps
	$(GO) test -run '^$$' -fuzz '^FuzzTar$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/layer
	$(GO) test -run '^$$' -fuzz '^FuzzImageArchive$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/layer
	$(GO) test -run '^$$' -fuzz '^FuzzProfile$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/layer
	$(GO) test -run '^$$' -fuzz '^FuzzParseConfig$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/layer
	$(GO) test -run '^$$' -fuzz '^FuzzParseReference$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/layer/image
	$(GO) test -run '^$$' -fuzz '^FuzzParseManifest$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/layer/image
	$(GO) test -run '^$$' -fuzz '^FuzzParseIndex$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/layer/image
	$(GO) test -run '^$$' -fuzz '^FuzzParseConfig$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/layer/image
	$(GO) test -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/policy
	$(GO) test -run '^$$' -fuzz '^FuzzExtract$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/archive
	$(GO) test -run '^$$' -fuzz '^FuzzValidate$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./api
	$(GO) test -run '^$$' -fuzz '^FuzzCheck$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/auth
	$(GO) test -run '^$$' -fuzz '^FuzzRoutes$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/e2b
	$(GO) test -run '^$$' -fuzz '^FuzzModinfo$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/runtime/microvm
	$(GO) test -run '^$$' -fuzz '^FuzzRead$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/runtime/sparse
	$(GO) test -run '^$$' -fuzz '^FuzzParseHello$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/egress
	$(GO) test -run '^$$' -fuzz '^FuzzParseRequest$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/egress
	$(GO) test -run '^$$' -fuzz '^FuzzPattern$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/egress
	$(GO) test -run '^$$' -fuzz '^FuzzAnswer$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/egress
	$(GO) test -run '^$$' -fuzz '^FuzzHandle$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/egress
	$(GO) test -run '^$$' -fuzz '^FuzzGate$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/egress
	$(GO) test -run '^$$' -fuzz '^FuzzRules$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/grade
	$(GO) test -run '^$$' -fuzz '^FuzzInput$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 3s ./internal/runtime/screen

# clean first unmounts what the demo's and benchmarks' roots still have
# mounted (the sandboxes' shared uppers file system, kept while a sandbox
# is left on it), deepest first.
clean:
	scripts/clean.sh .demo .bench .bench-lazy .bench-run .bench-snap
	rm -rf bin
