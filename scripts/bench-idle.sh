#!/usr/bin/env bash
# make bench (as root): idle hints. N (50) realistic idle sandboxes on a >= 500 MB Debian base: each runs python3 with
# a good part of the standard library imported, then waits, as an agent's interpreter waits for the model's next turn.
#  1. What they hold with an idle hint against without, the baseline: the memory charged to their groups (page cache
#     included), and the host's memory in use (MemTotal - MemAvailable) over what it was before they started.
#  2. What the hint costs: an exec in a hinted sandbox (resumed first) against one in a sandbox not hinted, p50 and p99.
# With BENCH_ZRAM=1, on a host with /sys/block/zram0 and no swap, the run sets up a zram swap of 4 GiB (a compressed
# tier) for its span, and takes it down after.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
. "$(dirname "$0")/bench-lib.sh"
[ "$(id -u)" = 0 ] || { echo "bench-idle: needs root (namespaces, mounts): skipped" >&2; exit 0; }
dsec=$(realpath "${1:-bin/dsec}")
work=${BENCH_DIR:-$PWD/.bench-idle}
rootfs=${BENCH_ROOTFS:-/var/cache/dsec-bench/rootfs}
n=${BENCH_N:-50}
export DSEC_ROOT=$work/root DSEC_PROGRESS=never
zram=
cleanup() {
	"$dsec" ps -q 2>/dev/null | xargs -r "$dsec" rm -f >/dev/null 2>&1 || true
	"$dsec" daemon stop >/dev/null 2>&1 || true
	rm -rf "$work"
	if [ -n "$zram" ]; then swapoff /dev/zram0 2>/dev/null || true; echo 1 > /sys/block/zram0/reset; fi
}
trap cleanup EXIT
rm -rf "$work"; mkdir -p "$work"
[ -x "$rootfs/usr/bin/python3" ] || { echo "bench-idle: no Debian rootfs at $rootfs (scripts/bench-run.sh builds it)" >&2; exit 1; }
tier="no swap"
if [ "${BENCH_ZRAM:-}" = 1 ]; then
	if [ -e /sys/block/zram0 ] && [ "$(wc -l < /proc/swaps)" = 1 ]; then
		echo 4G > /sys/block/zram0/disksize && mkswap /dev/zram0 >/dev/null && swapon /dev/zram0 && zram=1
		tier="zram swap, $(cat /sys/block/zram0/comp_algorithm | grep -o '\[[a-z0-9-]*\]')"
	else
		echo "bench-idle: BENCH_ZRAM=1 needs /sys/block/zram0 and no swap in use: run without" >&2
	fi
