#!/usr/bin/env bash
# make bench (as root): density (issue 7), on busybox layers through the SDK and a test worker.
#  1. FnCall: a call on a warm pool (true in a fresh sandbox, discarded after) vs exec of true in a
#     running sandbox, alternating; each call after the pool refilled (untimed).
#  2. Interference: exec latency into a latency-class sandbox alone, then with two sandboxes spinning
#     under a 0.5 CPU limit each (half of the 2-CPU host) in class batch, then the same load in class
#     latency (no class distinction: the mapping off), and alone a second time: how far the two alone
#     figures differ is what the run can resolve. Rounds of 10 execs per condition take turns (n rounds).
#  3. Spare inits: the start of one with the host bare, with 2000 more host mounts, and bare again.
#  4. Density: idle stateful sandboxes (a resident sleep, 2 MiB written) at 1 CPU requested each under
#     a 500x CPU overcommit, up to BENCH_DENSITY_N (default 1000) or the 2 GiB memory reserve.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
. "$(dirname "$0")/bench-lib.sh"
[ "$(id -u)" = 0 ] || { echo "bench-density: needs root (cgroups, namespaces): skipped" >&2; exit 0; }
n=${BENCH_N:-100}
# The test worker starts sandboxes' inits from dsec-init, as make build's dsecd does (the test binary
# itself otherwise: a start three times as long and ~2 MiB more per sandbox).
DSEC_INIT=$(realpath "${DSEC_INIT:-bin/dsec-init}")
[ -x "$DSEC_INIT" ] || { echo "bench-density: no $DSEC_INIT: run make build first" >&2; exit 1; }
export DSEC_INIT
metric() { awk -v m="$2" '{for (i = 2; i <= NF; i++) if ($i == m) print $(i-1)}' <<<"$1"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3fx", a / b }'; }

fn=$(go test -run '^$' -bench BenchmarkFnCall -benchtime "${n}x" ./sdk/)
intf=$(go test -run '^$' -bench BenchmarkInterference -benchtime "${n}x" ./sdk/)
spare=$(go test -run '^$' -bench BenchmarkPrestart -benchtime "${n}x" ./internal/runtime/container/)
dens=$(DSEC_DENSITY_N=${BENCH_DENSITY_N:-1000} go test -run '^$' -bench BenchmarkDensity -benchtime 1x -timeout 30m ./sdk/)

echo "== density (2-core VM, inits from $DSEC_INIT, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo); $(date -u +%F))"
printf '%-58s %10s %10s %8s\n' figure dsec baseline ratio
for p in p50 p99; do
	printf '%-58s %8s ms %8s ms %8s\n' "FnCall warm call vs exec in a running sandbox, $p" "$(metric "$fn" call-$p-ms)" "$(metric "$fn" exec-$p-ms)" \
		"$(ratio "$(metric "$fn" call-$p-ms)" "$(metric "$fn" exec-$p-ms)")"
done
for p in p50 mean p99; do
	printf '%-58s %8s ms %8s ms %8s\n' "exec, 50% CPU of batch load vs alone, $p" "$(metric "$intf" batch-load-$p-ms)" "$(metric "$intf" alone-$p-ms)" \
		"$(ratio "$(metric "$intf" batch-load-$p-ms)" "$(metric "$intf" alone-$p-ms)")"
	printf '%-58s %8s ms %8s ms %8s\n' "  exec alone, a second time vs the first (the resolution), $p" "$(metric "$intf" alone-again-$p-ms)" "$(metric "$intf" alone-$p-ms)" \
		"$(ratio "$(metric "$intf" alone-again-$p-ms)" "$(metric "$intf" alone-$p-ms)")"
	printf '%-58s %8s ms %8s ms %8s\n' "exec, the same load without classes vs alone, $p" "$(metric "$intf" unmapped-load-$p-ms)" "$(metric "$intf" alone-$p-ms)" \
		"$(ratio "$(metric "$intf" unmapped-load-$p-ms)" "$(metric "$intf" alone-$p-ms)")"
done
printf '%-58s %8s %%\n' "  CPU time stolen by the hypervisor during those rounds" "$(metric "$intf" steal-%)"
printf '%-58s %8s ms %8s ms %8s\n' "spare init start p50, 2000 host mounts vs none" "$(metric "$spare" mounts2000-p50-ms)" "$(metric "$spare" bare-p50-ms)" \
	"$(ratio "$(metric "$spare" mounts2000-p50-ms)" "$(metric "$spare" bare-p50-ms)")"
printf '%-58s %8s ms %8s ms %8s\n' "  none, a second time vs the first (the resolution)" "$(metric "$spare" bare-again-p50-ms)" "$(metric "$spare" bare-p50-ms)" \
	"$(ratio "$(metric "$spare" bare-again-p50-ms)" "$(metric "$spare" bare-p50-ms)")"
printf '%-58s %10s %10s %8s\n' "idle sandboxes started (target)" "$(metric "$dens" sandboxes)" "1000" "$(ratio "$(metric "$dens" sandboxes)" 1000)"
printf '%-58s %10s %10s %8s\n' "CPU overcommit at 1 CPU requested each (target)" "$(metric "$dens" cpu-overcommit)x" "500x" "$(ratio "$(metric "$dens" cpu-overcommit)" 500)"
printf '%-58s %7s MiB %6s MiB %8s\n' "host memory per sandbox beyond its processes (target)" "$(metric "$dens" overhead-MiB/sandbox)" "5" "$(ratio "$(metric "$dens" overhead-MiB/sandbox)" 5)"
printf '%-58s %7s MiB\n' "  host memory per sandbox, all" "$(metric "$dens" host-MiB/sandbox)"
printf '%-58s %7s MiB\n' "  its own processes' PSS (the sleep)" "$(metric "$dens" own-pss-MiB/sandbox)"
printf '%-58s %7s MiB\n' "  the init's PSS" "$(metric "$dens" init-pss-MiB/sandbox)"
printf '%-58s %7s MiB\n' "  charged to its memory cgroup" "$(metric "$dens" charged-MiB/sandbox)"
printf '%-58s %7s ms\n' "  start (create + first exec), serial" "$(metric "$dens" start-ms/sandbox)"

bench_record --id density-fncall --area Density --unit ms \
	--title "FnCall: a warm call vs an exec in a running sandbox, p50" \
	--value "$(metric "$fn" call-p50-ms)" --baseline "$(metric "$fn" exec-p50-ms)" --baseline-what "exec in a running sandbox" \
	--ratio "$(ratio "$(metric "$fn" call-p50-ms)" "$(metric "$fn" exec-p50-ms)")" --target "<= +2 ms" --target-text "overhead <= 2 ms"
for p in p50 p99; do
	bench_record --id "density-interference-$p" --area Density --unit ms \
		--title "exec into a latency-class sandbox with 50% CPU of batch load vs alone, $p" \
		--value "$(metric "$intf" batch-load-$p-ms)" --baseline "$(metric "$intf" alone-$p-ms)" --baseline-what alone \
		--ratio "$(ratio "$(metric "$intf" batch-load-$p-ms)" "$(metric "$intf" alone-$p-ms)")" --target "<= 1.10x"
done
bench_record --id density-interference-off-p50 --area Density --unit ms \
	--title "the same load without classes (the mapping off) vs alone, p50" \
	--value "$(metric "$intf" unmapped-load-p50-ms)" --baseline "$(metric "$intf" alone-p50-ms)" --baseline-what alone \
	--ratio "$(ratio "$(metric "$intf" unmapped-load-p50-ms)" "$(metric "$intf" alone-p50-ms)")"
bench_record --id density-spare-init --area Density --unit ms \
	--title "a spare init's start p50 with 2,000 more host mounts vs none (inits from dsec-init)" \
	--value "$(metric "$spare" mounts2000-p50-ms)" --baseline "$(metric "$spare" bare-p50-ms)" --baseline-what "no more host mounts" \
	--ratio "$(ratio "$(metric "$spare" mounts2000-p50-ms)" "$(metric "$spare" bare-p50-ms)")"
bench_record --id density-sandboxes --area Density --unit sandboxes \
	--title "idle stateful sandboxes started, at 1 CPU requested each" \
	--value "$(metric "$dens" sandboxes)" --target ">= 1000"
bench_record --id density-overcommit --area Density --unit x \
	--title "CPU overcommit at 1 CPU requested each" \
	--value "$(metric "$dens" cpu-overcommit)" --target ">= 500"
bench_record --id density-memory --area Density --unit MiB \
	--title "host memory per idle sandbox beyond its own processes" \
	--value "$(metric "$dens" overhead-MiB/sandbox)" --target "<= 5 MiB"
bench_record --id density-start --area Density --unit ms \
	--title "start per sandbox (create + first exec), serial, while they accumulate" \
	--value "$(metric "$dens" start-ms/sandbox)"
