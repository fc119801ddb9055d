#!/usr/bin/env bash
# ab-cpu.sh A-DIR B-DIR [ROUNDS] (as root): what two worker builds cost the host per sandbox. Each directory holds a
# build's dsecd and dsec-init (make build's bin/). One worker runs at a time, A's then B's, ROUNDS times (default 3), each
# on a root of its own with a layer of busybox: the SDK makes a sandbox, runs its first exec and removes it, N times one
# after the other (BENCH_N, default 100; sdk's BenchmarkCreateExecRemove). Prints per side and round the time per
# sandbox, create to first exec p50, the CPU the machine spent per sandbox (user, system and interrupts in /proc/stat
# over the run, divided by N), and the anonymous memory (RssAnon) of an idle init: the mean over the worker's inits
# left after the run (its spares and the primed sandbox's).
# scripts/ab-exec.sh alternates two workers' requests turn by turn, which is what a latency needs; but there both
# workers' background work (spare inits started, removals) shares the CPUs, so what one build saves the other gains
# too: this script shows that part.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "ab-cpu: needs root (the workers)" >&2; exit 1; }
[ $# -ge 2 ] || { echo "usage: $0 A-DIR B-DIR [ROUNDS]" >&2; exit 2; }
for d in "$1" "$2"; do
	[ -x "$d/dsecd" ] && [ -x "$d/dsec-init" ] || { echo "ab-cpu: $d has no dsecd and dsec-init: make build puts them in bin/" >&2; exit 2; }
done
dirs=("$(realpath "$1")" "$(realpath "$2")") rounds=${3:-3} n=${BENCH_N:-100}
repo=$(git rev-parse --show-toplevel)
work=$(mktemp -d /tmp/dsec-ab-cpu.XXXXXX)
trap 'DSEC="${dirs[0]}/dsecd" "$repo/scripts/clean.sh" "$work"' EXIT # sandboxes, workers, mounts, then the directory
(cd "$repo" && go test -c -o "$work/sdk.test" ./sdk/)
rootfs=$work/rootfs
mkdir -p "$rootfs/bin" "$rootfs/etc" "$rootfs/tmp" "$rootfs/root"
cp /bin/busybox "$rootfs/bin/"
for c in sh true cat ls sleep; do ln -s busybox "$rootfs/bin/$c"; done
for s in 0 1; do DSEC_ROOT=$work/root-$s "${dirs[$s]}/dsecd" layer build "$rootfs" --kind base -t bench:1 >/dev/null; done
busy() { awk '/^cpu / {printf "%.0f\n", $2 + $3 + $4 + $7 + $8}' /proc/stat; } # user nice system irq softirq
tick=$(getconf CLK_TCK)
echo "== per sandbox, A ($1) then B ($2), one worker at a time; $(nproc) cores, $(uname -r), $(date -u +%F)"
printf '%-6s %-5s %12s %22s %14s %18s\n' round side "ms/sandbox" "create to 1st exec p50" "CPU ms/sandbox" "idle init anon KB"
for round in $(seq "$rounds"); do
	for s in 0 1; do
		r=$work/root-$s side=A
		[ $s = 0 ] || side=B
		DSEC_ROOT=$r setsid "${dirs[$s]}/dsecd" daemon >"$work/daemon-$s.log" 2>&1 &
		for _ in $(seq 100); do [ -S "$r/dsec.sock" ] && break; sleep 0.1; done
		[ -S "$r/dsec.sock" ] || { echo "ab-cpu: $side's worker did not start:"; cat "$work/daemon-$s.log"; exit 1; } >&2
		sleep 1 # its spare inits started
		b0=$(busy)
		if ! DSEC_BENCH_ROOT=$r DSEC_BENCH_LAYER=bench:1 "$work/sdk.test" -test.run '^$' \
			-test.bench 'BenchmarkCreateExecRemove$' -test.benchtime "${n}x" >"$work/bench.out" 2>&1; then
			{ echo "ab-cpu: $side's benchmark failed:"; cat "$work/bench.out"; tail -20 "$work/daemon-$s.log"; } >&2
			exit 1
		fi
		b1=$(busy)
		sleep 1 # the last spare's start ended
		anon=$(for p in $(pgrep -x -P "$(cat "$r/worker.pid")" dsec-init); do
			awk '/^RssAnon:/ {print $2}' "/proc/$p/status" 2>/dev/null || true
		done | awk '{s += $1; k++} END {if (k) printf "%d", s / k; else print "-"}')
		DSEC_ROOT=$r "${dirs[$s]}/dsecd" daemon stop >/dev/null
		awk -v r="$round" -v side=$side -v cpu="$(((b1 - b0) * 1000))" -v tick="$tick" -v n="$n" -v anon="$anon" '/^Benchmark/ {
			for (i = 2; i <= NF; i++) if ($i == "ns/op") ms = $(i-1) / 1e6; else if ($i == "first-exec-p50-ms") fe = $(i-1)
			printf "%-6s %-5s %12.1f %22.2f %14.1f %18s\n", r, side, ms, fe, cpu / tick / n, anon
		}' "$work/bench.out"
	done
done
