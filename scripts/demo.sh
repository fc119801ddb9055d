#!/usr/bin/env bash
# The main job end to end on the embedded default (the local store, the
# container backend): build base, workspace and toolkit layers from real
# trees, list and inspect them, check them with fsck.erofs, share them,
# mount them lazily on a second host, and run stateful sandboxes on them
# through the worker: steps that persist, run exactly once and survive
# the worker's kill -9.
set -euo pipefail
dsec=$(realpath "${1:-bin/dsec}")
export DSEC_ROOT=${DSEC_ROOT:-$PWD/.demo/root}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
step() { printf '\n\033[1m== %s\033[0m\n' "$*" >&2; }
# outside_ns NS LINK NET: the outside world, a network namespace NS reached through the veth pair LINK (the host's
# side, NET.1/30) and LINKi (in NS, NET.2/30); made anew if an interrupted demo left one.
outside_ns() {
	ip netns del "$1" 2>/dev/null || true
	ip link del "$2" 2>/dev/null || true
	ip netns add "$1"
	ip link add "$2" type veth peer name "$2i"
	ip link set "$2i" netns "$1"
	ip addr add "$3.1/30" dev "$2" && ip link set "$2" up
	ip -n "$1" addr add "$3.2/30" dev "$2i" && ip -n "$1" link set "$2i" up
}

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
rm -rf "$shared" # a rerun starts from an empty remote (an earlier run's snapshots differ)
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

step "profile-guided layout: record what a step reads, lay exactly that out first, fetch less"
if [ "$(id -u)" = 0 ]; then
	# demo_step HOST TAG [--record]: a cold host mounts demo/go-src:TAG lazily and reads two packages
	demo_step() {
		local host=$1 tag=$2; shift 2
		rm -rf "$host"; mkdir -p "$work/rec"
		DSEC_ROOT=$host "$dsec" layer mount "demo/go-src:$tag" "$work/rec" --from "dir://$shared" "$@" >/dev/null
		cat "$work/rec/src/fmt/"*.go "$work/rec/src/strconv/"*.go >/dev/null
		fetched=$(DSEC_ROOT=$host "$dsec" layer stats "demo/go-src:$tag" --json | sed -n 's/.*"windows_fetched": \([0-9]*\).*/\1/p')
		DSEC_ROOT=$host "$dsec" layer umount "$work/rec"
	}
	demo_step "$work/host3" 1 --record
	before=$fetched
	for _ in $(seq 100); do [ -e "$work/host3/cache/"*/access ] && break; sleep 0.1; done # saved as the fetcher exits
	DSEC_ROOT=$work/host3 "$dsec" layer profile demo/go-src:1 -o "$work/step.profile"
	echo "the step read $(wc -l <"$work/step.profile") files; first ones:"; head -3 "$work/step.profile" | cut -c1-80
	mkdir -p "$work/go-dir" && cp -a /usr/local/go/src "$work/go-dir/src" # the same tree, as a directory: orderable
	"$dsec" layer build "$work/go-dir" --kind workspace -t demo/go-src:2 --force --order "$work/step.profile" >/dev/null
	"$dsec" layer inspect demo/go-src:2 --json | grep -A 3 '"hot"'
	"$dsec" layer push demo/go-src:2 "dir://$shared" >/dev/null
	demo_step "$work/host4" 2
	echo "windows fetched by the same step on a cold host: $before on the path-order layout, $fetched laid out by its profile"
	[ "$fetched" -lt "$before" ] || { echo "demo: the ordered layout fetched no fewer windows" >&2; exit 1; }
fi

