#!/usr/bin/env bash
# make bench (as root): the worker's API over TCP (issue 31), every figure against the same worker in one run.
#  1. exec of true in one sandbox through the Go SDK over TCP with TLS and a token vs over the unix socket, alternating.
#  2. the same over TCP from the Python SDK (python/bench.py), sync and asyncio, vs the Go SDK over TCP.
#  3. 256 concurrent execs over TCP: asyncio tasks from one Python client vs Go goroutines from one Go client.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
. "$(dirname "$0")/bench-lib.sh"
[ "$(id -u)" = 0 ] || { echo "bench-remote: needs root (the worker): skipped" >&2; exit 0; }
n=${BENCH_N:-200}
metric() { awk -v m="$2" '{for (i = 2; i <= NF; i++) if ($i == m) print $(i-1)}' <<<"$1"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", a / b }'; }

r=$(go test -run '^$' -bench 'BenchmarkRemote$' -benchtime "${n}x" ./sdk/)
echo "== remote API (2-core VM; $(date -u +%F))"
printf '%-52s %10s %10s %8s %s\n' figure dsec baseline ratio target
for q in p50 p99; do
	printf '%-52s %7s ms %7s ms %8s %s\n' "exec, Go SDK, TCP+TLS vs unix socket, $q" "$(metric "$r" tcp-tls-$q-ms)" "$(metric "$r" unix-$q-ms)" \
		"$(ratio "$(metric "$r" tcp-tls-$q-ms)" "$(metric "$r" unix-$q-ms)")" "<= 1.2x"
	for side in sync aio; do
		printf '%-52s %7s ms %7s ms %8s %s\n' "exec, Python $side vs Go SDK, both TCP+TLS, $q" "$(metric "$r" py-$side-$q-ms)" \
			"$(metric "$r" tcp-tls-$q-ms)" "$(ratio "$(metric "$r" py-$side-$q-ms)" "$(metric "$r" tcp-tls-$q-ms)")" "<= 1.5x"
	done
done
printf '%-52s %6s /s %6s /s %8s\n' "256 concurrent execs: asyncio vs Go goroutines" "$(metric "$r" py-aio-256-steps/s)" \
	"$(metric "$r" go-256-steps/s)" "$(ratio "$(metric "$r" py-aio-256-steps/s)" "$(metric "$r" go-256-steps/s)")"

bench_record --id remote-exec-tls --area "The API over TCP" --unit ms \
	--title "exec p50, Go SDK: TCP+TLS with a token vs the unix socket" \
	--value "$(metric "$r" tcp-tls-p50-ms)" --baseline "$(metric "$r" unix-p50-ms)" --baseline-what "the unix socket" \
	--ratio "$(ratio "$(metric "$r" tcp-tls-p50-ms)" "$(metric "$r" unix-p50-ms)")" --target "<= 1.2x"
for side in sync aio; do
	bench_record --id "remote-python-$side" --area "The API over TCP" --unit ms \
		--title "exec p50, Python SDK ($side) vs Go SDK, both TCP+TLS" \
		--value "$(metric "$r" py-$side-p50-ms)" --baseline "$(metric "$r" tcp-tls-p50-ms)" --baseline-what "the Go SDK" \
		--ratio "$(ratio "$(metric "$r" py-$side-p50-ms)" "$(metric "$r" tcp-tls-p50-ms)")" --target "<= 1.5x"
done
bench_record --id remote-256 --area "The API over TCP" --unit steps/s \
	--title "256 concurrent execs over TCP: asyncio tasks vs Go goroutines" \
	--value "$(metric "$r" py-aio-256-steps/s)" --baseline "$(metric "$r" go-256-steps/s)" --baseline-what "Go goroutines" \
	--ratio "$(ratio "$(metric "$r" py-aio-256-steps/s)" "$(metric "$r" go-256-steps/s)")"
