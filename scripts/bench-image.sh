#!/usr/bin/env bash
# make bench (as root): importing a registry image. One multi-layer image (a Debian root, a toolchain layer over it,
# a repository layer) from a registry on 127.0.0.1: dsec image pull into a fresh store vs containerd's ctr pull
# (Debian's containerd, overlayfs snapshotter, unpacked) into a fresh root, alternating; wall time, bytes written,
# bytes kept on disk.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "bench-image: needs root (mounts, containerd): skipped" >&2; exit 0; }
n=${BENCH_N:-3}
metric() { awk -v m="$2" '{for (i = 2; i <= NF; i++) if ($i == m) print $(i-1)}' <<<"$1"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", a / b }'; }

r=$(go test -run '^$' -bench 'BenchmarkImport$' -benchtime "${n}x" -timeout 30m ./internal/layer/image/)
echo "== image import vs ctr pull ($(nproc)-core VM; $(date -u +%F); $n runs each)"
printf '%-44s %12s %12s %8s %s\n' figure dsec ctr ratio target
printf '%-44s %10s s %10s s %8s %s\n' "import time" "$(metric "$r" dsec-s)" "$(metric "$r" ctr-s)" \
	"$(ratio "$(metric "$r" dsec-s)" "$(metric "$r" ctr-s)")" "<= 0.7x"
printf '%-44s %9s MB %9s MB %8s %s\n' "bytes written" "$(metric "$r" dsec-written-MB)" "$(metric "$r" ctr-written-MB)" \
	"$(ratio "$(metric "$r" dsec-written-MB)" "$(metric "$r" ctr-written-MB)")" "<= 0.5x"
printf '%-44s %9s MB %9s MB %8s\n' "bytes kept on disk" "$(metric "$r" dsec-disk-MB)" "$(metric "$r" ctr-disk-MB)" \
	"$(ratio "$(metric "$r" dsec-disk-MB)" "$(metric "$r" ctr-disk-MB)")"

# 20 images built as SWE-bench's (one Debian root and one toolchain layer shared, an environment layer of 8 of 30
# packages and a repository layer each): what the store keeps against the registry's listed sizes and the unique content.
r=$(go test -run '^$' -bench 'BenchmarkSWEBenchImages$' -benchtime 1x -timeout 30m ./internal/layer/image/)
echo "== 20 SWE-bench-like images: stored vs listed and unique content"
printf '%-44s %10s MB\n' "stored (du of the store)" "$(metric "$r" stored-MB)"
printf '%-44s %10s MB %8s\n' "their compressed sizes, summed per image" "$(metric "$r" listed-MB)" \
	"$(ratio "$(metric "$r" stored-MB)" "$(metric "$r" listed-MB)")"
printf '%-44s %10s MB\n' "the registry's blobs (du)" "$(metric "$r" registry-MB)"
printf '%-44s %10s MB %8s %s\n' "unique file content" "$(metric "$r" unique-MB)" \
	"$(ratio "$(metric "$r" stored-MB)" "$(metric "$r" unique-MB)")" "<= 1.1x"
