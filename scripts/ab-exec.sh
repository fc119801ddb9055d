#!/usr/bin/env bash
# ab-exec.sh REV-A [REV-B] (as root): what a change costs an exec, two builds' workers side by side. REV-A and REV-B are
# git revisions of this repository (REV-B by default the working tree); each build's dsecd and dsec-init serve a root
# of their own, on a layer of busybox and bash. Their requests alternate turn by turn (A then B, then B then A), so that
# what the machine does meanwhile falls on both alike, and every figure runs twice, the roots swapped:
#   1. create + the first exec, a create alone (creates one after the other, no exec between), and exec of true, Go
#      SDK, unix socket (sdk's BenchmarkExecAB; BENCH_AB_N exec turns, default 1000, a tenth as many creates of each)
#   2. the same over TCP with TLS and a token
#   3. E2B Sandbox.create + the first commands.run, and commands.run, official JS SDK (internal/e2b/testdata/ab.cjs), over
#      TLS (the workers' certificate; HTTP/2 where a build offers it) and over plain HTTP (the workers restarted without)
#   With BENCH_AB_E2B_ONLY=1 only the E2B figures run; with BENCH_AB_GO_ONLY=1 only the Go SDK's; with
#   BENCH_AB_UNIX_ONLY=1 only the Go SDK's over the unix socket, and the workers get no TCP listener, certificate or
#   token: what a build older than tokens (before 2026-12-01) can serve.
#   4. with BENCH_AB_H2=1, the E2B figures over TLS once more with B's front offering HTTP/2 (config e2b.http2): what
#      HTTP/2 costs the JS SDK (run it with REV-A the tree's own commit)
# Prints each side's p50 and the ratio B/A per round: under 1 is B faster.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "ab-exec: needs root (the workers)" >&2; exit 1; }
[ $# -ge 1 ] || { echo "usage: $0 REV-A [REV-B]   (REV-B: the working tree)" >&2; exit 2; }
unix_only=
[ "${BENCH_AB_UNIX_ONLY:-}" != 1 ] || unix_only=1
[ -n "$unix_only" ] || command -v node >/dev/null || { echo "ab-exec: needs node (make deps installs it)" >&2; exit 1; }
repo=$(git rev-parse --show-toplevel)
n=${BENCH_AB_N:-1000}
work=$(mktemp -d /tmp/dsec-ab.XXXXXX)
stop() { for s in a b; do [ -x "$work/$s/dsec" ] && DSEC_ROOT=$work/root-$s "$work/$s/dsec" daemon stop >/dev/null 2>&1 || true; done; }
cleanup() { stop; git -C "$repo" worktree prune; rm -rf "$work"; }
trap cleanup EXIT

build() { # build REV DIR
	local src=$repo
	if [ "$1" != . ]; then
		src=$work/src
		git -C "$repo" worktree add -q --detach "$src" "$1"
	fi
	(cd "$src" && CGO_ENABLED=0 go build -trimpath -o "$2/dsecd" ./cmd/dsec &&
		CGO_ENABLED=0 go build -trimpath -tags front -o "$2/dsec" ./cmd/dsec &&
		CGO_ENABLED=0 go build -trimpath -o "$2/dsec-init" ./cmd/dsec-init)
	if [ "$1" != . ]; then git -C "$repo" worktree remove --force "$src"; fi
}
build "$1" "$work/a"
build "${2:-.}" "$work/b"
(cd "$repo" && go test -c -o "$work/sdk.test" ./sdk/)
mods=${XDG_CACHE_HOME:-$HOME/.cache}/dsec/e2b-2.51.0
[ -n "$unix_only" ] || [ -f "$mods/node_modules/e2b/package.json" ] || npm install -s --prefix "$mods" e2b@2.51.0 >/dev/null

# The layer: busybox, and bash with its libraries (E2B runs commands with bash -l -c).
rootfs=$work/rootfs
mkdir -p "$rootfs/bin" "$rootfs/etc" "$rootfs/tmp" "$rootfs/root"
cp /bin/busybox "$rootfs/bin/"
for c in sh true cat ls sleep; do ln -s busybox "$rootfs/bin/$c"; done
cp /bin/bash "$rootfs/bin/bash"
for lib in $(ldd /bin/bash | grep -o '/[^ ]*'); do mkdir -p "$rootfs$(dirname "$lib")"; cp -L "$lib" "$rootfs$lib"; done
[ -n "$unix_only" ] || "$work/b/dsecd" daemon certs "$work/tls" --name localhost >/dev/null
for s in a b; do
	DSEC_ROOT=$work/root-$s "$work/a/dsecd" layer build "$rootfs" --kind base -t bench:1 >/dev/null
	[ -z "$unix_only" ] || continue
	DSEC_ROOT=$work/root-$s "$work/b/dsecd" token create --scope sandboxes --ttl 24h >"$work/token-$s"
	DSEC_ROOT=$work/root-$s "$work/b/dsecd" token create --e2b --ttl 24h >"$work/key-$s"
done

metric() { awk -v m="$2" '{for (i = 2; i <= NF; i++) if ($i == m) print $(i-1)}' <<<"$1"; }
echo "== exec, A ($1) vs B (${2:-working tree}), turns alternating; $(nproc) cores, $(uname -r), $(date -u +%F)"
printf '%-7s %-44s %10s %10s %8s %8s\n' round figure A B B/A "turns"
# up starts both workers, with TLS or without (plain), on ports pa and pb.
up() {
	stop
	local tls=() la=(--listen "tcp://127.0.0.1:$pa" --e2b-listen "127.0.0.1:$((pa + 100))")
	local lb=(--listen "tcp://127.0.0.1:$pb" --e2b-listen "127.0.0.1:$((pb + 100))")
	[ "$1" = plain ] || tls=(--tls-cert "$work/tls/server.pem" --tls-key "$work/tls/server-key.pem")
	[ -z "$unix_only" ] || { tls=() la=() lb=(); }
	DSEC_ROOT=$ra setsid "$work/a/dsecd" daemon "${la[@]}" "${tls[@]}" >"$work/daemon-a.log" 2>&1 &
	local envb=(DSEC_ROOT=$rb)
	if [ "${2:-}" = h2b ]; then printf 'e2b:\n  http2: true\n' >"$work/h2.yaml" && envb+=(DSEC_CONFIG=$work/h2.yaml); fi
	env "${envb[@]}" setsid "$work/b/dsecd" daemon "${lb[@]}" "${tls[@]}" >"$work/daemon-b.log" 2>&1 &
	for r in "$ra" "$rb"; do
		for _ in $(seq 100); do [ -S "$r/dsec.sock" ] && break; sleep 0.1; done
	done
}

# e2b prints the E2B figures over https or http.
e2b() {
	local j
	j=$(cd "$repo" && NODE_PATH=$mods/node_modules NODE_EXTRA_CA_CERTS=$work/tls/ca.pem node internal/e2b/testdata/ab.cjs bench:1 \
		$((n / 10)) "$1://localhost:$((pa + 100))" "$(cat "$work/key-$ka")" "$1://localhost:$((pb + 100))" "$(cat "$work/key-$kb")")
	for f in create_first run; do
		python3 -c 'import json,sys; d=json.loads(sys.argv[1])[sys.argv[2]]; print("%.2f %.2f %.3f %.3f" % (d["a_p50_ms"], d["b_p50_ms"], d["b_a_p50"], d["b_a_median_of_turns"]))' "$j" $f |
			{ read -r x y z w; printf '%-7s %-44s %7s ms %7s ms %7sx %7sx\n' "$round" "E2B $f p50, JS SDK, $1${2:+ ($2 on B)}" "$x" "$y" "$z" "$w"; }
	done
}

for round in 1 2; do
	# ka, kb: the root (its tokens and keys) A's build and B's serve
	ka=a kb=b pa=17501 pb=17502
	[ "$round" = 1 ] || { ka=b kb=a pa=17502 pb=17501; }
	ra=$work/root-$ka rb=$work/root-$kb
	up tls
	modes=(unix tcp)
	[ "${BENCH_AB_E2B_ONLY:-}" != 1 ] || modes=()
	[ -z "$unix_only" ] || modes=(unix)
	for mode in "${modes[@]}"; do
		a=$ra b=$rb
		[ $mode = unix ] || { a="tcp://localhost:$pa|$(cat "$work/token-$ka")" b="tcp://localhost:$pb|$(cat "$work/token-$kb")"; }
		r=$(cd "$repo/sdk" && DSEC_AB_A=$a DSEC_AB_B=$b DSEC_AB_CA=$work/tls/ca.pem DSEC_AB_CREATES=$((n / 10)) "$work/sdk.test" -test.run '^$' \
			-test.bench '^BenchmarkExecAB$' -test.benchtime "${n}x")
		for f in create create-only exec; do
			printf '%-7s %-44s %7s ms %7s ms %7.3fx %7.3fx\n' "$round" "${f/-only/ alone} p50, Go SDK, $mode" "$(metric "$r" $f-a-p50-ms)" \
				"$(metric "$r" $f-b-p50-ms)" "$(metric "$r" $f-b/a-p50)" "$(metric "$r" $f-b/a-median-of-turns)"
		done
	done
	[ "${BENCH_AB_GO_ONLY:-}" != 1 ] && [ -z "$unix_only" ] || continue
	e2b https # the front speaks TLS as the API does
	if [ "${BENCH_AB_H2:-}" = 1 ]; then
		up tls h2b
		e2b https h2
	fi
	up plain
	e2b http
done
