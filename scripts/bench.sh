#!/usr/bin/env bash
# make bench: layer build figures, each next to its baseline in the same run.
#  1. dsec layer build DIR   vs  mkfs.erofs IMG DIR (and with an fsync of IMG)
#  2. dsec layer build T.GZ  vs  tar xzf T.GZ -C DIR
# The tree is a copy of /usr/local/go (override with BENCH_TREE). Each figure
# is measured twice: warm (source in the page cache) and, as root, cold (all
# caches dropped before each run). Runs alternate; before each, untimed, the
# previous output is deleted and `sync` runs, so no run pays for another's
# writeback or block discards. dsec's figure includes the sha256 digest, the
# window table, fsync and the store commit; mkfs.erofs and tar do none of it.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
. "$(dirname "$0")/bench-lib.sh"
dsec=$(realpath "${1:-bin/dsec}")
runs=${BENCH_RUNS:-5}
src=${BENCH_TREE:-/usr/local/go}
work=${BENCH_DIR:-$PWD/.bench}
rm -rf "$work"; mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
cp -a "$src" "$work/tree"
tar czf "$work/tree.tar.gz" -C "$work" tree
export DSEC_ROOT="$work/root" DSEC_PROGRESS=never

now() { date +%s%N; }
cold=0
clean() {
	rm -rf "$DSEC_ROOT" "$work/mkfs.img" "$work/x"; mkdir -p "$work/x"; sync
	if [ "$cold" = 1 ]; then echo 3 >/proc/sys/vm/drop_caches; fi
	sleep 1
}
time_ms() { local t0; clean; t0=$(now); "$@" >/dev/null 2>&1 || { echo "bench: $* failed" >&2; exit 1; }; echo $(( ($(now) - t0) / 1000000 )); }
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", a / b }'; }

dsec_dir()  { "$dsec" layer build "$work/tree" --kind base -t bench:dir; }
mkfs_dir()  { mkfs.erofs --quiet "$work/mkfs.img" "$work/tree"; }
mkfs_sync() { mkfs_dir; sync "$work/mkfs.img"; }
dsec_tgz()  { "$dsec" layer build "$work/tree.tar.gz" --kind base -t bench:tgz; }
untar_tgz() { tar xzf "$work/tree.tar.gz" -C "$work/x"; }
all="dsec_dir mkfs_dir mkfs_sync dsec_tgz untar_tgz"

declare -A t
measure() { # $1: warm or cold
	for f in $all; do t[$1.$f]=""; done
	for i in $(seq "$runs"); do
		for f in $all; do t[$1.$f]+="$(time_ms $f) "; done
	done
}
m() { echo ${t[$1]} | tr ' ' '\n' | median; }
row() { printf '%-6s %-30s %7s   %-28s %7s   %s\n' "$1" "$2" "$(m $1.$3)" "$4" "$(m $1.$5)" "$(ratio "$(m $1.$5)" "$(m $1.$3)")"; }

for f in $all; do time_ms $f >/dev/null; done # warm up
measure warm
modes=warm
if [ "$(id -u)" = 0 ]; then cold=1; measure cold; cold=0; modes="warm cold"; else
	echo "bench: not root: cold-cache figures skipped (they drop the page cache)" >&2; fi

dsec_dir >/dev/null 2>&1; mkfs_dir
size_dsec=$(stat -c %s "$DSEC_ROOT/store/blobs/sha256/$("$dsec" layer inspect bench:dir --json | sed -n 's/.*"digest": "sha256:\([0-9a-f]*\)".*/\1/p' | head -1)")
size_mkfs=$(stat -c %s "$work/mkfs.img")
printf 'tree: %s (%s MB, %s files), %d runs, medians in ms\n' "$src" "$(du -sm "$work/tree" | cut -f1)" "$(find "$work/tree" | wc -l)" "$runs"
printf '%-6s %-30s %7s   %-28s %7s   %s\n' cache figure ms baseline ms "speed-up (baseline/dsec)"
for mode in $modes; do
	row $mode "dsec layer build DIR" dsec_dir "mkfs.erofs" mkfs_dir
	row $mode "dsec layer build DIR" dsec_dir "mkfs.erofs + fsync" mkfs_sync
	row $mode "dsec layer build TREE.tar.gz" dsec_tgz "tar xzf" untar_tgz
done
printf 'image size: dsec %s bytes, mkfs.erofs %s bytes (dsec never inlines file tails: metadata stays data-free)\n' "$size_dsec" "$size_mkfs"
for mode in $modes; do
	bench_record --id "layer-build-dir-$mode" --area "Layer build" --unit ms \
		--title "\`dsec layer build DIR\` vs \`mkfs.erofs IMG DIR\`, $mode cache, median of $runs" \
		--value "$(m "$mode".dsec_dir)" --baseline "$(m "$mode".mkfs_dir)" --baseline-what mkfs.erofs \
		--ratio-of baseline/dsec --ratio "$(ratio "$(m "$mode".mkfs_dir)" "$(m "$mode".dsec_dir)")" \
		--target ">= 1.5x" --target-text ">= 1.5x faster than mkfs.erofs"
	bench_record --id "layer-build-tgz-$mode" --area "Layer build" --unit ms \
		--title "\`dsec layer build TREE.tar.gz\` vs \`tar xzf\`, $mode cache, median of $runs" \
		--value "$(m "$mode".dsec_tgz)" --baseline "$(m "$mode".untar_tgz)" --baseline-what "tar xzf" \
		--ratio-of baseline/dsec --ratio "$(ratio "$(m "$mode".untar_tgz)" "$(m "$mode".dsec_tgz)")"
done
