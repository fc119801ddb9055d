#!/usr/bin/env bash
# ab-worker.sh A-DIR B-DIR [N] (as root): two worker builds compared on `dsec run --rm --base $LAYER -- true`. Each
# directory holds a build's dsec, dsecd and dsec-init (make build's bin/). A's worker serves $ROOT_A and B's $ROOT_B
# (both roots must hold $LAYER, default bench:1); runs alternate between them 50 ms apart, N per side (default 100),
# then the roots are swapped and it runs again, so that neither root's state decides it. Prints p25, p50, p90 and p99 per
# side and round. Each worker is stopped before and after.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: ROOT_A=DIR ROOT_B=DIR [LAYER=bench:1] $0 A-DIR B-DIR [N]" >&2; exit 2; }
[ -n "${ROOT_A:-}" ] && [ -n "${ROOT_B:-}" ] && [ "$ROOT_A" != "$ROOT_B" ] || { echo "ab-worker: set ROOT_A and ROOT_B to two roots" >&2; exit 2; }
a=$1 b=$2 n=${3:-100} layer=${LAYER:-bench:1}
out=$(mktemp -d)
stop() { for r in "$ROOT_A" "$ROOT_B"; do DSEC_ROOT=$r "$a/dsec" daemon stop >/dev/null 2>&1 || true; done; }
trap 'stop; rm -rf "$out"' EXIT
for round in 1 2; do
	stop
	ra=$ROOT_A rb=$ROOT_B
	[ "$round" = 1 ] || { ra=$ROOT_B rb=$ROOT_A; }
	for side in a b; do # each worker up, its caches warm
		d=$a r=$ra; [ $side = a ] || { d=$b r=$rb; }
		DSEC_ROOT=$r "$d/dsec" run --rm --base "$layer" -- true >/dev/null 2>&1
		DSEC_ROOT=$r "$d/dsec" run --rm --base "$layer" -- true >/dev/null
	done
	: >"$out/a"; : >"$out/b"
	for _ in $(seq "$n"); do
		for side in a b; do
			d=$a r=$ra; [ $side = a ] || { d=$b r=$rb; }
			t=${EPOCHREALTIME/./}
			DSEC_ROOT=$r "$d/dsec" run --rm --base "$layer" -- true >/dev/null || { echo "ab-worker: $d failed" >&2; exit 1; }
			u=${EPOCHREALTIME/./}
			echo $((u - t)) >>"$out/$side"
			sleep 0.05
		done
	done
	for side in a b; do
		sort -n "$out/$side" | awk -v s=$side -v r=$round '{v[NR]=$1} END {
			printf "round %s %s p25 %.2f p50 %.2f p90 %.2f p99 %.2f ms\n", r, s, v[int(NR*0.25+0.999)]/1000, v[int(NR*0.5+0.999)]/1000, v[int(NR*0.9+0.999)]/1000, v[int(NR*0.99+0.999)]/1000}'
	done
done
