#!/usr/bin/env bash
# clean.sh DIR... (make clean): removes what the demo and the benchmarks left under DIR, sandboxes first. Each dsec
# root below DIR (a directory holding sandboxes/ or a worker's lock) gets its sandboxes removed and its worker stopped
# through bin/dsec (which starts a worker where none serves: the sandboxes outlive theirs), so that no process, cgroup
# or mount of theirs outlives the directories: a worker stopped on purpose takes along what it made ahead of need
# (spare inits, primed sandboxes, pools' warm sandboxes) before it exits. One that has not exited when dsec daemon
# stop gives up is killed, and the worker started next removes what it made ahead. Then what is still mounted below
# DIR is unmounted and DIR removed. DSEC names the dsec to use (a path, or a command on PATH).
set -uo pipefail
dsec=$(command -v "${DSEC:-bin/dsec}")
for dir in "$@"; do
	[ -e "$dir" ] || continue
	if [ -n "$dsec" ] && [ "$(id -u)" = 0 ]; then
		while IFS= read -r root; do
			names=$(DSEC_ROOT=$root "$dsec" ps -q 2>/dev/null)
			[ -z "$names" ] || DSEC_ROOT=$root "$dsec" rm -f $names >/dev/null || echo "clean: could not remove the sandboxes of $root" >&2
			if ! DSEC_ROOT=$root "$dsec" daemon stop >/dev/null; then
				kill -9 "$(cat "$root/worker.pid" 2>/dev/null)" 2>/dev/null
				DSEC_ROOT=$root "$dsec" ps -q >/dev/null 2>&1 # starts the next worker, which sweeps
				DSEC_ROOT=$root "$dsec" daemon stop >/dev/null || echo "clean: the worker of $root does not stop" >&2
			fi
		done < <(find "$dir" -maxdepth 3 \( -name sandboxes -o -name worker.lock \) -printf '%h\n' 2>/dev/null | sort -u)
	fi
	abs=$(cd "$dir" && pwd)
	awk -v d="$abs" '$5 == d || index($5, d "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r | xargs -r -n1 umount -l
	rm -rf "$dir"
done
