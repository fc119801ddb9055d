#!/usr/bin/env bash
# make bench (as root): lazy-loading figures, each next to its baseline.
#  1. An agent step with no profile (python imports, git commit) on a >= 500 MB Debian base (debootstrap: python3,
#     git, gcc): what it fetches vs what the kernel itself reads through a loop device, and its time and a first
#     exec's vs the same layer built with 1 MiB windows.
#  2. Fraction of the base that another agent step fetches (start a shell, run python, git status in a new repo,
#     compile a file), on a layout in path order and on one ordered by the step's recorded profile.
#  3. Workspace provisioning, per sandbox: tar.gz fetched and extracted vs lazy mount, to "ready and first
#     command done", and bytes written to the local disk.
#  4. Burst: 64 distinct workspace layers mounted at once + first command, lazy vs pull-then-mount.
# The remote is a dir: store on this disk, slowed by DSEC_EMULATE_REMOTE (default: 2 ms per request, 200 MiB/s)
# to stand for a shared store across a network; tar's download gets the same latency and bandwidth (pv -L).
# Every run starts cold: host cache removed, page cache dropped.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
. "$(dirname "$0")/bench-lib.sh"
[ "$(id -u)" = 0 ] || { echo "bench-lazy: needs root (mount, drop_caches): skipped" >&2; exit 0; }
dsec=$(realpath "${1:-bin/dsec}")
runs=${BENCH_RUNS:-3}
work=${BENCH_DIR:-$PWD/.bench-lazy}
rootfs=${BENCH_ROOTFS:-/var/cache/dsec-bench/rootfs}
export DSEC_EMULATE_REMOTE=${DSEC_EMULATE_REMOTE:-latency=2ms,bandwidth=200MiB}
bw=$(sed -n 's/.*bandwidth=\([0-9]*\)MiB.*/\1/p' <<<"$DSEC_EMULATE_REMOTE")
lat=$(sed -n 's/.*latency=\([0-9]*\)ms.*/\1/p' <<<"$DSEC_EMULATE_REMOTE")
export DSEC_PROGRESS=never
# unmount everything below $work, deepest first; fetchers exit once unused
unmount_all() {
	awk -v w="$work/" 'index($5, w) == 1 {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do umount -l "$m" || true; done
}
loopdev= # kernel_step's, while it is attached
cleanup() { unmount_all; [ -z "$loopdev" ] || losetup -d "$loopdev"; sleep 6; rm -rf "$work"; }
trap cleanup EXIT
rm -rf "$work"; mkdir -p "$work"
dev=$(basename "$(df --output=source "$work" | tail -1)")
written() { sync; awk -v d="$dev" '$3==d {printf "%.0f\n", $10*512}' /proc/diskstats; }
now() { date +%s%N; }
cold() { sync; echo 3 >/proc/sys/vm/drop_caches; }
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
mb() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

if [ ! -x "$rootfs/usr/bin/python3" ]; then
	echo "bench-lazy: building the Debian base with debootstrap (once, into $rootfs)" >&2
	mkdir -p "$(dirname "$rootfs")"
	debootstrap --variant=minbase --include=python3,git,gcc,libc6-dev bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
fi
export DSEC_ROOT=$work/builder
shared=dir://$work/shared

# the Debian base, its files in path order
"$dsec" layer build "$rootfs" --kind base -t bench/debian:1 >/dev/null
"$dsec" layer push bench/debian:1 "$shared" >/dev/null 2>&1
total=$("$dsec" layer inspect bench/debian:1 --json | sed -n 's/^  "size": \([0-9]*\).*/\1/p')
base=$work/base; merged=$work/merged; upper=$work/rw
mkdir -p "$base" "$merged" "$upper"
stat_of() { DSEC_ROOT=$1 "$dsec" layer stats "$2" --json | sed -n "s/.*\"$3\": \([0-9]*\).*/\1/p"; }
# the agent step: start a shell, run python, git status in a new repo, compile a C file and run it
step1='python3 -c "import json, os, subprocess; print(len(os.listdir(\"/usr/lib\")))" >/dev/null
	mkdir -p /tmp/repo && cd /tmp/repo && git init -q && echo hi >f && git add f && git status --short >/dev/null
	printf "#include <stdio.h>\nint main(void){puts(\"hi\");return 0;}\n" >/tmp/h.c && gcc -O2 -o /tmp/h /tmp/h.c && /tmp/h >/dev/null'
