#!/usr/bin/env bash
# make bench (as root): sandbox figures, dsec next to runc (Debian's) on the same rootfs in the same run.
#  1. create-to-first-exec: `dsec run --rm --base L -- true` (the worker already running, as containerd
#     would be) vs `runc run` of /bin/true on the same tree: p50 and p99 over BENCH_N runs 50 ms apart
#     (a rollout's steps wait for the model between them; dsec removes a sandbox, and makes the next,
#     after its answer), then the same back to back, whose loop gives the serial rate (runs per second).
#  2. exec latency into a running sandbox: `dsec exec NAME -- true` vs `runc exec ID true`.
# Those figures are whole CLI invocations, timed from the shell the same way for both. Then the same
# through the Go SDK against the same worker and layer (go test -bench ./sdk): what a trainer pays,
# without a CLI process per step; and the SDK's create figures again through a worker that does not keep
# layers mounted between sandboxes (the last two rows compare those two, not runc).
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
. "$(dirname "$0")/bench-lib.sh"
[ "$(id -u)" = 0 ] || { echo "bench-run: needs root (namespaces, mounts): skipped" >&2; exit 0; }
dsec=$(realpath "${1:-bin/dsec}")
n=${BENCH_N:-100}
work=${BENCH_DIR:-$PWD/.bench-run}
rootfs=${BENCH_ROOTFS:-/var/cache/dsec-bench/rootfs}
export DSEC_ROOT=$work/root DSEC_PROGRESS=never
cleanup() {
	"$dsec" rm -f bench-exec >/dev/null 2>&1 || true
	"$dsec" daemon stop >/dev/null 2>&1 || true
	runc kill bench-exec KILL >/dev/null 2>&1 || true
	sleep 0.2
	runc delete -f bench-exec >/dev/null 2>&1 || true
	rm -rf "$work"
}
trap cleanup EXIT
rm -rf "$work"; mkdir -p "$work/bundle"
# Times in ns from bash's own clock: no process is started inside a timed span (a `date` per
# reading added ~1-2 ms to every figure, dsec's and runc's alike, which pulled the ratio toward 1).
now() { local t=${EPOCHREALTIME/./}; NOW=$((t * 1000)); }
pct() { sort -n | awk -v p="$1" '{a[NR]=$1} END {i=int(NR*p/100+0.999); if (i<1) i=1; printf "%.1f", a[i]/1e6}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", a / b }'; }

if [ ! -x "$rootfs/usr/bin/python3" ]; then
	echo "bench-run: building the Debian base with debootstrap (once, into $rootfs)" >&2
	mkdir -p "$(dirname "$rootfs")"
	debootstrap --variant=minbase --include=python3,git,gcc,libc6-dev bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
fi
"$dsec" layer build "$rootfs" --kind base -t bench:1 >/dev/null

# runc's bundle: the same tree, read-only, running /bin/true without a terminal.
(cd "$work/bundle" && runc spec)
sed -i -e 's/"terminal": true/"terminal": false/' -e 's/"sh"/"true"/' -e "s|\"path\": \"rootfs\"|\"path\": \"$rootfs\"|" "$work/bundle/config.json"

# loop NAME CMD...: runs CMD n times ($GAP seconds apart, untimed, if set), one duration (ns) per line
# in $work/NAME; the loop's total in $work/NAME.total (with the gaps: a rate only without them)
loop() {
	local name=$1; shift
	: >"$work/$name"
	local t0 start; now; start=$NOW
	for i in $(seq "$n"); do
		now; t0=$NOW
		"$@" "$i" >/dev/null 2>&1 || { echo "bench-run: $* failed" >&2; exit 1; }
		now; echo $((NOW - t0)) >>"$work/$name"
		[ -z "${GAP:-}" ] || sleep "$GAP"
	done
	now; echo $((NOW - start)) >"$work/$name.total"
}
dsec_run()  { "$dsec" run --rm --name "b$1" --base bench:1 -- true; }
runc_run()  { runc run --bundle "$work/bundle" "b$1"; }
dsec_exec() { "$dsec" exec bench-exec -- true; }
runc_exec() { runc exec bench-exec true; }

"$dsec" run --rm --base bench:1 -- true 2>/dev/null # starts the worker, warms the caches
runc_run warm >/dev/null
for round in 1 2; do # interleaved rounds: the second is the one reported
	GAP=0.05 loop dsec_run.$round dsec_run
	GAP=0.05 loop runc_run.$round runc_run
done
loop dsec_run.b2b dsec_run
loop runc_run.b2b runc_run
"$dsec" run -d --name bench-exec --base bench:1 >/dev/null
sed -i 's/"true"/"sleep", "3600"/' "$work/bundle/config.json"
runc run -d --bundle "$work/bundle" bench-exec >/dev/null 2>&1 </dev/null
loop dsec_exec dsec_exec
loop runc_exec runc_exec
sdkbench=$(DSEC_BENCH_ROOT=$DSEC_ROOT DSEC_BENCH_LAYER=bench:1 go test -run '^$' -bench 'BenchmarkCreateExecRemove|BenchmarkExec$' -benchtime "${n}x" ./sdk/)
# The same through a worker that unmounts a layer as soon as its last sandbox goes (cache.keep_mounted 0):
# what keeping it mounted for the next sandbox saves.
"$dsec" daemon stop >/dev/null
DSEC_CACHE_KEEP_MOUNTED=0s "$dsec" run --rm --base bench:1 -- true 2>/dev/null
unkept=$(DSEC_BENCH_ROOT=$DSEC_ROOT DSEC_BENCH_LAYER=bench:1 go test -run '^$' -bench 'BenchmarkCreateExecRemove' -benchtime "${n}x" ./sdk/)
metric() { awk -v m="$1" '{for (i = 2; i <= NF; i++) if ($i == m) print $(i-1)}' <<<"${2:-$sdkbench}"; }

