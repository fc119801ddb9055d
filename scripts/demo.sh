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

step "share: push the layers to a dir: remote (a 3FS/NFS mount in a fleet; a local path here)"
shared="$(dirname "$DSEC_ROOT")/shared"
"$dsec" layer push demo/go-src:1 "dir://$shared"
"$dsec" layer push demo/busybox:1 "dir://$shared"

step "a second host mounts the workspace lazily: metadata first, file data only when read"
export DSEC_ROOT_HOST2="$(dirname "$DSEC_ROOT")/host2"
mnt="$work/ws"
mkdir -p "$mnt"
if [ "$(id -u)" = 0 ]; then
	DSEC_ROOT=$DSEC_ROOT_HOST2 "$dsec" layer mount demo/go-src:1 "$mnt" --from "dir://$shared" >/dev/null
	echo "files in the workspace: $(find "$mnt" -type f | wc -l)"
	head -3 "$mnt/src/fmt/print.go"
	DSEC_ROOT=$DSEC_ROOT_HOST2 "$dsec" layer stats demo/go-src:1
	DSEC_ROOT=$DSEC_ROOT_HOST2 "$dsec" layer umount "$mnt"
else
	echo "(skipped: mounting needs root)"
fi

step "rm and gc"
"$dsec" layer rm demo/busybox:rebuilt
"$dsec" layer gc
echo "demo done: state is in $DSEC_ROOT (make clean removes it)" >&2