# another step the profile was not recorded from: other modules, git commit and log, other headers and -O0
step2='python3 -c "import re, collections, email.parser, http.client; print(re.sub(\"a\", \"b\", \"abc\"))" >/dev/null
	mkdir -p /tmp/r2 && cd /tmp/r2 && git init -q && echo x >g && git add g && git -c user.name=a -c user.email=a@b commit -qm m && git log --oneline >/dev/null
	printf "#include <math.h>\n#include <string.h>\n#include <stdlib.h>\nint main(int c,char**v){return (int)sqrt(strlen(v[0]))+abs(c) > 1000;}\n" >/tmp/m.c && gcc -O0 -o /tmp/m /tmp/m.c -lm && /tmp/m'
# step HOST REF SCRIPT [--record]: one cold run of SCRIPT over a lazy mount of REF; sets meta, fetched,
# readb, and ms (the step's wall time)
step() {
	local host=$1 ref=$2 script=$3; shift 3
	cold
	DSEC_ROOT=$host "$dsec" layer mount "$ref" "$base" --from "$shared" "$@" >/dev/null
	mount -t tmpfs tmpfs "$upper"; mkdir "$upper/u" "$upper/w"
	mount -t overlay overlay -o "lowerdir=$base,upperdir=$upper/u,workdir=$upper/w" "$merged"
	mount --bind /dev "$merged/dev"
	mount -t proc proc "$merged/proc"
	meta=$(stat_of "$host" "$ref" bytes_fetched)
	local t0; t0=$(now)
	chroot "$merged" /bin/sh -c "$script"
	ms=$(( ($(now) - t0) / 1000000 ))
	sleep 1 # the hot region's background prefetch, if any, is part of what the step costs
	fetched=$(stat_of "$host" "$ref" bytes_fetched); readb=$(stat_of "$host" "$ref" bytes_read)
	for m in "$merged/proc" "$merged/dev" "$merged" "$upper"; do umount "$m"; done
	DSEC_ROOT=$host "$dsec" layer umount "$base"
}
pctof() { awk -v a="$1" -v b="$total" 'BEGIN{printf "%.2f", 100*a/b}'; }

# --- 1. an agent step with no profile (python3 importing json, subprocess, http.client, unittest and sqlite3, then
# git init, commit and log): what the fetcher moves vs what the kernel itself reads of the same image through a loop
# device with its own read-ahead, and its time cold against the same layer built with 1 MiB windows (what a read's
# window fetched whole was before); the first exec (python3 -c pass) the same. Fresh hosts, interleaved, median.
agent='python3 -c "import json, subprocess, http.client, unittest, sqlite3"
	mkdir -p /tmp/r3 && cd /tmp/r3 && git init -q && echo x >g && git add g && git -c user.name=a -c user.email=a@b commit -qm m && git log --oneline >/dev/null'
