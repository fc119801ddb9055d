#!/usr/bin/env bash
# scripts/trace-interference.sh [ROUNDS] (as root): why an exec under batch load is slow at its tail.
# Runs BenchmarkInterference (ROUNDS rounds, default 40) under the kernel's scheduler tracing, with
# each exec marked, then counts, within the execs run against batch load, the times a task of the
# exec path (client, worker, init, command) was runnable but waited over 1 ms while a batch task (the
# load's busybox sh loops, SCHED_IDLE in an idle group) held its CPU. For each such wait it also gives
# where in the scheduler's tick (4 ms at HZ=250) the wait ended: waits that end where the CPU's tick
# falls were not ended by a wake-up or a preemption but by the tick, the kernel's next chance to pick.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "trace-interference: needs root (tracefs, cgroups)" >&2; exit 1; }
T=/sys/kernel/tracing
[ -w $T/trace_marker ] || { echo "trace-interference: no tracefs at $T: mount -t tracefs tracefs $T" >&2; exit 1; }
[ -x "${DSEC_INIT:-bin/dsec-init}" ] || { echo "trace-interference: no ${DSEC_INIT:-bin/dsec-init}: run make build first" >&2; exit 1; }
out=$(mktemp -d)
# The tracing state is the host's: put back what was there.
size=$(cat $T/buffer_size_kb) on=$(cat $T/tracing_on) events=$(cat $T/set_event)
cleanup() {
	echo 0 > $T/tracing_on; echo > $T/set_event; echo > $T/trace; echo "$size" > $T/buffer_size_kb
	[ -z "$events" ] || echo "$events" > $T/set_event
	echo "$on" > $T/tracing_on; rm -rf "$out"
}
trap cleanup EXIT
echo 0 > $T/tracing_on; echo > $T/trace; echo 65536 > $T/buffer_size_kb
echo 'sched:sched_switch sched:sched_wakeup sched:sched_wakeup_new' | tr ' ' '\n' > $T/set_event
echo 1 > $T/tracing_on
DSEC_INIT=$(realpath "${DSEC_INIT:-bin/dsec-init}") DSEC_BENCH_TRACE=1 \
	go test -run '^$' -bench BenchmarkInterference -benchtime "${1:-40}x" ./sdk/ | grep '^Benchmark'
echo 0 > $T/tracing_on
cat $T/trace > "$out/trace"
awk '
function field(name,   i) { for (i = 1; i <= NF; i++) if (index($i, name "=") == 1) return substr($i, length(name) + 2); return "" }
{
	if (!match($0, /\[[0-9]+\]/)) next
	cpu = substr($0, RSTART + 1, RLENGTH - 2) + 0
	for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+\.[0-9]+:$/) { ts = substr($i, 1, length($i) - 1) + 0; break }
}
/tracing_mark_write: dsecx / { for (i = 1; i <= NF; i++) if ($i == "dsecx") { inexec = ($(i + 2) == "b"); phase = $(i + 1) } next }
# A wake-up of a task already on a CPU is no wait: only those of tasks off every CPU count.
/ sched_wakeup(_new)?: / { p = field("pid"); if (!(p in ready) && !(p in running)) ready[p] = ts; next }
/ sched_switch: / {
	pp = field("prev_pid"); np = field("next_pid"); pc = field("prev_comm")
	delete running[pp]; delete ready[pp]
	if (field("prev_state") ~ /^R/ && pp != 0) ready[pp] = ts
	if (np != 0) running[np] = 1
	if (np in ready) {
		w = ts - ready[np]; delete ready[np]
		if (inexec && phase == "batch-load" && pc == "sh" && w > 0.001) {
			n++; sum += w; end[n] = ts; endcpu[n] = cpu
			bin[cpu, int((ts * 1e6) % 4000 / 250)]++
		}
	}
}
END {
	if (!n) { print "no wait over 1 ms behind the batch load"; exit }
	for (c = 0; c < 64; c++) { best = -1; for (b = 0; b < 16; b++) if ((c, b) in bin && bin[c, b] > best) { best = bin[c, b]; mode[c] = b } }
	for (i = 1; i <= n; i++) { b = int((end[i] * 1e6) % 4000 / 250); d = (b - mode[endcpu[i]] + 16) % 16; if (d <= 1 || d == 15) attick++ }
	printf "waits over 1 ms behind the batch load, in execs under it: %d, %.2f ms on average\n", n, 1000 * sum / n
	printf "  ended where the CPU'"'"'s tick falls (within 250 us of its 4 ms phase): %d (%.0f%%; by chance: 19%%)\n", attick, 100 * attick / n
}' "$out/trace"
