#!/usr/bin/env bash
# make bench: layer build figures, each next to its baseline in the same run.
#  1. dsec layer build DIR   vs  mkfs.erofs IMG DIR       (same tree)
#  2. dsec layer build T.GZ  vs  tar xzf T.GZ -C DIR      (same archive)
# The tree is a copy of /usr/local/go (override with BENCH_TREE). Page cache
# is warm for both sides (each runs once before timing); runs alternate.
# Before each run, untimed, the previous output is deleted and `sync` runs,
# so no run pays for another's writeback or for discarding its blocks.
# dsec's figure includes the sha256 digest, the window table, fsync and the
# store commit; mkfs.erofs and tar do none of that, so a third baseline is
# mkfs.erofs followed by an fsync of its image (coreutils sync FILE).
set -euo pipefail
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
clean() { rm -rf "$DSEC_ROOT" "$work/mkfs.img" "$work/x"; mkdir -p "$work/x"; sync; sleep 1; }
time_ms() { local t0; clean; t0=$(now); "$@" >/dev/null 2>&1 || { echo "bench: $* failed" >&2; exit 1; }; echo $(( ($(now) - t0) / 1000000 )); }
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

dsec_dir()  { "$dsec" layer build "$work/tree" --kind base -t bench:dir; }
mkfs_dir()  { mkfs.erofs --quiet "$work/mkfs.img" "$work/tree"; }
mkfs_sync() { mkfs_dir; sync "$work/mkfs.img"; }
dsec_tgz()  { "$dsec" layer build "$work/tree.tar.gz" --kind base -t bench:tgz; }
untar_tgz() { tar xzf "$work/tree.tar.gz" -C "$work/x"; }

for f in dsec_dir mkfs_dir mkfs_sync dsec_tgz untar_tgz; do time_ms $f >/dev/null; done # warm up
declare -A t
for i in $(seq "$runs"); do
	for f in dsec_dir mkfs_dir mkfs_sync dsec_tgz untar_tgz; do t[$f]+="$(time_ms $f) "; done
done
m() { echo ${t[$1]} | tr ' ' '\n' | median; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", a / b }'; }
dsec_dir >/dev/null 2>&1; mkfs_dir
size_dsec=$(stat -c %s "$DSEC_ROOT/store/blobs/sha256/$("$dsec" layer inspect bench:dir --json | sed -n 's/.*"digest": "sha256:\([0-9a-f]*\)".*/\1/p' | head -1)")
size_mkfs=$(stat -c %s "$work/mkfs.img")
tree_mb=$(du -sm "$work/tree" | cut -f1)
printf 'tree: %s (%s MB, %s files), %d runs, medians in ms\n' "$src" "$tree_mb" "$(find "$work/tree" | wc -l)" "$runs"
printf '%-34s %8s   %-28s %8s   %s\n' figure ms baseline ms "speed-up (baseline/dsec)"
printf '%-34s %8s   %-28s %8s   %s\n' "dsec layer build DIR" "$(m dsec_dir)" "mkfs.erofs" "$(m mkfs_dir)" "$(ratio "$(m mkfs_dir)" "$(m dsec_dir)")"
printf '%-34s %8s   %-28s %8s   %s\n' "dsec layer build DIR" "$(m dsec_dir)" "mkfs.erofs + fsync" "$(m mkfs_sync)" "$(ratio "$(m mkfs_sync)" "$(m dsec_dir)")"
printf '%-34s %8s   %-28s %8s   %s\n' "dsec layer build TREE.tar.gz" "$(m dsec_tgz)" "tar xzf" "$(m untar_tgz)" "$(ratio "$(m untar_tgz)" "$(m dsec_tgz)")"
printf 'image size: dsec %s bytes, mkfs.erofs %s bytes (dsec never inlines file tails: metadata stays data-free)\n' "$size_dsec" "$size_mkfs"