row() { # figure, dsec file, runc file
	local d50 d99 r50 r99
	d50=$(pct 50 <"$work/$2"); d99=$(pct 99 <"$work/$2"); r50=$(pct 50 <"$work/$3"); r99=$(pct 99 <"$work/$3")
	printf '%-34s %8s %8s   %8s %8s   %s\n' "$1" "$d50" "$d99" "$r50" "$r99" "$(ratio "$d50" "$r50")"
}
rate() { awk -v n="$n" -v t="$(cat "$1")" 'BEGIN { printf "%.1f", n / (t / 1e9) }'; }
printf 'rootfs: %s (%s MB), %d runs each, %s, %d CPUs\n' "$rootfs" "$(du -sm "$rootfs" | cut -f1)" "$n" "$(uname -r)" "$(nproc)"
printf '%-34s %8s %8s   %8s %8s   %s\n' "figure (ms)" "dsec p50" "p99" "runc p50" "p99" "dsec/runc p50"
row "run --rm true (create to exit)" dsec_run.2 runc_run.2
row "run --rm true, back to back" dsec_run.b2b runc_run.b2b
row "exec true into a running sandbox" dsec_exec runc_exec
sdkrow() { # figure, dsec metric prefix, runc file
	local r50 r99; r50=$(pct 50 <"$work/$3"); r99=$(pct 99 <"$work/$3")
	printf '%-34s %8s %8s   %8s %8s   %s\n' "$1" "$(metric "$2-p50-ms")" "$(metric "$2-p99-ms")" "$r50" "$r99" "$(ratio "$(metric "$2-p50-ms")" "$r50")"
}
sdkrow "SDK: create to first exec done" first-exec runc_run.2
sdkrow "SDK: create, exec, remove" with-rm runc_run.2
sdkrow "SDK: exec true" exec runc_exec
for m in first-exec with-rm; do
	printf '%-34s %8s %8s   %8s %8s   %s\n' "SDK $m: layer kept vs not" "$(metric "$m-p50-ms")" "$(metric "$m-p99-ms")" \
		"$(metric "$m-p50-ms" "$unkept")" "$(metric "$m-p99-ms" "$unkept")" "$(ratio "$(metric "$m-p50-ms")" "$(metric "$m-p50-ms" "$unkept")")"
done
printf 'serial rate, run --rm true: dsec %s/s, runc %s/s\n' "$(rate "$work/dsec_run.b2b.total")" "$(rate "$work/runc_run.b2b.total")"

p50() { pct 50 <"$work/$1"; }
runc_what="runc \`run\` of the same tree"
bench_record --id sandbox-run-rm --area Sandboxes --unit ms \
	--title "\`run --rm true\` through the CLI, create to exit, runs 50 ms apart, p50" \
	--value "$(p50 dsec_run.2)" --baseline "$(p50 runc_run.2)" --baseline-what "$runc_what" \
	--ratio "$(ratio "$(p50 dsec_run.2)" "$(p50 runc_run.2)")" --target "<= 0.25x" --target-text "<= 0.25x of runc's"
bench_record --id sandbox-run-rm-b2b --area Sandboxes --unit ms \
	--title "\`run --rm true\` through the CLI, back to back, p50" \
	--value "$(p50 dsec_run.b2b)" --baseline "$(p50 runc_run.b2b)" --baseline-what "$runc_what" \
	--ratio "$(ratio "$(p50 dsec_run.b2b)" "$(p50 runc_run.b2b)")"
bench_record --id sandbox-sdk-first-exec --area Sandboxes --unit ms \
	--title "SDK: create to first exec done, p50" \
	--value "$(metric first-exec-p50-ms)" --baseline "$(p50 runc_run.2)" --baseline-what "$runc_what" \
	--ratio "$(ratio "$(metric first-exec-p50-ms)" "$(p50 runc_run.2)")" --target "<= 0.25x" --target-text "<= 0.25x of runc's"
bench_record --id sandbox-exec-cli --area Sandboxes --unit ms \
	--title "\`exec true\` into a running sandbox through the CLI, p50" \
	--value "$(p50 dsec_exec)" --baseline "$(p50 runc_exec)" --baseline-what "runc \`exec\`" \
	--ratio "$(ratio "$(p50 dsec_exec)" "$(p50 runc_exec)")"
bench_record --id sandbox-exec-sdk --area Sandboxes --unit ms \
	--title "SDK: \`exec true\` into a running sandbox, p50" \
	--value "$(metric exec-p50-ms)" --baseline "$(p50 runc_exec)" --baseline-what "runc \`exec\`" \
	--ratio "$(ratio "$(metric exec-p50-ms)" "$(p50 runc_exec)")"
bench_record --id sandbox-serial-rate --area Sandboxes --unit /s \
	--title "serial \`run --rm true\` rate (back to back)" \
	--value "$(rate "$work/dsec_run.b2b.total")" --baseline "$(rate "$work/runc_run.b2b.total")" --baseline-what "runc \`run\`"
