#!/usr/bin/env bash
# make bench (as root): importing a registry image. One multi-layer image (a Debian root, a toolchain layer over it,
# a repository layer) from a registry on 127.0.0.1: dsec image pull into a fresh store vs containerd's ctr pull
# (Debian's containerd, overlayfs snapshotter, unpacked) into a fresh root, alternating; wall time, bytes written,
# bytes kept on disk.
set -euo pipefail
# shellcheck source=scripts/bench-lib.sh
. "$(dirname "$0")/bench-lib.sh"
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
printf '%-44s %10s s %10s s %8s %s\n' "import time, --compress" "$(metric "$r" dsec-z-s)" "$(metric "$r" ctr-s)" \
	"$(ratio "$(metric "$r" dsec-z-s)" "$(metric "$r" ctr-s)")" "<= 0.7x"
printf '%-44s %9s MB %9s MB %8s %s\n' "bytes written, --compress" "$(metric "$r" dsec-z-written-MB)" "$(metric "$r" ctr-written-MB)" \
	"$(ratio "$(metric "$r" dsec-z-written-MB)" "$(metric "$r" ctr-written-MB)")" "<= 0.5x"
printf '%-44s %9s MB %9s MB %8s\n' "bytes kept on disk, --compress" "$(metric "$r" dsec-z-disk-MB)" "$(metric "$r" ctr-disk-MB)" \
	"$(ratio "$(metric "$r" dsec-z-disk-MB)" "$(metric "$r" ctr-disk-MB)")"
im() { # id title value-metric baseline-metric baseline-what unit [flags]
	local id=$1 title=$2 v b what=$5 unit=$6
	v=$(metric "$r" "$3"); b=$(metric "$r" "$4"); shift 6
	bench_record --id "image-$id" --area "Images from registries" --title "$title" --unit "$unit" \
		--value "$v" --baseline "$b" --baseline-what "$what" --ratio "$(ratio "$v" "$b")" "$@"
}
ctr="\`ctr images pull\` (containerd 1.6, unpacked)"
im import-time "a three-layer image from a registry on 127.0.0.1: \`dsec image pull\`, time" dsec-s ctr-s "$ctr" s --target "<= 0.7x"
im import-written "the same: bytes written" dsec-written-MB ctr-written-MB "$ctr" MB --target "<= 0.5x"
im import-kept "the same: bytes kept on disk" dsec-disk-MB ctr-disk-MB "$ctr" MB
im import-z-time "the same image, \`dsec image pull --compress\` (its files LZ4-compressed): time" dsec-z-s ctr-s "$ctr" s --target "<= 0.7x"
im import-z-written "the same, --compress: bytes written" dsec-z-written-MB ctr-written-MB "$ctr" MB --target "<= 0.5x"
im import-z-kept "the same, --compress: bytes kept on disk" dsec-z-disk-MB ctr-disk-MB "$ctr" MB

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
im swe-unique "20 SWE-bench-like images in one store: what the store keeps vs their unique file content" stored-MB unique-MB "the unique file content" MB --target "<= 1.1x"
im swe-listed "the same: what the store keeps vs their compressed sizes, summed per image" stored-MB listed-MB "the sizes a registry lists" MB

# A cold host's second image: A and B (SWE-bench-like: the Debian root and the toolchain shared, an environment layer
# each with 7 of 8 packages the same, a repository each) pushed to a shared remote by another host; this host's worker
# runs a sandbox on A, then one on B, each reading its packages and repository: what it fetches for B against what A
# did not have (B's own package and repository). Twice a round: from a remote that keeps layers whole, and from one
# that packs them into shared chunks.
r=$(go test -run '^$' -bench 'BenchmarkColdHostImages$' -benchtime 1x -timeout 30m ./sdk/)
echo "== a cold host: image B after image A (lazily from the shared remote)"
printf '%-44s %10s %10s\n' "" packed whole
printf '%-44s %6s MiB %6s MiB\n' "fetched for A" "$(metric "$r" A-fetched-MiB)" "$(metric "$r" whole-A-fetched-MiB)"
printf '%-44s %6s MiB %6s MiB (B'"'"'s own layers: %s MiB)\n' "fetched for B" "$(metric "$r" B-fetched-MiB)" \
	"$(metric "$r" whole-B-fetched-MiB)" "$(metric "$r" B-own-layers-MiB)"
printf '%-44s %6s MiB %8s %s\n' "what A did not have" "$(metric "$r" B-unseen-MiB)" \
	"$(ratio "$(metric "$r" B-fetched-MiB)" "$(metric "$r" B-unseen-MiB)")" "<= 1.1x (packed)"
printf '%-44s %7s ms %7s ms %8s\n' "B: create to first exec done" "$(metric "$r" B-first-exec-ms)" \
	"$(metric "$r" whole-B-first-exec-ms)" "$(ratio "$(metric "$r" B-first-exec-ms)" "$(metric "$r" whole-B-first-exec-ms)")"
im cold-host "a cold host's image B after image A (7 of 8 packages the same, in layers of their own), from a remote that packs: bytes fetched for B vs what A did not have" \
	B-fetched-MiB B-unseen-MiB "what A did not have (B's own package and repository)" MiB --target "<= 1.1x"
im cold-host-whole "the same from a remote that keeps layers whole" \
	whole-B-fetched-MiB B-unseen-MiB "what A did not have" MiB
im cold-host-time "the same: B's create to first exec done, packed remote vs whole" \
	B-first-exec-ms whole-B-first-exec-ms "the same from a remote that keeps layers whole" ms
