#!/usr/bin/env bash
# ab-cpu.sh A-DIR B-DIR [ROUNDS] (as root): what two worker builds cost the host per sandbox. Each directory holds a
# build's dsecd and dsec-init (make build's bin/). One worker runs at a time, A's then B's, ROUNDS times (default 3), each
# on a root of its own with a layer of busybox: the SDK makes a sandbox, runs its first exec and removes it, N times one
# after the other (BENCH_N, default 100; sdk's BenchmarkCreateExecRemove). Prints per side and round the time per
# sandbox, the first exec's p50, the CPU the whole machine spent per sandbox (non-idle time in /proc/stat over the run,
# divided by N), and a spare init's anonymous memory (RssAnon, the mean of the worker's waiting after the run).
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
stop() { for s in 0 1; do DSEC_ROOT=$work/root-$s "${dirs[$s]}/dsecd" daemon stop >/dev/null 2>&1 || true; done; }
trap 'stop; rm -rf "$work"' EXIT
(cd "$repo" && go test -c -o "$work/sdk.test" ./sdk/)
rootfs=$work/rootfs
mkdir -p "$rootfs/bin" "$rootfs/etc" "$rootfs/tmp" "$rootfs/root"
cp /bin/busybox "$rootfs/bin/"
for c in sh true cat ls sleep; do ln -s busybox "$rootfs/bin/$c"; done
for s in 0 1; do DSEC_ROOT=$work/root-$s "${dirs[$s]}/dsecd" layer build "$rootfs" --kind base -t bench:1 >/dev/null; done
busy() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; } # user nice system irq softirq steal
tick=$(getconf CLK_TCK)
echo "== per sandbox, A ($1) then B ($2), one worker at a time; $(nproc) cores, $(uname -r), $(date -u +%F)"
printf '%-6s %-5s %12s %16s %14s %18s\n' round side "ms/sandbox" "first exec p50" "CPU ms/sandbox" "spare init anon KB"
for round in $(seq "$rounds"); do
	for s in 0 1; do
		r=$work/root-$s
		DSEC_ROOT=$r setsid "${dirs[$s]}/dsecd" daemon >"$work/daemon-$s.log" 2>&1 &
		for _ in $(seq 100); do [ -S "$r/dsec.sock" ] && break; sleep 0.1; done
		sleep 1 # its spare inits started
		b0=$(busy)
		out=$(DSEC_BENCH_ROOT=$r DSEC_BENCH_LAYER=bench:1 "$work/sdk.test" -test.run '^$' \
			-test.bench 'BenchmarkCreateExecRemove$' -test.benchtime "${n}x" | grep '^Benchmark')
		b1=$(busy)
		sleep 1 # the last spare's start ended
		anon=$(for p in $(pgrep -x -P "$(cat "$r/worker.pid")" dsec-init); do awk '/^RssAnon:/ {print $2}' "/proc/$p/status"; done |
			awk '{s += $1; k++} END {if (k) printf "%d", s / k; else print "-"}')
		DSEC_ROOT=$r "${dirs[$s]}/dsecd" daemon stop >/dev/null
		side=A; [ $s = 0 ] || side=B
		awk -v r="$round" -v side=$side -v cpu="$(((b1 - b0) * 1000 / tick / n))" -v anon="$anon" '{
			for (i = 2; i <= NF; i++) if ($i == "ns/op") ms = $(i-1) / 1e6; else if ($i == "first-exec-p50-ms") fe = $(i-1)
			printf "%-6s %-5s %12.1f %16.2f %14d %18s\n", r, side, ms, fe, cpu, anon
		}' <<<"$out"
	done
done