fi
"$dsec" layer build "$rootfs" --kind base -t bench:1 >/dev/null
used() { awk '/^MemTotal:/ {t = $2} /^MemAvailable:/ {a = $2} END {printf "%d", (t - a) * 1024}' /proc/meminfo; }
charged() { "$dsec" ps --json | awk -F': ' '/"memory_bytes"/ {gsub(/,/, "", $2); s += $2} END {printf "%d", s}'; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3fx", a / b }'; }
pct() { sort -n | awk -v p="$1" '{a[NR]=$1} END {i=int(NR*p/100+0.999); if (i<1) i=1; printf "%.1f", a[i]}'; }
py='import json, os, re, subprocess, collections, email.parser, http.client, asyncio, unittest, argparse, logging, decimal, datetime, typing, xml.etree.ElementTree, urllib.request, sqlite3, csv, pathlib, tempfile, shutil, textwrap, difflib, inspect, ast; import time; time.sleep(1e9)'

sync; echo 3 > /proc/sys/vm/drop_caches
before=$(used)
for i in $(seq "$n"); do
	"$dsec" run -d --name "i$i" --base bench:1 --memory 256M -- python3 -c "$py" >/dev/null
done
sleep 5 # (every interpreter up, its imports done)
plain_charged=$(charged); plain_used=$(( $(used) - before ))
"$dsec" idle $(seq -f 'i%g' "$n") --for 1m >/dev/null
sleep 1
hinted_charged=$(charged); hinted_used=$(( $(used) - before ))
zstat= zused=0
if [ -n "$zram" ]; then # orig_data_size compr_data_size mem_used_total ...
	read -r zorig zcompr zused _ < /sys/block/zram0/mm_stat
	zstat=$(printf '; zram held %s MiB as %s MiB (%s MiB in use)' "$(mib "$zorig")" "$(mib "$zcompr")" "$(mib "$zused")")
fi
hinted_held=$(( hinted_charged + zused )) # what the host holds for them: their charge, and the compressed tier's
# What the hint costs: an exec in each hinted sandbox (resumed first); then, all running again, one in each, alike.
lat() { # $1: file; times an exec in each sandbox, in ms
	: > "$1"
	for i in $(seq "$n"); do
		t0=${EPOCHREALTIME/./}; "$dsec" exec "i$i" -- true; t1=${EPOCHREALTIME/./}
		echo $(( t1 - t0 )) | awk '{ printf "%.2f\n", $1 / 1000 }' >> "$1"
	done
}
lat "$work/hinted"
lat "$work/plain"
hp50=$(pct 50 < "$work/hinted"); hp99=$(pct 99 < "$work/hinted")
pp50=$(pct 50 < "$work/plain"); pp99=$(pct 99 < "$work/plain")
printf 'base: %s (%s MB), %s, %d CPUs, %s MiB of memory, %s\n' "$rootfs" "$(du -sm "$rootfs" | cut -f1)" "$(uname -r)" "$(nproc)" \
	"$(awk '/^MemTotal:/ {printf "%d", $2 / 1024}' /proc/meminfo)" "$tier"
[ -z "$zstat" ] || echo "${zstat#; }"
printf '%-52s %12s %12s   %s\n' "figure ($n idle python3 sandboxes)" "hinted" "not hinted" "hinted/not"
printf '%-52s %12s %12s   %s\n' "memory charged to them (MiB)" "$(mib "$hinted_charged")" "$(mib "$plain_charged")" "$(ratio "$hinted_charged" "$plain_charged")"
printf '%-52s %12s %12s   %s\n' "... with the compressed tier's memory (MiB)" "$(mib "$hinted_held")" "$(mib "$plain_charged")" "$(ratio "$hinted_held" "$plain_charged")"
printf '%-52s %12s %12s   %s\n' "host memory in use over before (MiB)" "$(mib "$hinted_used")" "$(mib "$plain_used")" "$(ratio "$hinted_used" "$plain_used")"
printf '%-52s %12s %12s   %s\n' "exec latency p50 (ms)" "$hp50" "$pp50" "$(ratio "$hp50" "$pp50")"
printf '%-52s %12s %12s   %s\n' "exec latency p99 (ms)" "$hp99" "$pp99" "$(ratio "$hp99" "$pp99")"
id=idle-held${zram:+-zram}
bench_record --id "$id" --area "Density" --unit MiB \
	--title "memory the host holds for $n idle python3 sandboxes with an idle hint: their groups' charge and the compressed tier's ($tier$zstat)" \
	--value "$(mib "$hinted_held")" --baseline "$(mib "$plain_charged")" --baseline-what "their groups' charge, not hinted" \
	--ratio "$(ratio "$hinted_held" "$plain_charged")" --target "<= 0.6x"
bench_record --id "idle-host${zram:+-zram}" --area "Density" --unit MiB \
	--title "host memory in use (MemTotal - MemAvailable) for $n idle python3 sandboxes with an idle hint ($tier)" \
	--value "$(mib "$hinted_used")" --baseline "$(mib "$plain_used")" --baseline-what "the same, not hinted" \
	--ratio "$(ratio "$hinted_used" "$plain_used")"
bench_record --id "idle-resume${zram:+-zram}" --area "Density" --unit ms \
	--title "an exec in a hinted sandbox (resumed first), p50 (p99 $hp99 ms)" \
	--value "$hp50" --baseline "$pp50" --baseline-what "an exec in one not hinted, p50 (p99 $pp99 ms)" \
	--ratio "$(ratio "$hp50" "$pp50")"
