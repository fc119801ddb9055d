#!/usr/bin/env bash
# make bench (as root): the microvm backend (issue 33), on busybox layers through the SDK and a test worker, under
# the host's accelerator (TCG on these machines; every figure says which).
#  1. Create to first exec: a microVM booted for the create (cold), one taken from a warm pool (a FnCall call on a
#     guest that waited booted and paused) and a container, in rounds that take turns (BENCH_VM_N, default 10);
#     then exec of true in a running microVM and in a running container.
#  2. Host memory per idle microVM (512 MiB guests, DSEC_BENCH_VMS of them, default 4), all of it (MemTotal -
#     MemFree) and what their groups are charged, next to as many idle containers measured the same way.
#  3. DAX: the host memory 4 microVMs take once each read the same 400 MiB of one 600 MiB layer, the layer on a
#     pmem device read through DAX versus on a virtio-blk disk (DSec: -40.2% peak).
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
. "$(dirname "$0")/bench-lib.sh"
[ "$(id -u)" = 0 ] || { echo "bench-microvm: needs root (cgroups, QEMU guests): skipped" >&2; exit 0; }
[ -f bin/microvm/release ] || { echo "bench-microvm: no guest kernel in bin/microvm: run make kernel first" >&2; exit 1; }
DSEC_INIT=$(realpath "${DSEC_INIT:-bin/dsec-init}")
export DSEC_INIT
n=${BENCH_VM_N:-10}
metric() { awk -v m="$2" '{for (i = 2; i <= NF; i++) if ($i == m) print $(i-1)}' <<<"$1"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3fx", a / b }'; }

run=$(go test -run '^$' -bench 'BenchmarkMicroVM$' -benchtime "${n}x" -timeout 60m ./sdk/)
idle=$(go test -run '^$' -bench 'BenchmarkMicroVMIdle$' -benchtime 1x -timeout 60m ./sdk/)
dax=$(go test -run '^$' -bench 'BenchmarkMicroVMDAX$' -benchtime 1x -timeout 60m ./sdk/)
accel=tcg
[ -n "$(metric "$run" kvm)" ] && accel=kvm

echo "== microvm (2-core VM, accelerator $accel, inits from $DSEC_INIT; $(date -u +%F))"
printf '%-62s %10s %10s %8s\n' figure microvm baseline ratio
for p in p50 p99; do
	printf '%-62s %7s ms %7s ms %8s\n' "create to first exec, warm pool vs cold boot, $p" "$(metric "$run" microvm-warm-$p-ms)" "$(metric "$run" microvm-cold-$p-ms)" \
		"$(ratio "$(metric "$run" microvm-warm-$p-ms)" "$(metric "$run" microvm-cold-$p-ms)")"
	printf '%-62s %7s ms %7s ms %8s\n' "  cold boot vs a container, $p" "$(metric "$run" microvm-cold-$p-ms)" "$(metric "$run" container-$p-ms)" \
		"$(ratio "$(metric "$run" microvm-cold-$p-ms)" "$(metric "$run" container-$p-ms)")"
	printf '%-62s %7s ms %7s ms %8s\n' "  warm pool vs a container, $p" "$(metric "$run" microvm-warm-$p-ms)" "$(metric "$run" container-$p-ms)" \
		"$(ratio "$(metric "$run" microvm-warm-$p-ms)" "$(metric "$run" container-$p-ms)")"
	printf '%-62s %7s ms %7s ms %8s\n' "exec of true, microVM vs container, $p" "$(metric "$run" microvm-exec-$p-ms)" "$(metric "$run" container-exec-$p-ms)" \
		"$(ratio "$(metric "$run" microvm-exec-$p-ms)" "$(metric "$run" container-exec-$p-ms)")"
done
printf '%-62s %6s MiB %6s MiB %8s\n' "host memory per idle sandbox (512 MiB), microVM vs container" "$(metric "$idle" microvm-host-MiB/sandbox)" \
	"$(metric "$idle" container-host-MiB/sandbox)" "$(ratio "$(metric "$idle" microvm-host-MiB/sandbox)" "$(metric "$idle" container-host-MiB/sandbox)")"
printf '%-62s %6s MiB %6s MiB %8s\n' "  charged to its group" "$(metric "$idle" microvm-charged-MiB/sandbox)" \
	"$(metric "$idle" container-charged-MiB/sandbox)" "$(ratio "$(metric "$idle" microvm-charged-MiB/sandbox)" "$(metric "$idle" container-charged-MiB/sandbox)")"
printf '%-62s %6s MiB %6s MiB %8s\n' "host memory, $(metric "$dax" vms) microVMs reading 400 MiB of a layer, DAX vs virtio-blk" \
	"$(metric "$dax" dax-host-MiB)" "$(metric "$dax" blk-host-MiB)" "$(metric "$dax" dax/blk)x"

# The targets are set for a host with hardware KVM: checked there, stated under TCG.
warm=(--target-text "warm <= 20 ms on a hardware-KVM host: not measurable under TCG")
cold=(--target-text "cold <= 150 ms on a hardware-KVM host: not measurable under TCG")
if [ "$accel" = kvm ]; then warm=(--target "<= 20 ms" --target-text "warm <= 20 ms"); cold=(--target "<= 150 ms" --target-text "cold <= 150 ms"); fi
vm() { # id title value-metric baseline-metric baseline-what unit [flags]
	local id=$1 title=$2 v b what=$5 unit=$6
	v=$(metric "${M:-$run}" "$3"); b=$(metric "${M:-$run}" "$4"); shift 6
	bench_record --id "microvm-$id" --area MicroVMs --title "$title (${accel^^})" --unit "$unit" \
		--value "$v" --baseline "$b" --baseline-what "$what" --ratio "$(ratio "$v" "$b")" "$@"
}
vm warm-cold "create to first exec p50: a microVM from a warm pool vs one booted for the create" microvm-warm-p50-ms microvm-cold-p50-ms "a cold boot" ms "${warm[@]}"
vm cold-container "create to first exec p50: a microVM booted for the create vs a container" microvm-cold-p50-ms container-p50-ms "a container" ms "${cold[@]}"
vm warm-container "create to first exec p50: a microVM from a warm pool vs a container" microvm-warm-p50-ms container-p50-ms "a container" ms
vm exec "exec of true p50 in a running microVM vs a container" microvm-exec-p50-ms container-exec-p50-ms "a container" ms
M=$idle vm idle-memory "host memory per idle sandbox (512 MiB, booted, one exec, idle)" microvm-host-MiB/sandbox container-host-MiB/sandbox "a container" MiB
bench_record --id microvm-dax --area MicroVMs --unit MiB \
	--title "host memory of $(metric "$dax" vms) microVMs each reading the same 400 MiB of a 600 MiB layer: pmem with DAX vs virtio-blk (${accel^^})" \
	--value "$(metric "$dax" dax-host-MiB)" --baseline "$(metric "$dax" blk-host-MiB)" --baseline-what virtio-blk \
	--ratio "$(metric "$dax" dax/blk)" --target-text "DSec reports -40.2% at peak"
