#!/usr/bin/env bash
# make bench (as root): snapshot figures on a >= 500 MB Debian base, each next to its baseline in the same run.
#  1. pack-diff of 1, 10 and 100 MB of changes (random bytes, 1 MiB files) in a sandbox on the base:
#     wall time of `dsec snap pack-diff` and how long the sandbox was frozen. Baseline: the base itself
#     turned into a layer (`dsec layer build` of the whole tree), what a snapshot costs when it grows
#     with the image, not the change.
#  2. K=16 branches: `dsec snap branch S -n 16` then one `dsec exec NAME -- true` in each, all at once,
#     until all 16 answered. Baseline: 16 sandboxes made by copying the rootfs (cp -a), the copies alone.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
. "$(dirname "$0")/bench-lib.sh"
[ "$(id -u)" = 0 ] || { echo "bench-snap: needs root (namespaces, mounts): skipped" >&2; exit 0; }
dsec=$(realpath "${1:-bin/dsec}")
work=${BENCH_DIR:-$PWD/.bench-snap}
rootfs=${BENCH_ROOTFS:-/var/cache/dsec-bench/rootfs}
k=${BENCH_K:-16}
export DSEC_ROOT=$work/root DSEC_PROGRESS=never
cleanup() {
	"$dsec" ps -q 2>/dev/null | xargs -r "$dsec" rm -f >/dev/null 2>&1 || true
	"$dsec" daemon stop >/dev/null 2>&1 || true
	rm -rf "$work"
}
trap cleanup EXIT
rm -rf "$work"; mkdir -p "$work"
[ -x "$rootfs/usr/bin/python3" ] || { echo "bench-snap: no Debian rootfs at $rootfs (scripts/bench-run.sh builds it)" >&2; exit 1; }
now() { date +%s%N; }
ms() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", (b - a) / 1e6 }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3fx", a / b }'; }

t0=$(now); "$dsec" layer build "$rootfs" --kind base -t bench:1 >/dev/null; t1=$(now)
full=$(ms "$t0" "$t1")
printf 'base: %s (%s MB), %s, %d CPUs\n' "$rootfs" "$(du -sm "$rootfs" | cut -f1)" "$(uname -r)" "$(nproc)"
printf '%-40s %10s %12s   %s\n' "figure (ms)" "dsec" "baseline" "dsec/baseline"
for mb in 1 10 100; do
	"$dsec" run -d --name "p$mb" --base bench:1 -- sleep 3600 >/dev/null 2>&1
	"$dsec" exec "p$mb" -- sh -c "mkdir -p /root/data && for i in \$(seq $mb); do head -c 1048576 /dev/urandom > /root/data/f\$i; done"
	t0=$(now); out=$("$dsec" snap pack-diff "p$mb" -t "p$mb:1" --json); t1=$(now)
	frozen=$(awk -F': ' '/"frozen_seconds"/ {gsub(/,/, "", $2); printf "%.1f", $2 * 1000}' <<<"$out")
	took=$(ms "$t0" "$t1")
	printf '%-40s %10s %12s   %s\n' "pack-diff ${mb} MB (frozen ${frozen} ms)" "$took" "$full" "$(ratio "$took" "$full")"
	target=()
	[ "$mb" != 10 ] || target=(--target "< 200 ms")
	bench_record --id "snap-pack-$mb" --area "Snapshots and branching" --unit ms \
		--title "\`snap pack-diff\` of $mb MB of changes (the sandbox frozen $frozen ms)" \
		--value "$took" --baseline "$full" --baseline-what "\`dsec layer build\` of the whole base" \
		--ratio "$(ratio "$took" "$full")" "${target[@]}"
done

# K branches of a snapshot with 10 MB of changes, until each answered an exec.
t0=$(now)
"$dsec" snap branch p10:1 -n "$k" --name-prefix br >/dev/null
pids=()
for i in $(seq "$k"); do "$dsec" exec "br-$i" -- true & pids+=($!); done
for p in "${pids[@]}"; do wait "$p"; done
t1=$(now)
branch=$(ms "$t0" "$t1")
mkdir -p "$work/copies"
t0=$(now)
for i in $(seq "$k"); do cp -a "$rootfs" "$work/copies/$i"; done
sync
t1=$(now)
copies=$(ms "$t0" "$t1")
rm -rf "$work/copies"
printf '%-40s %10s %12s   %s\n' "$k branches answering an exec" "$branch" "$copies" "$(ratio "$branch" "$copies")"
bench_record --id snap-branch --area "Snapshots and branching" --unit ms \
	--title "\`snap branch -n $k\` of a snapshot to all $k branches answering an exec" \
	--value "$branch" --baseline "$copies" --baseline-what "$k \`cp -a\` copies of the base and \`sync\`" \
	--ratio "$(ratio "$branch" "$copies")" --target "< 500 ms"

