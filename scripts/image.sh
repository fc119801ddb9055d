#!/bin/sh
# image.sh OUT.tar NAME:TAG FILE:PATH...: an OCI image archive of static
# files (each FILE at PATH, mode kept), no base image, its entrypoint the
# first PATH, built with umoci and imported with
# `ctr images import --base-name NAME OUT.tar` (the archive's ref is TAG).
# The image's /bin, /sbin, /lib and /lib64 point into /usr, so that a pod
# that mounts the host's /usr (the worker: mkfs.btrfs and friends) runs
# the host's tools as they are.
set -eu
out=${1:?usage: image.sh OUT.tar NAME:TAG FILE:PATH...}
ref=${2:?usage: image.sh OUT.tar NAME:TAG FILE:PATH...}
shift 2
tag=${ref##*:}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
umoci init --layout "$tmp/layout"
umoci new --image "$tmp/layout:$tag"
umoci unpack --image "$tmp/layout:$tag" "$tmp/bundle" >/dev/null
rootfs=$tmp/bundle/rootfs
mkdir -p "$rootfs/usr" "$rootfs/tmp" "$rootfs/etc" "$rootfs/var/lib" "$rootfs/proc" "$rootfs/sys" "$rootfs/dev"
chmod 1777 "$rootfs/tmp"
for d in bin sbin lib lib64; do ln -s "usr/$d" "$rootfs/$d"; done
echo "root:x:0:0:root:/:/bin/sh" > "$rootfs/etc/passwd"
echo "root:x:0:" > "$rootfs/etc/group"
entry=
for f in "$@"; do
	src=${f%%:*}
	dst=${f#*:}
	install -D -m "$(stat -c %a "$src")" "$src" "$rootfs$dst"
	entry=${entry:-$dst}
done
umoci repack --image "$tmp/layout:$tag" "$tmp/bundle" >/dev/null
umoci config --image "$tmp/layout:$tag" --config.entrypoint "$entry" \
	--config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --config.workingdir /
umoci gc --layout "$tmp/layout"
tar -C "$tmp/layout" -cf "$out.tmp" .
mv "$out.tmp" "$out"