if [ "$(id -u)" = 0 ]; then
	step "a sandbox: toolkit over workspace over base, the worker started on demand"
	"$dsec" run --rm --base demo/busybox:1 --workspace demo/go-src:1 --toolkit demo/harness:1 --workdir /src -- /opt/harness/run

	step "a microVM on the same layers: a kernel of its own (a QEMU guest; under TCG on a host without hardware KVM)"
	"$dsec" version | grep '^microVMs'
	"$dsec" run --rm --backend microvm --base demo/busybox:1 --workspace demo/go-src:1 --toolkit demo/harness:1 --workdir /src \
		-- sh -c 'echo "kernel $(uname -r), $(nproc) vCPU"; head -3 /src/fmt/print.go | tail -1; /opt/harness/run'
	"$dsec" run --rm --base demo/busybox:1 --workspace demo/go-src:1 -- sh -c 'echo "kernel $(uname -r): the host'"'"'s"; head -3 /src/fmt/print.go | tail -1'
	# A pool keeps guests booted and paused: a call takes one at once.
	"$dsec" pool resize demo-vms 1 --backend microvm --base demo/busybox:1 --memory 256M
	for _ in $(seq 600); do "$dsec" pool ls --json | grep -q '"warm": 1' && break; sleep 0.1; done
	time "$dsec" run --backend fncall --pool demo-vms -- sh -c 'echo "a warm guest: $(hostname)"'
	"$dsec" pool rm demo-vms

	step "a microVM's memory snapshot: its server, branched three ways, goes on serving in each, each its own"
	"$dsec" rm -f demo-vm demo-vm-1-1 demo-vm-1-2 demo-vm-1-3 >/dev/null 2>&1 || true # an interrupted earlier demo's
	"$dsec" snap rm demo-vm:1 >/dev/null 2>&1 || true
	"$dsec" run -d --name demo-vm --backend microvm --base demo/busybox:1 --memory 256M
	# A server whose state is in its memory alone: it counts the requests it answered (each answer made
	# once a request came, by a shell that reads it: the host name is the answering guest's).
	"$dsec" exec demo-vm -- sh -c '(n=0; while :; do n=$((n+1)); nc -l -p 8080 -e sh -c "while read -r l && [ \"\$l\" != \"\$(printf \"\\r\")\" ]; do :; done;
		printf \"HTTP/1.0 200 OK\r\n\r\nrequest $n, answered by %s\n\" \$(hostname)"; done) >/dev/null 2>&1 </dev/null & sleep 1'
	# (The server listens again a moment after each answer: a request retries until it does.)
	get() { "$dsec" exec "$1" -- sh -c 'for i in $(seq 20); do wget -q -O - http://127.0.0.1:8080/ 2>/dev/null && exit 0; sleep 0.2; done; exit 1'; }
	get demo-vm
	get demo-vm
	"$dsec" snap pack-diff demo-vm -t demo-vm:1 --memory
	"$dsec" snap branch demo-vm:1 -n 3
	for i in 1 2 3; do
		for _ in $(seq "$i"); do get "demo-vm-1-$i"; done
	done
	get demo-vm
	"$dsec" ps
	"$dsec" rm -f demo-vm demo-vm-1-1 demo-vm-1-2 demo-vm-1-3

	step "a stateful sandbox for a rollout: steps keep files and processes"
	"$dsec" rm -f demo-rollout demo-branch-1 demo-branch-2 demo-branch-3 >/dev/null 2>&1 || true # an interrupted earlier demo's
	"$dsec" run -d --name demo-rollout --base demo/busybox:1 --workspace demo/go-src:1 --toolkit demo/harness:1 \
		--memory 256M --cpu 1 --env STEP_LOG=/var/log/steps --workdir /src
	"$dsec" exec --id step-1 demo-rollout -- sh -c 'mkdir -p /var/log; echo "step 1 in $(hostname), pid $$" | tee -a $STEP_LOG; sleep 3600 &'
	"$dsec" exec --id step-2 demo-rollout -- sh -c 'wc -l fmt/print.go >> $STEP_LOG; cat $STEP_LOG'
	"$dsec" ps

	step "exactly once: a retried step replays its recorded output instead of running again"
	"$dsec" exec --id step-2 demo-rollout -- sh -c 'wc -l fmt/print.go >> $STEP_LOG; cat $STEP_LOG'

	step "the worker is killed (kill -9); the sandbox runs on and the next worker re-adopts it"
	pid=$(cat "$DSEC_ROOT/worker.pid")
	kill -9 "$pid"
	# A client that reaches the dying worker gets an infrastructure error (a retry with the same id
	# is safe); the demo waits for its death, as a restart would.
	while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
	"$dsec" exec --id step-3 demo-rollout -- sh -c 'ps | grep "[s]leep 3600"; cat $STEP_LOG'

	step "a memory limit hit is reported as such"
	"$dsec" exec demo-rollout -- sh -c 'x=$(head -c 400000000 /dev/zero | tr "\\0" a)' || echo "exit code $?"

	step "--userns: root in the sandbox owns its files and is nobody on the host"
	"$dsec" run --rm --userns --base demo/busybox:1 -- sh -c 'echo "uid $(id -u) in the sandbox, owner of /bin/busybox: $(stat -c %u /bin/busybox); uid_map: $(cat /proc/self/uid_map)"'

	step "snapshot the rollout at step 3 (pack-diff) and branch it three ways"
	"$dsec" snap rm -f demo/rollout:3 demo/rollout:4 >/dev/null 2>&1 || true # an interrupted earlier demo's
	"$dsec" snap pack-diff demo-rollout -t demo/rollout:3
	"$dsec" snap branch demo/rollout:3 -n 3 --name-prefix demo-branch
	for i in 1 2 3; do
		"$dsec" exec "demo-branch-$i" -- sh -c "echo 'branch $i tries its own step 4' >> \$STEP_LOG; tail -2 \$STEP_LOG"
	done
	"$dsec" exec --id step-4 demo-rollout -- sh -c 'echo "step 4 on the original" >> $STEP_LOG'
	"$dsec" snap pack-diff demo-rollout -t demo/rollout:4
	"$dsec" snap ls --tree
	# A snapshot is a layer: push takes the layers it stands on along.
	"$dsec" layer push demo/rollout:4 "dir://$shared"

	step "policy: root in the sandbox meets the seccomp allowlist and an egress allowlist, changed live"
	printf 'apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egress:\n    - to: 127.0.0.1/32\n      ports: [18081]\n      protocol: tcp\n' >"$work/one-port.yaml"
	"$dsec" policy validate "$work/one-port.yaml"
	"$dsec" policy apply demo-rollout -f "$work/one-port.yaml"
	"$dsec" exec demo-rollout -- sh -c 'nc 127.0.0.1 18082; nc 127.0.0.1 18081; mount -t tmpfs none /mnt; unshare -n true' || true
	"$dsec" run --rm --base demo/busybox:1 -- sh -c 'id -u; echo 42 > /etc/answer; cat /etc/answer; chroot / true && echo "chroot allowed by the default"'
	# File rules: a hidden tree, writes confined to /tmp (Landlock), even for root.
	printf 'apiVersion: dsec/v1\nkind: Policy\nfiles:\n  hidden: [/etc]\n  readWrite: [/tmp]\n' >"$work/files.yaml"
	"$dsec" run --rm --base demo/busybox:1 --policy "$work/files.yaml" -- \
		sh -c 'echo "/etc shows $(ls -A /etc | wc -l) entries"; echo x > /root/x; echo x > /tmp/ok && echo "/tmp is writable"' || true
	# Devices: root makes any node it likes; only the devices of its /dev open (a loop device holds
	# another sandbox's disk, /dev/kvm the host's hypervisor). Netlink still answers ip.
	"$dsec" run --rm --base demo/busybox:1 -- sh -c 'mknod /tmp/loop0 b 7 0 && mknod /tmp/kvm c 10 232 && echo "root made /tmp/loop0 and /tmp/kvm";
		head -c1 /tmp/loop0; head -c1 /tmp/kvm; mkdir -p /dev/x && mknod /dev/x/kvm c 10 232 && head -c1 /dev/x/kvm;
		echo "/dev/null still opens: $(echo ok > /dev/null && echo yes)"; ip -o -4 addr show lo' || true
	# NAT: a sandbox whose allowlist allows every address reaches a server outside the host, and
	# neither the host's own service (on every address) nor its gateway.
	if command -v ip >/dev/null; then
		outside_ns dsec-demo-out dsec-demo-o 10.201.0
		ip netns exec dsec-demo-out busybox nc -ll -p 8080 -e echo "hello from outside the host" &
		outside=$!
		busybox nc -ll -p 18090 -e echo "the host's own service" &
		hostsvc=$!
		trap 'kill $outside $hostsvc 2>/dev/null || true; ip netns del dsec-demo-out 2>/dev/null || true; rm -rf "$work"' EXIT
		printf 'apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  mode: nat\n  egress:\n    - to: 0.0.0.0/0\n    - to: 10.201.0.0/16\n' >"$work/nat.yaml"
		"$dsec" policy validate "$work/nat.yaml"
		"$dsec" run --rm --base demo/busybox:1 --policy "$work/nat.yaml" -- sh -c 'gw=$(ip route | awk "/default/ {print \$3}");
			for i in 1 2 3 4 5; do nc -w 2 10.201.0.2 8080 </dev/null && break; sleep 0.2; done;
			echo "the host at its gateway $gw:"; nc -w 2 $gw 18090 </dev/null 2>&1;
			echo "the host at 10.201.0.1, its address on the outside link:"; nc -w 2 10.201.0.1 18090 </dev/null 2>&1;
			echo "the metadata address:"; nc -w 2 169.254.169.254 80 </dev/null 2>&1' || true
		printf 'apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egress:\n    - to: 169.254.169.254\n' >"$work/metadata.yaml"
		"$dsec" policy validate "$work/metadata.yaml" || true
		kill $outside $hostsvc 2>/dev/null || true
		ip netns del dsec-demo-out
		trap 'rm -rf "$work"' EXIT
	fi
	# Domain rules: a sandbox allowed allowed.test resolves it through its own resolver in the worker (whatever
	# server it asks) and reaches it by name over HTTPS (the fast path: its resolver answered that address, so the
	# worker's gate reads the hello as it passes and the kernel carries the rest); evil.test, on the very same
	# address, neither resolves nor connects (the gate reads the hello's name and resets the connection). The outside
	# world: the demo's own DNS and HTTPS server in a network namespace.
	if command -v ip >/dev/null && command -v openssl >/dev/null && command -v go >/dev/null; then
		outside_ns dsec-demo-web dsec-demo-w 198.51.100
		openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=allowed.test \
			-addext "subjectAltName=DNS:allowed.test,DNS:evil.test" -keyout "$work/key.pem" -out "$work/cert.pem" 2>/dev/null
		ip netns exec dsec-demo-web python3 scripts/demo-outside.py 198.51.100.2 "$work/cert.pem" "$work/key.pem" &
		web=$!
		trap 'kill $web 2>/dev/null || true; ip netns del dsec-demo-web 2>/dev/null || true; rm -rf "$work"' EXIT
		CGO_ENABLED=0 go build -o "$work/webclient" ./internal/egress/webclient
		printf 'apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  mode: nat\n  egress:\n    - to: allowed.test\n      ports: [443]\n' >"$work/names.yaml"
		"$dsec" policy validate "$work/names.yaml"
		"$dsec" daemon stop >/dev/null # its resolvers ask the demo's DNS server from now on
		export DSEC_DNS_UPSTREAM=198.51.100.2
		"$dsec" rm -f demo-names >/dev/null 2>&1 || true # an interrupted earlier demo's
		"$dsec" run -d --name demo-names --base demo/busybox:1 --policy "$work/names.yaml"
		"$dsec" cp "$work/webclient" demo-names:/bin/webclient
		"$dsec" exec demo-names -- sh -c 'echo "allowed.test, asking 8.8.8.8 (answered by its resolver):"; nslookup allowed.test 8.8.8.8 | grep -A1 "^Name:";
			echo "evil.test (never asked upstream: see the outside DNS server'"'"'s log):"; nslookup evil.test 8.8.8.8 2>&1 | grep "find";
			echo "HTTPS to allowed.test at 198.51.100.2 (the fast path):"; webclient -sni allowed.test 198.51.100.2:443;
			echo "HTTPS to evil.test at the same 198.51.100.2:"; webclient -sni evil.test 198.51.100.2:443 2>&1' || true
		"$dsec" rm -f demo-names
		kill $web 2>/dev/null || true
		ip netns del dsec-demo-web
		trap 'rm -rf "$work"' EXIT
	fi
	# A disk quota: what the sandbox writes lives on a file system of that size; past it, ENOSPC.
	"$dsec" run --rm --base demo/busybox:1 --disk 16M -- \
		sh -c 'dd if=/dev/zero of=/tmp/fill bs=1M count=64 2>&1 | head -1; df -h / | tail -1' || true

	step "density: a warm FnCall pool (a fresh sandbox per call, discarded after), classes, admission"
	"$dsec" pool resize demo-fn 2 --base demo/busybox:1 --memory 64M
	"$dsec" run --backend fncall --pool demo-fn -- sh -c 'echo secret > /tmp/s; echo "call 1 ran in $(hostname)"'
	"$dsec" run --backend fncall --pool demo-fn -- sh -c 'cat /tmp/s 2>/dev/null || echo "call 2 ran in $(hostname): no trace of call 1"'
	"$dsec" pool ls
	"$dsec" rm -f demo-batch >/dev/null 2>&1 || true # an interrupted earlier demo's
	"$dsec" run -d --name demo-batch --class batch --cpu 0.5 --base demo/busybox:1 -- sh -c 'while :; do :; done'
	sleep 1
	"$dsec" exec demo-rollout -- sh -c 'echo "a latency-class step while a batch sandbox spins"'
	"$dsec" ps
	"$dsec" run --rm --cpu-request 100000 --base demo/busybox:1 -- true || true
	"$dsec" rm -f demo-batch
	"$dsec" pool rm demo-fn

	step "stop keeps the files, start runs it again; rm removes everything"
	"$dsec" stop demo-rollout
	"$dsec" start demo-rollout
	"$dsec" exec demo-rollout -- cat /var/log/steps
	"$dsec" rm -f demo-rollout demo-branch-1 demo-branch-2 demo-branch-3
	"$dsec" snap rm demo/rollout:4 demo/rollout:3

	step "a trainer on another machine, in Python: the worker's API over TCP, with TLS and a token"
	"$dsec" daemon stop >/dev/null # one worker per root: this one also listens on TCP
	"$dsec" daemon certs "$work/tls" --name 127.0.0.1
	port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
	e2bport=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
	printf 'e2b:\n  templates:\n    base: {layers: [demo/debian:12], memory: 512M}\n' >"$work/e2b.yaml"
	"$dsec" --config "$work/e2b.yaml" --log-level info daemon --exit-idle 10m --listen "tcp://127.0.0.1:$port" \
		--tls-cert "$work/tls/server.pem" --tls-key "$work/tls/server-key.pem" --e2b-listen "127.0.0.1:$e2bport" 2>>"$DSEC_ROOT/worker.log" &
	made=$("$dsec" token create --scope sandboxes --ttl 1h --json)
	token=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["token"])' <<<"$made")
	export DSEC_TLS_CA=$work/tls/ca.pem DSEC_TOKEN=$token
	for _ in $(seq 200); do DSEC_HOST="tcp://127.0.0.1:$port" "$dsec" ps >/dev/null 2>&1 && break; sleep 0.05; done
	DSEC_HOST="tcp://127.0.0.1:$port" /usr/bin/python3 python/examples/rollout.py demo/busybox:1
	"$dsec" token rm "$(python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])' <<<"$made")" >/dev/null
	unset DSEC_TLS_CA DSEC_TOKEN

	step "E2B-based frameworks: the official E2B SDK (npm e2b), unchanged, on a Debian layer (the same worker)"
	cache=${XDG_CACHE_HOME:-$HOME/.cache}/dsec
	mkdir -p "$cache"
	if [ ! -x "$cache/debian-bookworm-minbase/bin/bash" ]; then
		echo "demo: bootstrapping a Debian root once into $cache (debootstrap, a few minutes)" >&2
		rm -rf "$cache/debian-bookworm-minbase.tmp"
		debootstrap --variant=minbase bookworm "$cache/debian-bookworm-minbase.tmp" http://deb.debian.org/debian >/dev/null
		mv "$cache/debian-bookworm-minbase.tmp" "$cache/debian-bookworm-minbase"
	fi
	[ -f "$cache/e2b-2.51.0/node_modules/e2b/package.json" ] ||
		npm install --silent --no-audit --no-fund --no-save --prefix "$cache/e2b-2.51.0" e2b@2.51.0 >/dev/null
	"$dsec" layer build "$cache/debian-bookworm-minbase" --kind base -t demo/debian:12 --force >/dev/null
	made=$("$dsec" token create --e2b --ttl 1h --json)
	key=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["token"])' <<<"$made")
	# TLS as the worker's TCP API: its CA for Node.
	E2B_API_URL="https://127.0.0.1:$e2bport" E2B_SANDBOX_URL="https://127.0.0.1:$e2bport" E2B_API_KEY=$key \
		NODE_EXTRA_CA_CERTS="$work/tls/ca.pem" NODE_PATH="$cache/e2b-2.51.0/node_modules" node scripts/e2b-demo.cjs
	"$dsec" token rm "$(python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])' <<<"$made")" >/dev/null

	step "the second host runs a sandbox on lazily mounted layers"
	DSEC_ROOT=$DSEC_ROOT_HOST2 DSEC_REMOTE="dir://$shared" "$dsec" run --rm --base demo/busybox:1 --workspace demo/go-src:1 \
		-- sh -c 'head -1 /src/fmt/print.go'
	DSEC_ROOT=$DSEC_ROOT_HOST2 "$dsec" layer stats demo/go-src:1

	step "the second host restores the step-4 snapshot straight from the remote, lazily"
	DSEC_ROOT=$DSEC_ROOT_HOST2 "$dsec" rm -f demo-far >/dev/null 2>&1 || true # an interrupted earlier demo's
	DSEC_ROOT=$DSEC_ROOT_HOST2 DSEC_REMOTE="dir://$shared" "$dsec" snap restore demo/rollout:4 --name demo-far
	DSEC_ROOT=$DSEC_ROOT_HOST2 "$dsec" exec demo-far -- tail -2 /var/log/steps
	DSEC_ROOT=$DSEC_ROOT_HOST2 "$dsec" rm -f demo-far
	DSEC_ROOT=$DSEC_ROOT_HOST2 "$dsec" daemon stop >/dev/null
	"$dsec" daemon stop >/dev/null
fi

step "rm and gc"
"$dsec" layer rm demo/busybox:rebuilt
"$dsec" layer gc
echo "demo done: state is in $DSEC_ROOT (make clean removes it)" >&2