# A fork group of K with a lease against what it replaces: pack-diff then branch, K each answering an exec. Each
# round changes 1 MB first (a pack needs a change); 3 rounds of each, alternating, the median.
fork_round() { # $1: fork or pair, $2: round
	"$dsec" exec p10 -- sh -c "head -c 1048576 /dev/urandom > /root/data/round-$1-$2"
	local t0 t1 pids=() prefix=pb$2
	t0=$(now)
	if [ "$1" = fork ]; then
		prefix=fk$2
		"$dsec" snap fork p10 -n "$k" --lease 10m --tag "fk:$2" --name-prefix "$prefix" >/dev/null
	else
		"$dsec" snap pack-diff p10 -t "pb:$2" >/dev/null
		"$dsec" snap branch "pb:$2" -n "$k" --name-prefix "$prefix" >/dev/null
	fi
	for i in $(seq "$k"); do "$dsec" exec "$prefix-$i" -- true & pids+=($!); done
	for p in "${pids[@]}"; do wait "$p"; done
	t1=$(now)
	ms "$t0" "$t1"
}
median() { sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
forks=() pairs=()
for r in 1 2 3; do
	forks+=("$(fork_round fork "$r")")
	pairs+=("$(fork_round pair "$r")")
	"$dsec" ps -q | grep -E "^(fk|pb)$r-" | xargs -r "$dsec" rm -f >/dev/null
done
fork=$(printf '%s\n' "${forks[@]}" | median)
pair=$(printf '%s\n' "${pairs[@]}" | median)
printf '%-40s %10s %12s   %s\n' "fork of $k with a lease" "$fork" "$pair" "$(ratio "$fork" "$pair")"
bench_record --id snap-fork --area "Snapshots and branching" --unit ms \
	--title "\`snap fork -n $k --lease 10m\` to all $k members answering an exec (median of 3)" \
	--value "$fork" --baseline "$pair" --baseline-what "\`snap pack-diff\` then \`snap branch -n $k\`, the same" \
	--ratio "$(ratio "$fork" "$pair")" --target "<= 1.1x"

# A grade of the sandbox with 10 MB of changes (carried): the grader's first exec answered, against an exec's own.
mkdir -p "$work/grader/opt/grader" && echo 'exit 0' > "$work/grader/opt/grader/grade"
"$dsec" layer build "$work/grader" --kind toolkit -t bench-grader:1 >/dev/null
grades=() execs=()
for r in 1 2 3 4 5; do
	t0=$(now); "$dsec" exec p10 -- true; t1=$(now); execs+=("$(ms "$t0" "$t1")")
	t0=$(now); "$dsec" grade -q p10 --grader bench-grader:1 --carry '/root/**' -- sh /opt/grader/grade; t1=$(now); grades+=("$(ms "$t0" "$t1")")
done
grade=$(printf '%s\n' "${grades[@]}" | median)
exec1=$(printf '%s\n' "${execs[@]}" | median)
over=$(awk -v a="$grade" -v b="$exec1" 'BEGIN { printf "%.1f", a - b }')
printf '%-40s %10s %12s   %s\n' "grade, 10 MB carried (+$over ms)" "$grade" "$exec1" "$(ratio "$grade" "$exec1")"
bench_record --id grade-first-exec --area "Snapshots and branching" --unit ms \
	--title "\`dsec grade\` of a sandbox with 10 MB of changes carried: what it takes over an exec, to the grader's exec answered ($grade ms in all; median of 5)" \
	--value "$over" --baseline "$exec1" --baseline-what "\`dsec exec -- true\` in the sandbox" \
	--ratio "$(ratio "$grade" "$exec1")" --target "<= 100 ms"
