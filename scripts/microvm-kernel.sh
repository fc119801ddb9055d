#!/usr/bin/env bash
# microvm-kernel.sh DEST (make kernel): the microVM backend's guest kernel, Debian's, taken from its .deb without
# installing it. apt-get download fetches the package linux-image-amd64 depends on today (Debian replaces kernel
# packages as it patches them, so no version is pinned here) and verifies it against the signed archive; the kernel
# is unpacked into DEST:
#   DEST/vmlinux    the kernel uncompressed (an ELF image QEMU boots directly, through PVH: no decompression in the
#                   guest, which costs seconds under TCG)
#   DEST/modules/   its modules (lib/modules/RELEASE), from which dsec builds the guest's initramfs
#   DEST/release    "RELEASE PACKAGE-VERSION", e.g. "6.1.0-48-amd64 6.1.172-1": what dsec version and every
#                   microVM sandbox's state record
# Idempotent: a DEST already holding the kernel of today's package is left as it is. Needs root (apt-get) or the .deb
# in DSEC_KERNEL_DEB.
set -euo pipefail
dest=${1:?usage: microvm-kernel.sh DEST}
mkdir -p "$(dirname "$dest")"
dest=$(cd "$(dirname "$dest")" && pwd)/$(basename "$dest")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
if [ -n "${DSEC_KERNEL_DEB:-}" ]; then
	deb=$DSEC_KERNEL_DEB
else
	pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
	if [ -z "$pkg" ]; then
		apt-get update -qq >/dev/null
		pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
	fi
	[ -n "$pkg" ] || { echo "microvm-kernel: no package linux-image-amd64 depends on: is this Debian (apt-cache policy linux-image-amd64)?" >&2; exit 1; }
	ver=$(apt-cache show --no-all-versions "$pkg" | awk '/^Version:/ { print $2; exit }')
	if [ -f "$dest/release" ] && [ "$(cat "$dest/release")" = "${pkg#linux-image-} $ver" ] && [ -f "$dest/vmlinux" ]; then
		exit 0
	fi
	echo "microvm-kernel: fetching $pkg $ver into $dest" >&2
	# As root apt warns that it cannot drop to _apt in a private directory: the download is verified either way.
	apt-get download -qq "$pkg" 2>&1 | grep -v 'unsandboxed as root' >&2 || true
	deb=$(ls "$work"/"$pkg"_*.deb)
fi
dpkg-deb -x "$deb" x
release=$(ls x/lib/modules)
ver=$(dpkg-deb -f "$deb" Version)
vmlinuz=x/boot/vmlinuz-$release
# The bzImage holds the kernel xz-compressed after its setup code: the first xz stream is the kernel.
off=$(grep -abo $'\xfd7zXZ\x00' "$vmlinuz" | head -1 | cut -d: -f1)
[ -n "$off" ] || { echo "microvm-kernel: $vmlinuz holds no xz stream: a kernel compressed otherwise" >&2; exit 1; }
tail -c +$((off + 1)) "$vmlinuz" | xz -dc --single-stream > vmlinux 2>/dev/null || true
head -c 4 vmlinux | grep -q ELF || { echo "microvm-kernel: no ELF kernel in $vmlinuz" >&2; exit 1; }
new=$dest.new.$$
rm -rf "$new"
mkdir -p "$new"
mv vmlinux "$new/vmlinux"
mv "x/lib/modules/$release" "$new/modules"
cp "x/boot/config-$release" "$new/config"
echo "$release $ver" > "$new/release"
rm -rf "$dest.old.$$"
[ ! -e "$dest" ] || mv "$dest" "$dest.old.$$"
mv "$new" "$dest"
rm -rf "$dest.old.$$"
echo "microvm-kernel: $release ($ver) in $dest" >&2
