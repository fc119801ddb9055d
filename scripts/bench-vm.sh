#!/usr/bin/env bash
# make bench (as root): full VMs (the vm backend) of a Debian image, through the SDK and a test worker, under the
# host's accelerator (TCG on these machines; every figure says which), BENCH_VM_N rounds (default 3):
#  1. Create to first exec, booted through the firmware, next to QEMU alone booting the same image to its login prompt.
#  2. A screenshot's latency, and input to screen (a key typed until a screenshot shows it), p50.
#  3. The host memory of an idle VM next to the RAM it was given; the disk each VM adds next to the image's.
#  4. A memory snapshot of the idle VM, and create to first exec of a branch that continues it, next to a cold boot.
#  5. A memory snapshot continued on a worker that holds none of it: its disks read lazily from the shared remote
#     (the bytes fetched), next to pulling it whole first.
#  6. A desktop (Xfce): create to a settled desktop, screenshot and key-to-screen p50, idle host memory (BENCH_VM_DESKTOP_N rounds, default 1).
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
. "$(dirname "$0")/bench-lib.sh"
[ "$(id -u)" = 0 ] || { echo "bench-vm: needs root (cgroups, QEMU guests): skipped" >&2; exit 0; }
n=${BENCH_VM_N:-3}
metric() { awk -v m="$2" '{for (i = 2; i <= NF; i++) if ($i == m) print $(i-1)}' <<<"$1"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3fx", a / b }'; }

out=$(go test -run '^$' -bench 'BenchmarkFullVM$' -benchtime "${n}x" -timeout 60m ./sdk/)
accel=tcg
[ "$(metric "$out" kvm)" = 1 ] && accel=kvm
A=${accel^^}

echo "== full VMs (2-core VM, accelerator $accel; $(date -u +%F))"
printf '%-66s %12s %12s %8s\n' figure measured baseline ratio
printf '%-66s %9s ms %9s ms %8s\n' "create to first exec, booted through OVMF vs QEMU alone to login:" "$(metric "$out" cold-p50-ms)" \
	"$(metric "$out" byhand-p50-ms)" "$(ratio "$(metric "$out" cold-p50-ms)" "$(metric "$out" byhand-p50-ms)")"
printf '%-66s %9s ms %12s %8s\n' "a screenshot through the SDK, p50" "$(metric "$out" screenshot-p50-ms)" - -
printf '%-66s %9s ms %12s %8s\n' "a key typed to a screenshot showing it, p50" "$(metric "$out" input-p50-ms)" - -
printf '%-66s %8s MiB %8s MiB %8s\n' "host memory of an idle VM vs the RAM it was given" "$(metric "$out" idle-host-MiB)" \
	"$(metric "$out" guest-MiB)" "$(ratio "$(metric "$out" idle-host-MiB)" "$(metric "$out" guest-MiB)")"
printf '%-66s %8s MiB %8s MiB %8s\n' "disk each VM adds (its overlay) vs the image's disk, shared" "$(metric "$out" overlay-MiB)" \
	"$(metric "$out" image-MiB)" "$(ratio "$(metric "$out" overlay-MiB)" "$(metric "$out" image-MiB)")"

printf '%-66s %9s ms %9s ms %8s\n' "create to first exec, continued from a memory snapshot vs booted:" "$(metric "$out" restore-p50-ms)" \
	"$(metric "$out" cold-p50-ms)" "$(ratio "$(metric "$out" restore-p50-ms)" "$(metric "$out" cold-p50-ms)")"
printf '%-66s %9s ms %8s MiB %8s\n' "the memory snapshot: guest paused, its saved state" "$(metric "$out" paused-ms)" "$(metric "$out" state-MiB)" -

boot=(--target-text "on a hardware-KVM host: agent-ready within 5 s of the create; not measurable under TCG")
[ "$accel" != kvm ] || boot=(--target "<= 5000" --target-text "agent-ready within 5 s of the create")
# (QEMU alone to its serial login prompt is printed above, not recorded as the baseline: it reaches that prompt well
# after the stage the agent answers at, see BENCHMARKS.md.)
bench_record --id vm-boot --area "Full VMs" --unit ms \
	--title "create to first exec of a full VM booted through OVMF, p50 ($A)" \
	--value "$(metric "$out" cold-p50-ms)" "${boot[@]}"
bench_record --id vm-screenshot --area "Full VMs" --unit ms \
	--title "a full VM's screenshot through the SDK, p50 ($A)" --value "$(metric "$out" screenshot-p50-ms)" \
	--target-text "on hardware KVM: <= 50 ms"
bench_record --id vm-input --area "Full VMs" --unit ms \
	--title "a key typed on a full VM to a screenshot showing it, p50 ($A)" --value "$(metric "$out" input-p50-ms)" \
	--target-text "on hardware KVM: <= 150 ms (a key is held 100 ms)"
bench_record --id vm-idle-memory --area "Full VMs" --unit MiB \
	--title "host memory of an idle full VM (Debian, console) vs the RAM it was given ($A)" \
	--value "$(metric "$out" idle-host-MiB)" --baseline "$(metric "$out" guest-MiB)" --baseline-what "its RAM" \
	--ratio "$(ratio "$(metric "$out" idle-host-MiB)" "$(metric "$out" guest-MiB)")"
bench_record --id vm-disk --area "Full VMs" --unit MiB \
	--title "disk each full VM of an image adds (its overlay, after boot) vs the image's disk" \
	--value "$(metric "$out" overlay-MiB)" --baseline "$(metric "$out" image-MiB)" --baseline-what "the image (shared)" \
	--ratio "$(ratio "$(metric "$out" overlay-MiB)" "$(metric "$out" image-MiB)")" --target-text "the overlay only"
bench_record --id vm-restore --area "Full VMs" --unit ms \
	--title "create to first exec of a full VM continued from its memory snapshot, p50 ($A)" \
	--value "$(metric "$out" restore-p50-ms)" --baseline "$(metric "$out" cold-p50-ms)" --baseline-what "booted through OVMF" \
	--ratio "$(ratio "$(metric "$out" restore-p50-ms)" "$(metric "$out" cold-p50-ms)")" \
	--target-text "on a hardware-KVM host: <= 1 s (the saved RAM read in); under TCG the same order"

# 5. A memory snapshot published to a dir: remote, continued on a new worker: read lazily, or pulled whole first.
rout=$(go test -run '^$' -bench 'BenchmarkFullVMRemote$' -benchtime "${n}x" -timeout 60m ./sdk/)
printf '%-66s %9s ms %9s ms %8s\n' "snapshot continued on a new worker, disks lazily vs pulled whole" "$(metric "$rout" lazy-p50-ms)" \
	"$(metric "$rout" whole-p50-ms)" "$(ratio "$(metric "$rout" lazy-p50-ms)" "$(metric "$rout" whole-p50-ms)")"
printf '%-66s %8s MiB %8s MiB %8s\n' "  its disks' bytes fetched vs the disk chain's" "$(metric "$rout" fetched-MiB)" \
	"$(metric "$rout" chain-MiB)" "$(ratio "$(metric "$rout" fetched-MiB)" "$(metric "$rout" chain-MiB)")"
bench_record --id vm-remote-lazy --area "Full VMs" --unit ms \
	--title "create to first exec of a memory snapshot's branch on a worker that holds none of it, disks read lazily ($A)" \
	--value "$(metric "$rout" lazy-p50-ms)" --baseline "$(metric "$rout" whole-p50-ms)" --baseline-what "pulled whole first" \
	--ratio "$(ratio "$(metric "$rout" lazy-p50-ms)" "$(metric "$rout" whole-p50-ms)")" --target-text "< 1x"
bench_record --id vm-remote-fetched --area "Full VMs" --unit MiB \
	--title "bytes of its disks that branch fetched from the remote ($A)" \
	--value "$(metric "$rout" fetched-MiB)" --baseline "$(metric "$rout" chain-MiB)" --baseline-what "the disk chain" \
	--ratio "$(ratio "$(metric "$rout" fetched-MiB)" "$(metric "$rout" chain-MiB)")" --target-text "what the guest reads"

# 6. The desktop (Debian's Xfce, logged in), as a computer-use agent has it: one per round. Its Debian tree takes a
#    debootstrap from Debian's mirror once (cached); without it the figures are skipped, saying so.
dout=$(go test -run '^$' -bench 'BenchmarkFullVMDesktop$' -benchtime "${BENCH_VM_DESKTOP_N:-1}x" -timeout 60m -v ./sdk/)
if ! grep -q 'desktop-ready-p50-ms' <<<"$dout"; then
	echo "bench-vm: the desktop's figures were not measured:" >&2
	grep -E 'SKIP|no Debian tree' <<<"$dout" >&2 || true
	exit 0
fi
printf '%-66s %9s ms %12s %8s\n' "desktop: create to a settled desktop, p50" "$(metric "$dout" desktop-ready-p50-ms)" - -
printf '%-66s %9s ms %9s ms %8s\n' "desktop: a screenshot through the SDK, p50 vs the console's" "$(metric "$dout" desktop-screenshot-p50-ms)" \
	"$(metric "$out" screenshot-p50-ms)" "$(ratio "$(metric "$dout" desktop-screenshot-p50-ms)" "$(metric "$out" screenshot-p50-ms)")"
printf '%-66s %9s ms %9s ms %8s\n' "desktop: a key typed into a terminal to the screen, p50 vs console" "$(metric "$dout" desktop-input-p50-ms)" \
	"$(metric "$out" input-p50-ms)" "$(ratio "$(metric "$dout" desktop-input-p50-ms)" "$(metric "$out" input-p50-ms)")"
printf '%-66s %8s MiB %8s MiB %8s\n' "desktop: host memory of the idle desktop vs the RAM it was given" "$(metric "$dout" desktop-idle-host-MiB)" \
	"$(metric "$dout" desktop-guest-MiB)" "$(ratio "$(metric "$dout" desktop-idle-host-MiB)" "$(metric "$dout" desktop-guest-MiB)")"
bench_record --id vm-desktop-ready --area "Full VMs" --unit ms \
	--title "create to a settled Xfce desktop in a full VM, p50 ($A)" --value "$(metric "$dout" desktop-ready-p50-ms)" \
	--target-text "on hardware KVM: <= 15 s"
bench_record --id vm-desktop-screenshot --area "Full VMs" --unit ms \
	--title "a screenshot of a full VM's desktop through the SDK, p50 ($A)" --value "$(metric "$dout" desktop-screenshot-p50-ms)" \
	--baseline "$(metric "$out" screenshot-p50-ms)" --baseline-what "the console's" \
	--ratio "$(ratio "$(metric "$dout" desktop-screenshot-p50-ms)" "$(metric "$out" screenshot-p50-ms)")" \
	--target-text "on hardware KVM: <= 50 ms"
bench_record --id vm-desktop-input --area "Full VMs" --unit ms \
	--title "a key typed into a terminal on a full VM's desktop to a screenshot showing it, p50 ($A)" \
	--value "$(metric "$dout" desktop-input-p50-ms)" --baseline "$(metric "$out" input-p50-ms)" --baseline-what "the console's" \
	--ratio "$(ratio "$(metric "$dout" desktop-input-p50-ms)" "$(metric "$out" input-p50-ms)")" \
	--target-text "on hardware KVM: <= 150 ms (a key is held 100 ms)"
bench_record --id vm-desktop-idle-memory --area "Full VMs" --unit MiB \
	--title "host memory of an idle full VM's Xfce desktop vs the RAM it was given ($A)" \
	--value "$(metric "$dout" desktop-idle-host-MiB)" --baseline "$(metric "$dout" desktop-guest-MiB)" --baseline-what "its RAM" \
	--ratio "$(ratio "$(metric "$dout" desktop-idle-host-MiB)" "$(metric "$dout" desktop-guest-MiB)")"