first='python3 -c pass'
"$dsec" layer build "$rootfs" --kind base -t bench/debian1m:1 --window-size 1MiB >/dev/null
"$dsec" layer push bench/debian1m:1 "$shared" >/dev/null 2>&1
img=$DSEC_ROOT/store/blobs/sha256/$("$dsec" layer inspect bench/debian:1 --json | sed -n 's/^  "digest": "sha256:\([0-9a-f]*\)".*/\1/p')
# kernel_step SCRIPT: one cold run over the image on a read-only loop device; sets kread (bytes the device read) and kra
kernel_step() {
	cold
	loopdev=$(losetup -f --show -r "$img")
	mount -t erofs -o ro "$loopdev" "$base"
	mount -t tmpfs tmpfs "$upper"; mkdir "$upper/u" "$upper/w"
	mount -t overlay overlay -o "lowerdir=$base,upperdir=$upper/u,workdir=$upper/w" "$merged"
	mount --bind /dev "$merged/dev"
	mount -t proc proc "$merged/proc"
	local st=/sys/block/${loopdev#/dev/}/stat r0
	r0=$(awk '{print $3}' "$st")
	chroot "$merged" /bin/sh -c "$1"
	kread=$(( ($(awk '{print $3}' "$st") - r0) * 512 )); kra=$(cat "/sys/block/${loopdev#/dev/}/queue/read_ahead_kb")
	for m in "$merged/proc" "$merged/dev" "$merged" "$upper" "$base"; do umount "$m"; done
	losetup -d "$loopdev"; loopdev=
}
kernel_step "$agent"
declare -a a64 a1m f64 f1m af64
for i in $(seq "$runs"); do
	step "$work/ha$i" bench/debian:1 "$agent"; a64+=("$ms"); af64+=("$fetched")
	step "$work/hb$i" bench/debian1m:1 "$agent"; a1m+=("$ms"); af1m=$fetched
	step "$work/hc$i" bench/debian:1 "$first"; f64+=("$ms")
	step "$work/hd$i" bench/debian1m:1 "$first"; f1m+=("$ms")
done
af=$(printf '%s\n' "${af64[@]}" | median)
printf '1. an agent step with no profile: fetched %s MiB = %s%% of the image with 64 KiB windows, %s%% with 1 MiB; the kernel read %s MiB = %s%% through a loop device (read-ahead %s KiB)\n' \
	"$(mb "$af")" "$(pctof "$af")" "$(pctof "$af1m")" "$(mb "$kread")" "$(pctof "$kread")" "$kra"
printf '   cold step %s ms (1 MiB windows: %s ms); first exec %s ms (1 MiB windows: %s ms)\n' "${a64[*]}" "${a1m[*]}" "${f64[*]}" "${f1m[*]}"
bench_record --id lazy-agent-fetched --area "Lazy loading" --unit % \
	--title "an agent step (python imports, git commit) on the Debian base, no profile: share of the image fetched" \
	--value "$(pctof "$af")" --baseline "$(pctof "$kread")" --baseline-what "the kernel's own read set (a loop device, read-ahead $kra KiB)" --target "<= 1.2x"
bench_record --id lazy-agent-time --area "Lazy loading" --unit ms \
	--title "the same step, cold, no profile: its time (median of $runs)" \
	--value "$(printf '%s\n' "${a64[@]}" | median)" --baseline "$(printf '%s\n' "${a1m[@]}" | median)" --baseline-what "the layer built with 1 MiB windows" --target "<= 1.0x"
bench_record --id lazy-first-exec --area "Lazy loading" --unit ms \
	--title "a first exec (python3 -c pass), cold, no profile (median of $runs)" \
	--value "$(printf '%s\n' "${f64[@]}" | median)" --baseline "$(printf '%s\n' "${f1m[@]}" | median)" --baseline-what "the layer built with 1 MiB windows" --target "<= 1.0x"
# --- 2. fraction fetched by an agent step, on the layout of a plain build (files in path order) and
# on one built with --order from the step's recorded access profile (the files it read first).
step "$work/host1" bench/debian:1 "$step1" --record
path_pct=$(pctof "$fetched")
printf '2. agent step on a %s MiB Debian base, path-order layout: fetched %s MiB = %s%% of the image (block 0 + metadata alone: %s MiB; the kernel read %s MiB = %s%%; step %s ms)\n' \
	"$(mb "$total")" "$(mb "$fetched")" "$(pctof "$fetched")" "$(mb "$meta")" "$(mb "$readb")" "$(pctof "$readb")" "$ms"
for i in $(seq 100); do [ -e "$work/host1/cache/"*/access ] && break; sleep 0.1; done # the fetcher saves the record as it exits
DSEC_ROOT=$work/host1 "$dsec" layer profile bench/debian:1 -o "$work/step.profile"
"$dsec" layer build "$rootfs" --kind base -t bench/debian:2 --order "$work/step.profile" >/dev/null
"$dsec" layer push bench/debian:2 "$shared" >/dev/null 2>&1
hot=$("$dsec" layer inspect bench/debian:2 --json | awk '/"hot"/ {h=1} h && /"size"/ {gsub(/[^0-9]/, ""); print; exit}')
step "$work/host1b" bench/debian:2 "$step1"
bench_record --id lazy-step-fetched --area "Lazy loading" --unit % \
	--title "an agent step (python, git, gcc) on the Debian base: share of the image fetched, the layer ordered by the step's recorded profile" \
	--value "$(pctof "$fetched")" --baseline "$path_pct" --baseline-what "path-order layout" --target "<= 5%"
printf '   ordered by the step'"'"'s profile (%s files, hot region %s MiB): fetched %s MiB = %s%% (the kernel read %s MiB = %s%%; step %s ms)\n' \
	"$(wc -l <"$work/step.profile")" "$(mb "$hot")" "$(mb "$fetched")" "$(pctof "$fetched")" "$(mb "$readb")" "$(pctof "$readb")" "$ms"
step "$work/host1c" bench/debian:1 "$step2"; f2=$fetched; m2=$ms
step "$work/host1d" bench/debian:2 "$step2"
printf '   another step (other modules, git commit, math.h, -O0), not the profiled one: path order %s MiB = %s%% (%s ms), ordered %s MiB = %s%% (%s ms)\n' \
	"$(mb "$f2")" "$(pctof "$f2")" "$m2" "$(mb "$fetched")" "$(pctof "$fetched")" "$ms"
bench_record --id lazy-step-other --area "Lazy loading" --unit % \
	--title "another step (other modules, git commit, math.h, -O0): share fetched, the layer ordered by the first step's profile" \
	--value "$(pctof "$fetched")" --baseline "$(pctof "$f2")" --baseline-what "path-order layout" --target "<= 5%"
printf '   (cache.read_ahead_kb=%s, the same for the recorded run and the replays)\n' "${DSEC_CACHE_READ_AHEAD_KB:-16}"

# --- 3. workspace provisioning
ws=$work/ws-src; mkdir -p "$ws"
cp -a /usr/local/go "$ws/go"; cp -a /usr/local/go/src "$ws/src2"
tar czf "$work/ws.tar.gz" -C "$ws" .
"$dsec" layer build "$ws" --kind workspace -t bench/ws:1 >/dev/null
"$dsec" layer push bench/ws:1 "$shared" >/dev/null 2>&1
wsize=$(du -sm "$ws" | cut -f1)
declare -a tt tw dt dw
for i in $(seq "$runs"); do
	d=$work/x$i; mkdir -p "$d"; cold; w0=$(written); t0=$(now)
	{ sleep "0.00$lat"; pv -q -L "${bw}m" "$work/ws.tar.gz"; } | tar xzf - -C "$d"; cat "$d/go/VERSION" >/dev/null
	tt+=($(( ($(now) - t0) / 1000000 ))); tw+=($(( $(written) - w0 ))); rm -rf "$d"
	d=$work/m$i; mkdir -p "$d"; cold; w0=$(written); t0=$(now)
	DSEC_ROOT=$work/host2-$i "$dsec" layer mount bench/ws:1 "$d" --from "$shared" >/dev/null; cat "$d/go/VERSION" >/dev/null
	dt+=($(( ($(now) - t0) / 1000000 ))); dw+=($(( $(written) - w0 )))
	DSEC_ROOT=$work/host2-$i "$dsec" layer umount "$d"
done
m() { printf '%s\n' "$@" | median; }
faster=$(awk -v a="$(m "${tt[@]}")" -v b="$(m "${dt[@]}")" 'BEGIN{printf "%.1f", a/b}')
fewer=$(awk -v a="$(m "${tw[@]}")" -v b="$(m "${dw[@]}")" 'BEGIN{printf "%.0f", (b>0 ? a/b : 0)}')
printf '3. workspace of %s MB (tar.gz %s MB), per sandbox, to ready + first command:\n' "$wsize" "$(du -m "$work/ws.tar.gz" | cut -f1)"
printf '   tar xzf: %s ms, %s MiB written | dsec lazy mount: %s ms, %s MiB written | %sx faster, 1/%s of the writes\n' \
	"$(m "${tt[@]}")" "$(mb "$(m "${tw[@]}")")" "$(m "${dt[@]}")" "$(mb "$(m "${dw[@]}")")" "$faster" "$fewer"
bench_record --id lazy-workspace-time --area "Lazy loading" --unit ms \
	--title "a $wsize MB workspace to ready + first command, per sandbox (median of $runs)" \
	--value "$(m "${dt[@]}")" --baseline "$(m "${tt[@]}")" --baseline-what "fetch + tar xzf" \
	--ratio-of baseline/dsec --ratio "$faster" --target ">= 10x" --target-text ">= 10x faster"
bench_record --id lazy-workspace-writes --area "Lazy loading" --unit MiB \
	--title "the same: bytes written to the local disk" \
	--value "$(mb "$(m "${dw[@]}")")" --baseline "$(mb "$(m "${tw[@]}")")" --baseline-what "fetch + tar xzf" \
	--ratio-of baseline/dsec --ratio "$fewer" --target ">= 20x" --target-text "<= 1/20 of the writes"

# --- 4. burst of 64 distinct layers
n=${BENCH_BURST:-64}
src=$work/burst-src; cp -a /usr/local/go/src/cmd "$src"
for i in $(seq "$n"); do
	echo "layer $i" >"$src/unique"
	"$dsec" layer build "$src" --kind workspace -t bench/burst$i:1 >/dev/null
	"$dsec" layer push bench/burst$i:1 "$shared" >/dev/null 2>&1
done
burst() { # $1: lazy or full
	local root=$work/burst-$1 t0 w0
	rm -rf "$root"; cold; w0=$(written); t0=$(now)
	for i in $(seq "$n"); do
		mkdir -p "$root/m$i"
		if [ "$1" = lazy ]; then
			(DSEC_ROOT=$root "$dsec" layer mount bench/burst$i:1 "$root/m$i" --from "$shared" >/dev/null && cat "$root/m$i/unique" >/dev/null) &
		else
			(DSEC_ROOT=$root "$dsec" layer pull bench/burst$i:1 "$shared" >/dev/null 2>&1 && DSEC_ROOT=$root "$dsec" layer mount bench/burst$i:1 "$root/m$i" >/dev/null && cat "$root/m$i/unique" >/dev/null) &
		fi
	done
	local failed=0
	for job in $(jobs -p); do wait "$job" || failed=$((failed + 1)); done
	bt=$(( ($(now) - t0) / 1000000 )); bw_=$(( $(written) - w0 ))
	[ "$failed" = 0 ] || { echo "bench-lazy: $failed of $n $1 mounts failed" >&2; exit 1; }
	for i in $(seq "$n"); do DSEC_ROOT=$root "$dsec" layer umount "$root/m$i"; done
}
burst lazy; lt=$bt; lw=$bw_
burst full; ft=$bt; fw=$bw_
lsize=$(mb "$(stat -c %s "$work/builder/store/blobs/sha256/$("$dsec" layer inspect bench/burst1:1 --json | sed -n 's/.*"digest": "sha256:\([0-9a-f]*\)".*/\1/p' | head -1)")")
faster=$(awk -v a="$ft" -v b="$lt" 'BEGIN{printf "%.1f", a/b}')
fewer=$(awk -v a="$fw" -v b="$lw" 'BEGIN{printf "%.0f", (b>0 ? a/b : 0)}')
printf '4. burst of %s cold mounts + first command (%s MiB layers): lazy %s ms, %s MiB written | pull then mount %s ms, %s MiB written | %sx faster, 1/%s of the writes\n' \
	"$n" "$lsize" "$lt" "$(mb "$lw")" "$ft" "$(mb "$fw")" "$faster" "$fewer"
bench_record --id lazy-burst-time --area "Lazy loading" --unit ms \
	--title "$n distinct $lsize MiB workspace layers mounted at once + first command" \
	--value "$lt" --baseline "$ft" --baseline-what "\`dsec layer pull\` + local mount" \
	--ratio-of baseline/dsec --ratio "$faster" --target ">= 3x" --target-text ">= 3x faster"
bench_record --id lazy-burst-writes --area "Lazy loading" --unit MiB \
	--title "the same: bytes written to the local disk" \
	--value "$(mb "$lw")" --baseline "$(mb "$fw")" --baseline-what "\`dsec layer pull\` + local mount" \
	--ratio-of baseline/dsec --ratio "$fewer" --target ">= 5x" --target-text "<= 1/5 of the writes"
printf 'remote: dir: store on the same disk, emulated with DSEC_EMULATE_REMOTE=%s\n' "$DSEC_EMULATE_REMOTE"
