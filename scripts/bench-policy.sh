#!/usr/bin/env bash
# make bench (as root): what policies cost.
#  1. connect() under a 1,000-entry egress allowlist vs no policy: one process alternates between a
#     cgroup with no programs and one under the allowlist, in rounds of 1,000 refused loopback connects
#     (the cheapest connect there is, so the largest relative cost), timing the connect calls alone.
#  2. policy apply on a running sandbox (its allowlist swapped between 1,000 rules and one, through the
#     SDK and the worker) vs what the change costs without live apply: a new sandbox under the new
#     policy, ready for its first command.
#  3. loading the default seccomp profile when a sandbox starts: as the binary search dsec emits vs
#     the library's chain of one comparison per system call (same answers; TestSearchTree).
#  5. connect() under an allowlist of every address with the deny set's entries vs the same rules
#     without them (how the allowlist was before the deny set), alternating as in 1.
#  6. create to first exec of a sandbox that starts its own init, with the device allowlist (the cgroup
#     device program and the v1 devices lines) vs without, alternating in one loop.
#  7. create to first exec with the worker's default limits (memory, pids) vs none (as every sandbox
#     without flags was before issue 36), alternating in one loop through the SDK.
#  8. create to first exec, and to removal, with the default disk bound (the upper a subvolume of the
#     root's uppers file system, under its quota) vs the upper a directory of the root's file system (as
#     every sandbox without --disk was before issue 36), alternating in one loop in the runtime.
#  4. a 10 GiB disk quota (the upper on its own loop-mounted ext4 image) vs none: create to first exec
#     done, and to removal, alternating in one loop through the SDK.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
. "$(dirname "$0")/bench-lib.sh"
[ "$(id -u)" = 0 ] || { echo "bench-policy: needs root (cgroups, BPF, namespaces): skipped" >&2; exit 0; }
n=${BENCH_N:-100}
metric() { awk -v m="$2" '{for (i = 2; i <= NF; i++) if ($i == m) print $(i-1)}' <<<"$1"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3fx", a / b }'; }

conn=$(go test -run '^$' -bench BenchmarkConnect -benchtime 200000x ./internal/policy/)
none=$(metric "$conn" ns/connect-none); guarded=$(metric "$conn" ns/connect-1000)
load=$(go test -run '^$' -bench BenchmarkSeccompLoad -benchtime 300x ./internal/policy/)
apply=$(go test -run '^$' -bench BenchmarkApplyPolicy -benchtime "${n}x" ./sdk/)
disk=$(go test -run '^$' -bench BenchmarkDiskQuota -benchtime "$((2 * n))x" ./sdk/)
deny=$(go test -run '^$' -bench BenchmarkConnectDenySet -benchtime 200000x ./internal/policy/)
devs=$(go test -run '^$' -bench BenchmarkDevices -benchtime "$((2 * n))x" ./internal/runtime/)
defs=$(go test -run '^$' -bench BenchmarkDefaults -benchtime "$((2 * n))x" ./sdk/)
bound=$(go test -run '^$' -bench BenchmarkDiskBound -benchtime "$((2 * n))x" ./internal/runtime/)

echo "== policy (2-core VM; $(date -u +%F))"
printf '%-52s %10s %10s %8s\n' figure dsec baseline ratio
printf '%-52s %8s ns %8s ns %8s\n' "connect(), 1,000-entry allowlist vs no policy" "$guarded" "$none" "$(ratio "$guarded" "$none")"
printf '%-52s %8s ms %8s ms %8s\n' "policy apply p50 vs a new sandbox under it" "$(metric "$apply" apply-p50-ms)" "$(metric "$apply" recreate-p50-ms)" \
	"$(ratio "$(metric "$apply" apply-p50-ms)" "$(metric "$apply" recreate-p50-ms)")"
printf '%-52s %8s ms %8s ms %8s\n' "policy apply p99 vs a new sandbox under it" "$(metric "$apply" apply-p99-ms)" "$(metric "$apply" recreate-p99-ms)" \
	"$(ratio "$(metric "$apply" apply-p99-ms)" "$(metric "$apply" recreate-p99-ms)")"
printf '%-52s %8s us %8s us %8s\n' "seccomp profile load p50: search vs chain" "$(metric "$load" search-p50-us)" "$(metric "$load" chain-p50-us)" \
	"$(ratio "$(metric "$load" search-p50-us)" "$(metric "$load" chain-p50-us)")"
for m in first-exec-p50 first-exec-p99 with-rm-p50 with-rm-p99; do
	printf '%-52s %8s ms %8s ms %8s\n' "10 GiB disk quota vs none: ${m%-p*} ${m##*-}" "$(metric "$disk" "${m%-p*}-disk-${m##*-}-ms")" \
		"$(metric "$disk" "$m-ms")" "$(ratio "$(metric "$disk" "${m%-p*}-disk-${m##*-}-ms")" "$(metric "$disk" "$m-ms")")"
done
printf '%-52s %8s ns %8s ns %8s\n' "connect(), deny set vs the allowlist alone" "$(metric "$deny" ns/connect-denyset)" \
	"$(metric "$deny" ns/connect-allowlist)" "$(ratio "$(metric "$deny" ns/connect-denyset)" "$(metric "$deny" ns/connect-allowlist)")"
printf '%-52s %8s ms %8s ms %8s\n' "create to first exec p50: device allowlist vs none" "$(metric "$devs" devices-p50-ms)" \
	"$(metric "$devs" none-p50-ms)" "+$(metric "$devs" added-p50-ms) ms"
for q in p50 p99; do
	printf '%-52s %8s ms %8s ms %8s\n' "create to first exec $q: default limits vs none" "$(metric "$defs" "defaults-$q-ms")" \
		"$(metric "$defs" "unlimited-$q-ms")" "$(ratio "$(metric "$defs" "defaults-$q-ms")" "$(metric "$defs" "unlimited-$q-ms")")"
done
added=$(awk -v d="$(metric "$bound" added-p50-ms)" 'BEGIN { printf "%+.2f", d }')
printf '%-52s %8s ms %8s ms %8s\n' "create to first exec p50: default disk bound vs none" "$(metric "$bound" bound-p50-ms)" \
	"$(metric "$bound" dir-p50-ms)" "$added ms"
printf '%-52s %8s ms %8s ms %8s\n' "create, exec, remove p50: default disk bound vs none" "$(metric "$bound" bound-rm-p50-ms)" \
	"$(metric "$bound" dir-rm-p50-ms)" "$(ratio "$(metric "$bound" bound-rm-p50-ms)" "$(metric "$bound" dir-rm-p50-ms)")"

bench_record --id policy-connect --area Policies --unit ns \
	--title "connect(), 1,000-entry egress allowlist vs no policy" \
	--value "$guarded" --baseline "$none" --baseline-what "no policy" --ratio "$(ratio "$guarded" "$none")" --target "<= 1.05x"
bench_record --id policy-apply --area Policies --unit ms \
	--title "policy apply on a running sandbox (1,000 rules and one, in turn), p50" \
	--value "$(metric "$apply" apply-p50-ms)" --baseline "$(metric "$apply" recreate-p50-ms)" --baseline-what "a new sandbox under the new policy" \
	--ratio "$(ratio "$(metric "$apply" apply-p50-ms)" "$(metric "$apply" recreate-p50-ms)")"
bench_record --id policy-deny-set --area Policies --unit ns \
	--title "connect(), the deny set's entries vs the allowlist alone" \
	--value "$(metric "$deny" ns/connect-denyset)" --baseline "$(metric "$deny" ns/connect-allowlist)" --baseline-what "the allowlist alone" \
	--ratio "$(ratio "$(metric "$deny" ns/connect-denyset)" "$(metric "$deny" ns/connect-allowlist)")" --target "<= 1.05x"
bench_record --id policy-devices --area Policies --unit ms \
	--title "create to first exec p50, a sandbox starting its own init: device allowlist vs none" \
	--value "$(metric "$devs" devices-p50-ms)" --baseline "$(metric "$devs" none-p50-ms)" --baseline-what "no device allowlist" \
	--ratio-of dsec-baseline --ratio "$(metric "$devs" added-p50-ms)" --target "<= +0.3 ms"
bench_record --id policy-default-limits --area Policies --unit ms \
	--title "create to first exec p50 through the SDK: the default memory and pids limits vs none" \
	--value "$(metric "$defs" defaults-p50-ms)" --baseline "$(metric "$defs" unlimited-p50-ms)" --baseline-what "no limits" \
	--ratio-of dsec-baseline --target "<= +0.5 ms"
bench_record --id policy-disk-bound --area Policies --unit ms \
	--title "create to first exec p50: the default disk bound (a btrfs subvolume under quota) vs a directory upper" \
	--value "$(metric "$bound" bound-p50-ms)" --baseline "$(metric "$bound" dir-p50-ms)" --baseline-what "a directory upper" \
	--ratio-of dsec-baseline --ratio "$added" --target "<= +0.5 ms"
bench_record --id policy-disk-quota --area Policies --unit ms \
	--title "create to first exec p50: a 10 GiB disk quota (a loop-mounted ext4 image) vs none" \
	--value "$(metric "$disk" first-exec-disk-p50-ms)" --baseline "$(metric "$disk" first-exec-p50-ms)" --baseline-what "no quota" \
	--ratio "$(ratio "$(metric "$disk" first-exec-disk-p50-ms)" "$(metric "$disk" first-exec-p50-ms)")"
