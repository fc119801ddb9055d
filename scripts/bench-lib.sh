# shellcheck shell=bash
# Sourced by the scripts/bench-*.sh that make bench runs. bench_record puts one figure the script prints into
# bench/results.json (BENCH_RESULTS), through scripts/benchtable, with the command that reproduces it (the script
# as it was run, with the BENCH_* and DSEC_BENCH_* settings it was given), the machine (BENCH_MACHINE, else what
# /proc says) and today's date; make bench-table renders the table at the top of BENCHMARKS.md from that file.
# BENCH_NO_RECORD=1 records nothing. A figure that cannot be recorded (its benchmark skipped) is said on stderr
# and the script goes on.
BENCH_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BENCH_RESULTS=${BENCH_RESULTS:-$BENCH_REPO/bench/results.json}

# bench_command ARGS...: the script's command line, with the settings that change what it measures.
bench_command() {
	local v val env=""
	for v in $(compgen -e | grep -E '^(BENCH_|DSEC_BENCH_|DSEC_DENSITY_N$|DSEC_EMULATE_REMOTE$|DSEC_CACHE_|DSEC_ADMISSION_)' |
		grep -vE '^BENCH_(RESULTS|DIR|ROOTFS|MACHINE|NO_RECORD)$' | sort); do
		val=${!v}
		[[ $val =~ ^[A-Za-z0-9_.,:=/+-]*$ ]] || val="'$val'"
		env+="$v=$val "
	done
	echo "${env}scripts/$(basename "$0")${*:+ $*}"
}
BENCH_CMD=$(bench_command "$@")

bench_machine() {
	local model mem
	model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
	mem=$(awk '/MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo)
	echo "$(nproc)-core, $mem GiB${model:+, $model}, kernel $(uname -r)"
}
BENCH_MACHINE=${BENCH_MACHINE:-$(bench_machine)}

benchtable() {
	if [ -n "${BENCHTABLE:-}" ]; then "$BENCHTABLE" "$@"; else (cd "$BENCH_REPO" && go run ./scripts/benchtable "$@"); fi
}

# bench_record --id ID --area AREA --title TITLE --value V --unit U [--baseline V --baseline-what WHAT]
#	[--ratio R] [--ratio-of baseline/dsec|dsec-baseline] [--target CHECK --target-text TEXT]
bench_record() {
	[ -z "${BENCH_NO_RECORD:-}" ] || return 0
	benchtable record --file "$BENCH_RESULTS" --command "$BENCH_CMD" --machine "$BENCH_MACHINE" "$@" ||
		echo "$(basename "$0"): not recorded in $BENCH_RESULTS: $*" >&2
}
