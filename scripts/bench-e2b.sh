#!/usr/bin/env bash
# make bench (as root): the E2B protocol (issue 32), on one worker, on a Debian layer, in one run (sdk's BenchmarkE2B).
#  1. Sandbox.create + the first commands.run('true') p50, official E2B JS SDK over the E2B front vs dsec's Go SDK over
#     its TCP API (both run bash -l -c true, as the E2B SDK does).
#  2. commands.run('true') p50 in one sandbox, the same two ways.
#  3. one request each way (files.getInfo vs Stat): what the clients cost per request.
#  4. 100 sandboxes made at once from one client, each running 10 commands: sandboxes/s and commands/s.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
. "$(dirname "$0")/bench-lib.sh"
[ "$(id -u)" = 0 ] || { echo "bench-e2b: needs root (the worker): skipped" >&2; exit 0; }
command -v node >/dev/null || { echo "bench-e2b: needs node (make deps installs it)" >&2; exit 1; }
n=${BENCH_N:-200}
metric() { awk -v m="$2" '{for (i = 2; i <= NF; i++) if ($i == m) print $(i-1)}' <<<"$1"; }

r=$(go test -run '^$' -bench 'BenchmarkE2B$' -benchtime "${n}x" ./sdk/)
echo "== E2B protocol (2-core VM; $(date -u +%F)): official E2B JS SDK 2.51.0 vs dsec's Go SDK, same worker"
printf '%-52s %12s %12s %8s\n' figure e2b dsec-sdk ratio
printf '%-52s %9s ms %9s ms %7sx\n' "create + first command, p50" "$(metric "$r" e2b-create-first-p50-ms)" \
	"$(metric "$r" go-create-first-p50-ms)" "$(metric "$r" e2b/go-create-first)"
printf '%-52s %9s ms %9s ms %7sx\n' "command (bash -l -c true), p50" "$(metric "$r" e2b-run-p50-ms)" \
	"$(metric "$r" go-run-p50-ms)" "$(metric "$r" e2b/go-run)"
printf '%-52s %9s ms %9s ms %7sx\n' "one request (files.getInfo / Stat), p50" "$(metric "$r" e2b-stat-p50-ms)" \
	"$(metric "$r" go-stat-p50-ms)" "$(metric "$r" e2b/go-stat)"
printf '%-52s %9s /s %9s /s %7sx\n' "100 sandboxes at once: sandboxes/s" "$(metric "$r" e2b-sandboxes/s)" \
	"$(metric "$r" go-sandboxes/s)" "$(metric "$r" e2b/go-sandboxes)"
printf '%-52s %9s /s %9s /s %7sx\n' "100 sandboxes x 10 commands: commands/s" "$(metric "$r" e2b-commands/s)" \
	"$(metric "$r" go-commands/s)" "$(metric "$r" e2b/go-commands)"
e2b() { # id title unit metric-prefix metric-suffix ratio-metric
	bench_record --id "e2b-$1" --area "The E2B protocol" --title "$2" --unit "$3" \
		--value "$(metric "$r" "e2b-$4")" --baseline "$(metric "$r" "go-$4")" --baseline-what "dsec's Go SDK over its TCP API" \
		--ratio "$(metric "$r" "e2b/go-$5")"
}
e2b create "official E2B JS SDK through the E2B front: \`Sandbox.create\` + first \`commands.run('true')\`, p50" ms create-first-p50-ms create-first
e2b command "the same: \`commands.run('true')\` in one sandbox, p50" ms run-p50-ms run
e2b request "the same: one request (\`files.getInfo\` / \`Stat\`), p50" ms stat-p50-ms stat
e2b sandboxes "the same: 100 sandboxes made at once" /s sandboxes/s sandboxes
e2b commands "the same: 100 sandboxes x 10 commands" commands/s commands/s commands

# 5. E2B through a gateway: the same worker's own front vs a gateway's (each request relayed to the worker's front),
#    the E2B JS SDK's requests alternating turn by turn (internal/e2b/testdata/ab.cjs).
r=$(go test -run '^$' -bench 'BenchmarkE2BGateway$' -benchtime "${n}x" ./sdk/)
printf '%-52s %12s %12s %8s\n' "E2B through a gateway" gateway worker ratio
printf '%-52s %9s ms %9s ms %7sx\n' "create + first command, p50" "$(metric "$r" gateway-create_first-p50-ms)" \
	"$(metric "$r" worker-create_first-p50-ms)" "$(metric "$r" gateway/worker-create_first)"
printf '%-52s %9s ms %9s ms %7sx\n' "command (commands.run('true')), p50" "$(metric "$r" gateway-run-p50-ms)" \
	"$(metric "$r" worker-run-p50-ms)" "$(metric "$r" gateway/worker-run)"
bench_record --id e2b-gateway-create --area "E2B through a gateway" --unit ms \
	--title "E2B JS SDK: create + first command p50, through a gateway's front vs the worker's own (ratio: median of the per-turn ratios)" \
	--value "$(metric "$r" gateway-create_first-p50-ms)" --baseline "$(metric "$r" worker-create_first-p50-ms)" --baseline-what "the worker's own front" \
	--ratio "$(metric "$r" gateway/worker-create_first)"
bench_record --id e2b-gateway-command --area "E2B through a gateway" --unit ms \
	--title "E2B JS SDK: a command (\`commands.run('true')\`) p50, the same" \
	--value "$(metric "$r" gateway-run-p50-ms)" --baseline "$(metric "$r" worker-run-p50-ms)" --baseline-what "the worker's own front" \
	--ratio "$(metric "$r" gateway/worker-run)"
