#!/usr/bin/env bash
# make bench (as root): a gateway of three workers on this machine, every figure against its baseline in one run.
#  1. exec of true through the gateway vs straight to the sandbox's worker, both TCP+TLS with a token, alternating.
#  2. a burst of creates at once through the gateway (three workers) vs straight to one worker: sandboxes per second;
#     the same as one batch (POST /v1/batches). BENCH_BURST sets how many (default 60).
#  3. the time from a worker's kill -9 to the gateway listing its sandboxes unreachable, and to its taking it for down.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
. "$(dirname "$0")/bench-lib.sh"
[ "$(id -u)" = 0 ] || { echo "bench-gateway: needs root (the workers): skipped" >&2; exit 0; }
n=${BENCH_N:-200}
burst=${BENCH_BURST:-60}
metric() { awk -v m="$2" '{for (i = 2; i <= NF; i++) if ($i == m) print $(i-1)}' <<<"$1"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", a / b }'; }

r=$(go test -run '^$' -bench 'BenchmarkGateway$' -benchtime "${n}x" ./sdk/ -args -gateway.burst "$burst")
echo "== gateway (2-core VM; $(date -u +%F))"
printf '%-56s %10s %10s %8s %s\n' figure dsec baseline ratio target
for q in p50 p99; do
	target=""
	[ $q = p50 ] && target="<= 1.1x"
	printf '%-56s %7s ms %7s ms %8s %s\n' "exec through the gateway vs straight to the worker, $q" "$(metric "$r" gateway-$q-ms)" \
		"$(metric "$r" direct-$q-ms)" "$(ratio "$(metric "$r" gateway-$q-ms)" "$(metric "$r" direct-$q-ms)")" "$target"
done
printf '%-56s %6s /s %6s /s %8s\n' "$burst creates at once: gateway (3 workers) vs one worker" "$(metric "$r" gateway-burst-per-s)" \
	"$(metric "$r" one-worker-burst-per-s)" "$(ratio "$(metric "$r" gateway-burst-per-s)" "$(metric "$r" one-worker-burst-per-s)")"
printf '%-56s %6s /s %6s /s %8s\n' "a batch of $burst: gateway (3 workers) vs one worker" "$(metric "$r" gateway-batch-per-s)" \
	"$(metric "$r" one-worker-batch-per-s)" "$(ratio "$(metric "$r" gateway-batch-per-s)" "$(metric "$r" one-worker-batch-per-s)")"
printf '%-56s %8s s\n' "a worker's kill -9 to its sandboxes listed unreachable" "$(metric "$r" death-to-unreachable-s)"
printf '%-56s %8s s\n' "a worker's kill -9 to the gateway taking it for down" "$(metric "$r" death-to-down-s)"
gw() { # id title value-metric baseline-metric baseline-what unit [flags]
	local id=$1 title=$2 v b what=$5 unit=$6
	v=$(metric "$r" "$3"); b=$(metric "$r" "$4"); shift 6
	bench_record --id "gateway-$id" --area "A gateway of three workers" --title "$title" --unit "$unit" \
		--value "$v" --baseline "$b" --baseline-what "$what" --ratio "$(ratio "$v" "$b")" "$@"
}
gw exec-p50 "exec p50 through the gateway vs straight to the worker (TCP+TLS, a token)" gateway-p50-ms direct-p50-ms "straight to the worker" ms --target "<= 1.1x"
gw exec-p99 "exec p99, the same" gateway-p99-ms direct-p99-ms "straight to the worker" ms
gw burst "$burst creates at once: through the gateway (3 workers) vs straight to one worker" gateway-burst-per-s one-worker-burst-per-s "one worker" /s
gw batch "a batch of $burst (\`POST /v1/batches\`): through the gateway (3 workers) vs one worker" gateway-batch-per-s one-worker-batch-per-s "one worker" /s
bench_record --id gateway-death-unreachable --area "A gateway of three workers" --unit s \
	--title "a worker's \`kill -9\` to its sandboxes listed \`unreachable\`" --value "$(metric "$r" death-to-unreachable-s)"
bench_record --id gateway-death-down --area "A gateway of three workers" --unit s \
	--title "a worker's \`kill -9\` to the gateway taking it for down (heartbeat 2 s)" --value "$(metric "$r" death-to-down-s)" \
	--target-text "3 heartbeats (6 s) after it last answered"

# 4. a gateway's heartbeat on a worker holding 100 sandboxes: the brief list it asks for vs the full one.
r=$(go test -run '^$' -bench 'BenchmarkListBrief$' -benchtime "${BENCH_LISTS:-30}x" ./sdk/)
printf '%-56s %7s ms %7s ms %8s\n' "list of 100 sandboxes: brief (a heartbeat) vs full" "$(metric "$r" brief-p50-ms)" \
	"$(metric "$r" full-p50-ms)" "$(ratio "$(metric "$r" brief-p50-ms)" "$(metric "$r" full-p50-ms)")"
gw list-brief "a list of a worker's 100 sandboxes, p50: brief (a gateway's heartbeat) vs full" brief-p50-ms full-p50-ms "the full list" ms
