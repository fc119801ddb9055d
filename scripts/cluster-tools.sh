#!/bin/sh
# cluster-tools.sh DIR: builds the Kubernetes control plane, kubelet,
# kubectl and etcd the cluster tests run, from the pinned modules in
# tools/k8s and tools/etcd, into DIR/KEY/bin, where KEY names the pins (the
# modules' go.mod and go.sum). A KEY already built is kept as it is: the
# cold build takes about 27 minutes on two cores, so CI builds it once and
# every later run finds it. Helm (tools/helm, about 2 minutes) goes beside
# them, built again when its own pins change (bin/helm.key). Prints the
# bin directory.
set -eu
dir=${1:?usage: cluster-tools.sh DIR}
top=$(cd "$(dirname "$0")/.." && pwd)
key=$(cat "$top"/tools/k8s/go.mod "$top"/tools/k8s/go.sum "$top"/tools/etcd/go.mod "$top"/tools/etcd/go.sum "$top"/tools/etcd/main.go |
	sha256sum | cut -c1-16)
out=$dir/$key
hkey=$(cat "$top"/tools/helm/go.mod "$top"/tools/helm/go.sum | sha256sum | cut -c1-16)
if [ -f "$out/done" ] && [ "$(cat "$out/bin/helm.key" 2>/dev/null)" = "$hkey" ]; then
	echo "$out/bin"
	exit 0
fi
version=$(sed -n "s/^[[:space:]]*k8s.io\/kubernetes \(v[0-9.]*\).*/\1/p" "$top/tools/k8s/go.mod")
major=$(echo "$version" | sed 's/^v\([0-9]*\)\..*/\1/')
minor=$(echo "$version" | sed 's/^v[0-9]*\.\([0-9]*\)\..*/\1/')
[ -n "$version" ] || { echo "cluster-tools: no k8s.io/kubernetes version in tools/k8s/go.mod" >&2; exit 1; }
ldflags="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	ldflags="$ldflags -X $p.gitVersion=$version -X $p.gitMajor=$major -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
done
mkdir -p "$out/bin"
go=${GO:-go}
for cmd in kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl; do
	[ -x "$out/bin/$cmd" ] && continue
	echo "cluster-tools: building $cmd $version (the whole set takes about 27 minutes cold)" >&2
	(cd "$top/tools/k8s" && CGO_ENABLED=0 nice -n 19 "$go" build -trimpath -ldflags "$ldflags" -o "$out/bin/$cmd.tmp" "k8s.io/kubernetes/cmd/$cmd")
	mv "$out/bin/$cmd.tmp" "$out/bin/$cmd"
done
if [ ! -x "$out/bin/etcd" ]; then
	echo "cluster-tools: building etcd" >&2
	(cd "$top/tools/etcd" && CGO_ENABLED=0 nice -n 19 "$go" build -trimpath -ldflags "-s -w" -o "$out/bin/etcd.tmp" .)
	mv "$out/bin/etcd.tmp" "$out/bin/etcd"
fi
if [ "$(cat "$out/bin/helm.key" 2>/dev/null)" != "$hkey" ]; then
	hversion=$(sed -n "s/^[[:space:]]*helm.sh\/helm\/v4 \(v[0-9.]*\).*/\1/p" "$top/tools/helm/go.mod")
	echo "cluster-tools: building helm $hversion" >&2
	(cd "$top/tools/helm" && CGO_ENABLED=0 nice -n 19 "$go" build -trimpath -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$hversion" \
		-o "$out/bin/helm.tmp" helm.sh/helm/v4/cmd/helm)
	mv "$out/bin/helm.tmp" "$out/bin/helm"
	echo "$hkey" > "$out/bin/helm.key"
fi
touch "$out/done"
echo "$out/bin"
