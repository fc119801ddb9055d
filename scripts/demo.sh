#!/usr/bin/env bash
# The main job end to end on the embedded default (the local store):
# build base, workspace and toolkit layers from real trees, list and
# inspect them, check them with fsck.erofs and run a program from one.
set -euo pipefail
dsec=$(realpath "${1:-bin/dsec}")
export DSEC_ROOT=${DSEC_ROOT:-$PWD/.demo/root}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
step() { printf '\n\033[1m== %s\033[0m\n' "$*" >&2; }

step "base layer: a busybox root file system (from Debian's busybox-static)"
mkdir -p "$work/rootfs"/{bin,etc,tmp,root}
cp /bin/busybox "$work/rootfs/bin/busybox"
for applet in $(/bin/busybox --list); do [ "$applet" = busybox ] || ln -sf busybox "$work/rootfs/bin/$applet"; done
printf 'root:x:0:0:root:/root:/bin/sh\n' >"$work/rootfs/etc/passwd"
chmod 1777 "$work/rootfs/tmp"
"$dsec" layer build "$work/rootfs" --kind base -t demo/busybox:1 --force

step "workspace layer: the Go source tree, streamed as tar.gz on stdin (nothing extracted)"
tar czf - -C /usr/local/go src | "$dsec" layer build - --kind workspace -t demo/go-src:1 --force --json

step "toolkit layer: a harness directory"
mkdir -p "$work/toolkit/opt/harness"
printf '#!/bin/sh\necho "harness ready in $(pwd)"\n' >"$work/toolkit/opt/harness/run"
chmod 755 "$work/toolkit/opt/harness/run"
"$dsec" layer build "$work/toolkit" --kind toolkit -t demo/harness:1 --force

step "the store"
"$dsec" layer ls
"$dsec" layer inspect demo/go-src:1

step "same tree, same digest: rebuilding the base layer"
again=$("$dsec" layer build "$work/rootfs" --kind base -t demo/busybox:rebuilt --force)
first=$("$dsec" layer inspect demo/busybox:1 --json | sed -n 's/.*"digest": "\(sha256:[0-9a-f]*\)".*/\1/p' | head -1)
echo "first build  $first"
echo "second build $again"
[ "$first" = "$again" ] || { echo "demo: digests differ" >&2; exit 1; }

step "the base layer is a valid EROFS image; run busybox from it"
blob="$DSEC_ROOT/store/blobs/sha256/${first#sha256:}"
fsck.erofs "$blob"
fsck.erofs --extract="$work/extracted" "$blob" >/dev/null
"$work/extracted/bin/busybox" echo "hello from inside the layer"

step "rm and gc"
"$dsec" layer rm demo/busybox:rebuilt
"$dsec" layer gc
echo "demo done: state is in $DSEC_ROOT (make clean removes it)" >&2
