#!/usr/bin/env bash
# make bench (as root): what domain rules cost (issue 35), measured inside sandboxes against a server in a network
# namespace of the benchmark's: HTTPS to an allowed name by the fast path (the sandbox resolved it) and through the
# sandbox's proxy (it did not) versus the same server on a port a CIDR rule allows directly (time to first byte, p50, DSEC_BENCH_N requests, default 200; throughput of one connection,
# 64 MiB), and DNS answers through the sandbox's resolver (which keeps answers for their TTL) versus the upstream asked
# directly.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
. "$(dirname "$0")/bench-lib.sh"
[ "$(id -u)" = 0 ] || { echo "bench-egress: needs root (cgroups, network namespaces): skipped" >&2; exit 0; }
DSEC_INIT=$(realpath "${DSEC_INIT:-bin/dsec-init}")
export DSEC_INIT
out=$(go test -run '^$' -bench 'BenchmarkDomainEgress$' -benchtime 1x -timeout 20m ./sdk/)
metric() { awk -v m="$1" '{for (i = 2; i <= NF; i++) if ($i == m) print $(i-1)}' <<<"$out"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3fx", a / b }'; }
echo "== domain egress (2-core VM, containers, inits from $DSEC_INIT; $(date -u +%F))"
printf '%-66s %12s %12s %8s %s\n' figure measured baseline ratio target
printf '%-66s %9s ms %9s ms %8s %s\n' "HTTPS time to first byte p50: by name, the fast path vs direct" "$(metric fast-ttfb-p50-ms)" \
	"$(metric direct-ttfb-p50-ms)" "$(ratio "$(metric fast-ttfb-p50-ms)" "$(metric direct-ttfb-p50-ms)")" "<= 1.2x"
printf '%-66s %9s ms %9s ms %8s\n' "HTTPS time to first byte p50: by name, through the proxy vs direct" "$(metric proxy-ttfb-p50-ms)" \
	"$(metric direct-ttfb-p50-ms)" "$(ratio "$(metric proxy-ttfb-p50-ms)" "$(metric direct-ttfb-p50-ms)")"
printf '%-66s %6s MiB/s %6s MiB/s %8s %s\n' "one connection's throughput: the fast path vs direct" "$(metric fast-MiB/s)" \
	"$(metric direct-MiB/s)" "$(ratio "$(metric fast-MiB/s)" "$(metric direct-MiB/s)")" ">= 0.8x"
printf '%-66s %6s MiB/s %6s MiB/s %8s\n' "one connection's throughput: through the proxy vs direct" "$(metric proxy-MiB/s)" \
	"$(metric direct-MiB/s)" "$(ratio "$(metric proxy-MiB/s)" "$(metric direct-MiB/s)")"
printf '%-66s %9s ms %9s ms %8s\n' "DNS answer p50: the sandbox's resolver (its cache) vs the upstream" "$(metric dns-worker-p50-ms)" \
	"$(metric dns-direct-p50-ms)" "$(ratio "$(metric dns-worker-p50-ms)" "$(metric dns-direct-p50-ms)")"
printf '%-66s %9s ms %9s ms %8s\n' "DNS answer p99: the sandbox's resolver (its cache) vs the upstream" "$(metric dns-worker-p99-ms)" \
	"$(metric dns-direct-p99-ms)" "$(ratio "$(metric dns-worker-p99-ms)" "$(metric dns-direct-p99-ms)")"
printf '%-66s %9s ms %9s ms %8s\n' "DNS answer p50, names never asked: the sandbox's resolver vs upstream" "$(metric dns-miss-worker-p50-ms)" \
	"$(metric dns-miss-direct-p50-ms)" "$(ratio "$(metric dns-miss-worker-p50-ms)" "$(metric dns-miss-direct-p50-ms)")"

eg() { # id title value-metric baseline-metric baseline-what unit [flags]
	local id=$1 title=$2 v b what=$5 unit=$6
	v=$(metric "$3"); b=$(metric "$4"); shift 6
	bench_record --id "egress-$id" --area "Domain rules" --title "$title" --unit "$unit" \
		--value "$v" --baseline "$b" --baseline-what "$what" --ratio "$(ratio "$v" "$b")" "$@"
}
eg fast-ttfb "HTTPS time to first byte p50, by name: the fast path vs direct" fast-ttfb-p50-ms direct-ttfb-p50-ms "direct (a CIDR rule)" ms --target "<= 1.2x"
eg proxy-ttfb "HTTPS time to first byte p50, by name: through the proxy vs direct" proxy-ttfb-p50-ms direct-ttfb-p50-ms "direct (a CIDR rule)" ms
eg fast-throughput "one connection's throughput: the fast path vs direct" fast-MiB/s direct-MiB/s "direct (a CIDR rule)" MiB/s --target ">= 0.8x"
eg proxy-throughput "one connection's throughput: through the proxy vs direct" proxy-MiB/s direct-MiB/s "direct (a CIDR rule)" MiB/s
eg dns-cached "DNS answer p50, one name again: the sandbox's resolver (its cache) vs the upstream" dns-worker-p50-ms dns-direct-p50-ms "the upstream asked directly" ms
eg dns-miss "DNS answer p50, names never asked: the sandbox's resolver vs the upstream" dns-miss-worker-p50-ms dns-miss-direct-p50-ms "the upstream asked directly" ms
