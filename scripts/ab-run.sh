#!/usr/bin/env bash
# ab-run.sh A B [N] (as root): two dsec client builds, or one against itself, compared on `dsec run --rm
# --base $LAYER -- true` through the one worker of $DSEC_ROOT: N runs each (default 100), alternating A and B,
# 50 ms apart (as bench-run.sh spaces them), timed from bash's own clock; prints p25, p50 and p90 per side and
# B's p50 over A's. A machine this noisy gives a figure only next to its baseline in the same run.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: DSEC_ROOT=ROOT [LAYER=bench:1] $0 A-BINARY B-BINARY [N]" >&2; exit 2; }
[ -n "${DSEC_ROOT:-}" ] || { echo "ab-run: set DSEC_ROOT to the root whose worker both use" >&2; exit 2; }
a=$1 b=$2 n=${3:-100} layer=${LAYER:-bench:1}
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
"$b" run --rm --base "$layer" -- true >/dev/null # the worker up (B starts it if need be), the caches warm
"$a" run --rm --base "$layer" -- true >/dev/null
for _ in $(seq "$n"); do
	for side in a b; do
		bin=$a; [ $side = a ] || bin=$b
		t=${EPOCHREALTIME/./}
		"$bin" run --rm --base "$layer" -- true >/dev/null || { echo "ab-run: $bin failed" >&2; exit 1; }
		u=${EPOCHREALTIME/./}
		echo $((u - t)) >>"$out/$side"
		sleep 0.05
	done
done
p() { sort -n "$out/$1" | awk -v q="$2" '{v[NR]=$1} END {i=int(NR*q+0.999); if (i<1) i=1; printf "%.2f", v[i]/1000}'; }
for side in a b; do echo "$side p25 $(p $side 0.25) p50 $(p $side 0.5) p90 $(p $side 0.9) ms"; done
awk -v x="$(p a 0.5)" -v y="$(p b 0.5)" 'BEGIN {printf "b/a p50 %.3fx\n", y / x}'
