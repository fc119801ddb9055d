#!/usr/bin/env bash
# clean.sh DIR... (make clean): removes what the demo and the benchmarks left under DIR, sandboxes first. Each dsec
# root below DIR (a directory holding sandboxes/) gets its sandboxes removed and its worker stopped through bin/dsec
# (which starts a worker where none serves: the sandboxes outlive theirs), so that no process, cgroup or mount of
# theirs outlives the directories; then what is still mounted below DIR is unmounted and DIR removed.
set -uo pipefail
dsec=${DSEC:-bin/dsec}
for dir in "$@"; do
	[ -e "$dir" ] || continue
	if [ -x "$dsec" ] && [ "$(id -u)" = 0 ]; then
		while IFS= read -r s; do
			root=$(dirname "$s")
			names=$(DSEC_ROOT=$root "$dsec" ps -q 2>/dev/null)
			[ -z "$names" ] || DSEC_ROOT=$root "$dsec" rm -f $names >/dev/null || echo "clean: could not remove the sandboxes of $root" >&2
			DSEC_ROOT=$root "$dsec" daemon stop >/dev/null 2>&1 || true
		done < <(find "$dir" -maxdepth 3 -type d -name sandboxes 2>/dev/null)
	fi
	abs=$(cd "$dir" && pwd)
	awk -v d="$abs" '$5 == d || index($5, d "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r | xargs -r -n1 umount -l
	rm -rf "$dir"
done
