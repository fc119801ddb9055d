package kubetest_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/kubetest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// TestDeployment runs deploy/kubernetes on a real cluster of two nodes:
// the worker DaemonSet and the gateway Deployment come up, the gateway
// finds both workers through their Service's EndpointSlices, and
// sandboxes made through it spread over both nodes; the sandboxes live
// on while a worker's pod is deleted, while the DaemonSet rolls, and
// while a worker's container is killed and restarted; its
// SandboxPolicy, SandboxTemplate and SandboxPool objects hold on every
// worker and go with their objects; a node whose
// kubelet and worker are stopped is down in the gateway's fleet within
// its heartbeat timeout, its sandboxes an infrastructure failure, and
// new sandboxes go to the other node.
func TestDeployment(t *testing.T) {
	f := startFleet(t)
	c, roots, certs, workerToken, gatewayToken, tenantToken := f.c, f.roots, f.certs, f.workerToken, f.gatewayToken, f.tenantToken
	ctx := context.Background()

	// The base, with what a cluster without kube-proxy or DNS (this
	// one) needs: the gateway on its node's network, the API server by
	// address; images only as imported.
	_, file, _, _ := runtime.Caller(0)
	base, err := filepath.Rel(filepath.Join(c.Dir, "overlay"), filepath.Join(filepath.Dir(file), "..", "..", "deploy", "kubernetes", "base"))
	if err != nil {
		t.Fatal(err)
	}
	os.MkdirAll(filepath.Join(c.Dir, "overlay"), 0o755)
	overlay := fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [%s]
patches:
  - target: {kind: DaemonSet, name: dsec-worker}
    patch: |
      - {op: replace, path: /spec/template/spec/volumes/0/hostPath/path, value: %s}
      - {op: add, path: /spec/template/spec/containers/0/imagePullPolicy, value: Never}
  - target: {kind: Deployment, name: dsec-gateway}
    patch: |
      - {op: add, path: /spec/template/spec/hostNetwork, value: true}
      - {op: add, path: /spec/template/spec/containers/0/imagePullPolicy, value: Never}
      - {op: add, path: /spec/template/spec/containers/0/env/-, value: {name: KUBERNETES_SERVICE_HOST, value: %q}}
      - {op: add, path: /spec/template/spec/containers/0/env/-, value: {name: KUBERNETES_SERVICE_PORT, value: "6443"}}
      - {op: add, path: /spec/template/spec/containers/0/args/-, value: "--heartbeat=1s"}
`, base, roots, kubetest.HostIP)
	if err := os.WriteFile(filepath.Join(c.Dir, "overlay", "kustomization.yaml"), []byte(overlay), 0o644); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	c.MustKubectl("apply", "-k", filepath.Join(c.Dir, "overlay"))
	undeploy(t, c)
	workersReady := func() {
		t.Helper()
		c.WaitFor(3*time.Minute, "the worker DaemonSet ready on both nodes", func() bool {
			out, err := c.Kubectl("-n", "dsec", "get", "daemonset", "dsec-worker", "-o",
				"jsonpath={.status.numberReady}/{.status.updatedNumberScheduled}/{.status.desiredNumberScheduled}")
			return err == nil && out == "2/2/2"
		})
	}
	workersReady()
	gatewaysReady := func() {
		t.Helper()
		c.WaitFor(2*time.Minute, "both gateway replicas available", func() bool {
			out, err := c.Kubectl("-n", "dsec", "get", "deployment", "dsec-gateway", "-o", "jsonpath={.status.availableReplicas}/{.status.updatedReplicas}/{.status.replicas}")
			return err == nil && out == "2/2/2"
		})
	}
	gatewaysReady()
	t.Logf("deploy/kubernetes applied to both gateways available and both workers ready: %s", time.Since(t0).Round(100*time.Millisecond))
	// Each replica on its node's network (one a node: their port).
	gwIPs := strings.Fields(c.MustKubectl("-n", "dsec", "get", "pod", "-l", "app.kubernetes.io/component=gateway", "-o", "jsonpath={.items[*].status.hostIP}"))
	if len(gwIPs) != 2 || gwIPs[0] == gwIPs[1] {
		t.Fatalf("the gateway replicas' nodes: %v, want two", gwIPs)
	}
	gateway := func(ip, token string) *sdk.Client {
		g, err := sdk.New(sdk.Options{Host: "tcp://" + ip + ":7444", Token: token, TLSCA: filepath.Join(certs, auth.CAFile)})
		if err != nil {
			t.Fatal(err)
		}
		return g
	}
	gw, gw2 := gateway(gwIPs[0], gatewayToken), gateway(gwIPs[1], gatewayToken)
	byIP := func() map[string]api.Node {
		ns, err := gw.Nodes(ctx)
		if err != nil {
			return nil
		}
		out := map[string]api.Node{}
		for _, n := range ns {
			out[strings.TrimSuffix(strings.TrimPrefix(n.URL, "tcp://"), ":7443")] = n
		}
		return out
	}
	c.WaitFor(time.Minute, "the gateway's fleet: both workers, up", func() bool {
		ns := byIP()
		return len(ns) == 2 && ns[c.Nodes[0].IP].Up && ns[c.Nodes[1].IP].Up
	})

	// Sandboxes through the gateway, spread over both nodes.
	var sbs []*sdk.Sandbox
	for i := range 4 {
		sb, err := gw.Create(ctx, api.SandboxSpec{Name: fmt.Sprintf("k%d", i), Layers: []string{"ws:1", "bb:1"}})
		if err != nil {
			t.Fatalf("create through the gateway: %v", err)
		}
		sbs = append(sbs, sb)
		if out := run(t, sb, "echo kept > /state; sleep 100000 >/dev/null 2>&1 & echo $! > /sleeper"); out != "" {
			t.Fatalf("start: %q", out)
		}
	}
	c.WaitFor(30*time.Second, "two sandboxes on each node", func() bool {
		ns := byIP()
		return ns[c.Nodes[0].IP].Sandboxes == 2 && ns[c.Nodes[1].IP].Sandboxes == 2
	})

	// The other replica: the same fleet, the tokens of the Secret, and
	// a name made through one is taken through the other.
	tenant := gateway(gwIPs[1], tenantToken)
	tsb, err := tenant.Create(ctx, api.SandboxSpec{Name: "t0", Layers: []string{"ws:1", "bb:1"}})
	if err != nil {
		t.Fatalf("a tenant's create through the second replica: %v", err)
	}
	if out := run(t, tsb, "echo tenant"); out != "tenant\n" {
		t.Errorf("t0: %q", out)
	}
	if _, err := gw2.Create(ctx, api.SandboxSpec{Name: "k0", Layers: []string{"ws:1", "bb:1"}}); !errdefs.IsAlreadyExists(err) {
		t.Errorf("k0 (made through the first replica) through the second: %v, want already exists", err)
	}
	if err := tsb.Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
	alive := func(when string) {
		t.Helper()
		for _, sb := range sbs {
			var out, last string
			var err error
			// A worker just started may still be taking its sandboxes
			// back, and the gateway hears of it at its next heartbeat.
			c.WaitFor(time.Minute, when+": "+sb.Name+" answers", func() bool {
				out, err = tryRun(sb, "cat /state; kill -0 $(cat /sleeper) && echo alive")
				if err != nil && err.Error() != last {
					last = err.Error()
					t.Logf("%s: %s: %v", when, sb.Name, err)
				}
				return err == nil
			})
			if out != "kept\nalive\n" {
				t.Errorf("%s: sandbox %s: %q", when, sb.Name, out)
			}
		}
	}
	alive("at first")

	// dsec's objects, applied to the fleet by the gateway: a policy on
	// every worker, a pool of a template sized across the fleet (and
	// changed with its template), each gone from the fleet with its
	// object; one the schema refuses never reaches it.
	direct := map[string]*sdk.Client{}
	for _, n := range c.Nodes {
		d, err := sdk.New(sdk.Options{Host: "tcp://" + n.IP + ":7443", Token: workerToken, TLSCA: filepath.Join(certs, auth.CAFile)})
		if err != nil {
			t.Fatal(err)
		}
		direct[n.Name] = d
	}
	if _, err := c.KubectlIn([]byte(objects), "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
	each := func(what string, ok func(d *sdk.Client) bool) {
		t.Helper()
		c.WaitFor(time.Minute, what+" on both workers", func() bool {
			for _, d := range direct {
				if !ok(d) {
					return false
				}
			}
			return true
		})
	}
	pool := func(d *sdk.Client) (api.Pool, bool) {
		ps, err := d.Pools(ctx)
		for _, p := range ps {
			if err == nil && p.Name == "warm" {
				return p, true
			}
		}
		return api.Pool{}, false
	}
	each("the SandboxPolicy stored", func(d *sdk.Client) bool {
		p, err := d.Policy(ctx, "quiet")
		return err == nil && p.Network != nil && p.Network.Mode == api.NetworkLoopback
	})
	each("the SandboxPool's share, warm", func(d *sdk.Client) bool {
		p, ok := pool(d)
		return ok && p.Size == 1 && p.Warm == 1 && p.Spec.Memory == 64<<20
	})
	c.WaitFor(time.Minute, "the objects' status", func() bool {
		out, _ := c.Kubectl("-n", "dsec", "get", "sandboxpolicy/quiet", "sandboxpool/warm", "-o", "jsonpath={.items[*].status.applied}")
		return out == "true true"
	})
	// A SandboxTemplate is a template ID of every replica's E2B front,
	// and an E2B sandbox is every replica's: made through one, a file
	// written through it is read through the other, which sets its
	// timeout and kills it.
	ca := filepath.Join(certs, auth.CAFile)
	for i, ip := range gwIPs {
		other := gwIPs[1-i] + ":3000"
		var id, access string
		c.WaitFor(time.Minute, "an E2B sandbox of the template bb through "+ip, func() bool {
			id, access, err = e2bCreate(ip+":3000", gatewayToken, ca, "bb")
			return err == nil
		})
		info, err := gw.Sandbox(id).Inspect(ctx)
		if err != nil || info.Memory != 64<<20 || strings.Join(info.Layers, ",") != "ws:1,bb:1" || info.E2B == nil || info.E2B.Template != "bb" {
			t.Errorf("the E2B sandbox of the template bb: %+v %v", info, err)
		}
		envd := map[string]string{"E2b-Sandbox-Id": id, "X-Access-Token": access, "Content-Type": "application/octet-stream"}
		if code, body, err := e2bDo(ip+":3000", ca, "POST", "/files?path=/tmp/made-by", envd, ip); err != nil || code != http.StatusOK {
			t.Errorf("an E2B file write through %s: %d %s %v", ip, code, body, err)
		}
		if code, body, err := e2bDo(other, ca, "GET", "/files?path=/tmp/made-by", envd, ""); err != nil || code != http.StatusOK || body != ip {
			t.Errorf("the file read through the other replica %s: %d %q %v, want %q", other, code, body, err, ip)
		}
		key := map[string]string{"X-Api-Key": gatewayToken, "Content-Type": "application/json"}
		if code, body, err := e2bDo(other, ca, "POST", "/sandboxes/"+id+"/timeout", key, `{"timeout":600}`); err != nil || code != http.StatusNoContent {
			t.Errorf("its timeout set through %s: %d %s %v", other, code, body, err)
		}
		if info, err := gw.Sandbox(id).Inspect(ctx); err != nil || info.E2B == nil || time.Until(info.E2B.EndAt) < 500*time.Second {
			t.Errorf("its E2B state after the timeout was set: %+v %v", info.E2B, err)
		}
		if code, body, err := e2bDo(other, ca, "DELETE", "/sandboxes/"+id, key, ""); err != nil || code != http.StatusNoContent {
			t.Errorf("killed through %s: %d %s %v", other, code, body, err)
		}
	}
	// One replica applies them, the Lease's holder; once its pod goes
	// the other takes the Lease and applies what changes next.
	holder := func() string {
		out, _ := c.Kubectl("-n", "dsec", "get", "lease", "dsec-gateway", "-o", "jsonpath={.spec.holderIdentity}")
		return out
	}
	first := holder()
	if first == "" {
		t.Fatal("no gateway replica holds the Lease dsec-gateway")
	}
	t0 = time.Now()
	for _, pod := range strings.Fields(c.MustKubectl("-n", "dsec", "get", "pod", "-l", "app.kubernetes.io/component=gateway", "-o", "jsonpath={.items[*].metadata.name}")) {
		c.MustKubectl("-n", "dsec", "delete", "pod", pod, "--wait=true")
		gatewaysReady()
		if h := holder(); h != "" && h != first {
			break
		}
	}
	c.WaitFor(time.Minute, "another replica holding the Lease", func() bool { h := holder(); return h != "" && h != first })
	t.Logf("the Lease's holder's pod deleted to another replica holding it: %s", time.Since(t0).Round(100*time.Millisecond))
	c.MustKubectl("-n", "dsec", "patch", "sandboxtemplate", "bb", "--type=merge", "-p", `{"spec":{"memory":134217728}}`)
	each("the pool following its template", func(d *sdk.Client) bool { p, ok := pool(d); return ok && p.Spec.Memory == 128<<20 })
	if out, err := c.KubectlIn([]byte(badPool), "apply", "-f", "-"); err == nil || !strings.Contains(err.Error(), "size") {
		t.Errorf("a SandboxPool of size -1: %q %v, want the schema's refusal", out, err)
	}
	c.MustKubectl("-n", "dsec", "delete", "sandboxpool/warm", "sandboxpolicy/quiet", "--timeout=60s")
	each("the pool and the policy gone", func(d *sdk.Client) bool {
		_, held := pool(d)
		_, err := d.Policy(ctx, "quiet")
		return !held && errdefs.IsNotFound(err)
	})

	// A worker's pod is deleted (the DaemonSet makes another).
	pods := func() map[string]string {
		out := c.MustKubectl("-n", "dsec", "get", "pod", "-l", "app.kubernetes.io/component=worker", "-o",
			`jsonpath={range .items[*]}{.spec.nodeName}={.metadata.name}{"\n"}{end}`)
		m := map[string]string{}
		for _, l := range strings.Fields(out) {
			node, pod, _ := strings.Cut(l, "=")
			m[node] = pod
		}
		return m
	}
	old := pods()["n1"]
	t0 = time.Now()
	c.MustKubectl("-n", "dsec", "delete", "pod", old, "--wait=true")
	c.WaitFor(time.Minute, "n1's worker pod replaced", func() bool { p := pods()["n1"]; return p != "" && p != old })
	workersReady()
	alive("after n1's worker pod was deleted")
	t.Logf("n1's worker pod deleted to its sandboxes served again: %s", time.Since(t0).Round(100*time.Millisecond))

	// The DaemonSet rolls: every worker pod replaced, one at a time.
	t0 = time.Now()
	c.MustKubectl("-n", "dsec", "rollout", "restart", "daemonset/dsec-worker")
	c.MustKubectl("-n", "dsec", "rollout", "status", "daemonset/dsec-worker", "--timeout=3m")
	workersReady()
	alive("after the DaemonSet rolled")
	t.Logf("the DaemonSet's rollout to every sandbox served again: %s", time.Since(t0).Round(100*time.Millisecond))

	// A worker's container dies (kill -9); the kubelet restarts it.
	pid := workerPid(t, c.Nodes[1].IP)
	restarts := func() int {
		out, _ := c.Kubectl("-n", "dsec", "get", "pod", pods()["n2"], "-o", "jsonpath={.status.containerStatuses[0].restartCount}")
		n, _ := strconv.Atoi(out)
		return n
	}
	before := restarts()
	syscall.Kill(pid, syscall.SIGKILL)
	c.WaitFor(2*time.Minute, "n2's worker container restarted", func() bool { return restarts() > before })
	workersReady()
	alive("after n2's worker container was killed")

	// Node n2 stops: its kubelet, then its worker. The gateway notices
	// within its heartbeat timeout (three heartbeats of 1 s).
	c.Nodes[1].StopKubelet()
	syscall.Kill(workerPid(t, c.Nodes[1].IP), syscall.SIGKILL)
	t0 = time.Now()
	c.WaitFor(30*time.Second, "n2 down in the gateway's fleet", func() bool {
		n, ok := byIP()[c.Nodes[1].IP]
		return ok && !n.Up
	})
	t.Logf("n2's worker stopped: the gateway saw it down after %s", time.Since(t0).Round(100*time.Millisecond))
	var onN2 *sdk.Sandbox
	for _, sb := range sbs {
		info, err := sb.Inspect(ctx)
		if err == nil {
			continue
		}
		if !errdefs.IsUnavailable(err) {
			t.Errorf("inspect %s: %v, want an infrastructure failure (unavailable) or an answer", sb.Name, err)
		}
		_ = info
		onN2 = sb
	}
	if onN2 == nil {
		t.Fatal("no sandbox reported unreachable on the stopped node")
	}
	if _, err := tryRun(onN2, "true"); !errdefs.IsUnavailable(err) {
		t.Errorf("an exec in %s on the stopped node: %v, want unavailable", onN2.Name, err)
	}
	for i := range 2 {
		sb, err := gw.Create(ctx, api.SandboxSpec{Name: fmt.Sprintf("after%d", i), Layers: []string{"ws:1", "bb:1"}})
		if err != nil {
			t.Fatalf("a create while n2 is down: %v", err)
		}
		if out := run(t, sb, "echo ok"); out != "ok\n" {
			t.Errorf("after%d: %q", i, out)
		}
	}
	if n := byIP()[c.Nodes[0].IP]; n.Sandboxes != 4 {
		t.Errorf("n1 holds %d sandboxes, want 4 (its 2 and the 2 made while n2 was down)", n.Sandboxes)
	}
}

// fleet is a cluster of two nodes with what an operator makes before
// deploying dsec: the workers' roots (one per node name, with the
// test's layers), the namespace dsec, the Secret dsec-secrets (tokens
// and certificates) and the gateways' clients' tokens in the Secret
// dsec-gateway-tokens.
type fleet struct {
	c                                      *kubetest.Cluster
	roots, certs                           string
	workerToken, gatewayToken, tenantToken string
}

func startFleet(t *testing.T) *fleet {
	t.Helper()
	images := map[string]string{"localhost/dsec": os.Getenv("DSEC_IMAGE"), "localhost/dsec/pause": os.Getenv("DSEC_PAUSE_IMAGE")}
	kubetest.Tools(t)
	for name, f := range images {
		if f == "" {
			t.Fatalf("no image for %s: DSEC_IMAGE and DSEC_PAUSE_IMAGE name make image's archives (make test sets them)", name)
		}
	}
	// What a test killed before its cleanups left: its cluster, then
	// its workers' sandboxes.
	kubetest.Claim(t)
	sweepRoots(t)
	// The workers' roots, one per node (the DaemonSet's hostPath, a
	// directory per node name), with the test's layers; cleaned after
	// the cluster is gone (cleanups run last first).
	roots, err := os.MkdirTemp("", rootsPrefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(roots) })
	// A shared mount, as systemd makes / (the worker's Bidirectional
	// root needs one).
	if err := syscall.Mount(roots, roots, "", syscall.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Unmount(roots, syscall.MNT_DETACH) })
	if err := syscall.Mount("", roots, "", syscall.MS_SHARED|syscall.MS_REC, ""); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"n1", "n2"} {
		root := filepath.Join(roots, n)
		runtimetest.Layers(t, root)
		t.Cleanup(func() { runtimetest.Clean(root) })
	}
	t0 := time.Now()
	c := kubetest.Start(t, 2, images)
	t.Logf("the cluster (control plane, two nodes Ready, images in): %s", time.Since(t0).Round(100*time.Millisecond))

	// What an operator makes first: the namespace, and the Secret with
	// the fleet's tokens and certificates.
	certs := filepath.Join(c.Dir, "certs")
	names := []string{"dsec-worker"}
	for _, n := range c.Nodes {
		names = append(names, n.IP)
	}
	if err := auth.MakeCerts(certs, names); err != nil {
		t.Fatal(err)
	}
	workerToken, gatewayToken := newToken(), newToken()
	c.MustKubectl("create", "namespace", "dsec")
	c.MustKubectl("-n", "dsec", "create", "secret", "generic", "dsec-secrets",
		"--from-literal=worker-token="+workerToken, "--from-literal=gateway-token="+gatewayToken,
		"--from-file=ca.pem="+filepath.Join(certs, auth.CAFile), "--from-file=server.pem="+filepath.Join(certs, auth.ServerFile),
		"--from-file=server-key.pem="+filepath.Join(certs, auth.ServerKeyFile))
	// The gateways' clients' tokens, made as an operator would (dsec
	// token create on a scratch root), in a Secret the replicas share.
	tokensFile := filepath.Join(c.Dir, "gateway-tokens", "tokens.json")
	tenantToken, _, err := auth.OpenFile(tokensFile).New(auth.Spec{Scope: auth.Sandboxes})
	if err != nil {
		t.Fatal(err)
	}
	c.MustKubectl("-n", "dsec", "create", "secret", "generic", "dsec-gateway-tokens", "--from-file=tokens.json="+tokensFile)

	return &fleet{c: c, roots: roots, certs: certs, workerToken: workerToken, gatewayToken: gatewayToken, tenantToken: tenantToken}
}

// rootsPrefix starts the name of a fleet's roots' directory (in the
// temporary directory), by which a later test finds one a killed test
// left.
const rootsPrefix = "dsec-kubetest-roots-"

// sweepRoots removes what a killed test left in its fleet's roots (its
// cluster cleared first, its workers with it): their sandboxes, then
// the roots. (Claim first: no live test's roots are swept.)
func sweepRoots(t *testing.T) {
	left, _ := filepath.Glob(filepath.Join(os.TempDir(), rootsPrefix+"*"))
	for _, roots := range left {
		t.Logf("clearing %s, which a killed test left", roots)
		nodes, _ := filepath.Glob(filepath.Join(roots, "*"))
		for _, root := range nodes {
			if isDir(root) {
				runtimetest.Clean(root)
			}
		}
		for syscall.Unmount(roots, syscall.MNT_DETACH) == nil {
		}
		os.RemoveAll(roots)
	}
}

func isDir(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}

// undeploy has dsec's namespace deleted when the test ends, the pods'
// logs shown first if it failed. (The pods go before the cluster does: a
// worker stops as its pod is deleted; its sandboxes stay for the roots'
// cleanup.)
func undeploy(t *testing.T, c *kubetest.Cluster) {
	t.Cleanup(func() {
		if t.Failed() {
			out, _ := c.Kubectl("-n", "dsec", "get", "pods", "-o", "wide")
			t.Logf("pods:\n%s", out)
			names, _ := c.Kubectl("-n", "dsec", "get", "pods", "-o", "name")
			for _, p := range strings.Fields(names) {
				for _, prev := range []string{"--previous=false", "--previous=true"} {
					out, _ := c.Kubectl("-n", "dsec", "logs", p, prev, "--tail=60")
					t.Logf("--- %s %s:\n%s", p, prev, out)
				}
			}
		}
		c.Kubectl("delete", "namespace", "dsec", "--wait=true", "--timeout=60s")
	})
}

// objects are dsec's Kubernetes objects the test applies.
const objects = `apiVersion: dsec.dev/v1alpha1
kind: SandboxPolicy
metadata: {name: quiet, namespace: dsec}
spec:
  network: {mode: loopback}
---
apiVersion: dsec.dev/v1alpha1
kind: SandboxTemplate
metadata: {name: bb, namespace: dsec}
spec:
  layers: ["ws:1", "bb:1"]
  memory: 67108864
---
apiVersion: dsec.dev/v1alpha1
kind: SandboxPool
metadata: {name: warm, namespace: dsec}
spec: {template: bb, size: 2}
`

const badPool = `apiVersion: dsec.dev/v1alpha1
kind: SandboxPool
metadata: {name: bad, namespace: dsec}
spec: {template: bb, size: -1}
`

// e2bCreate creates a sandbox of template through the E2B front at addr
// (TLS, checked against ca), as the E2B SDKs do, and says its ID and
// envd access token.
func e2bCreate(addr, key, ca, template string) (id, access string, err error) {
	code, body, err := e2bDo(addr, ca, "POST", "/sandboxes", map[string]string{"X-Api-Key": key, "Content-Type": "application/json"},
		`{"templateID":"`+template+`"}`)
	if err != nil {
		return "", "", err
	}
	var out struct {
		SandboxID       string `json:"sandboxID"`
		EnvdAccessToken string `json:"envdAccessToken"`
		Message         string `json:"message"`
	}
	json.Unmarshal([]byte(body), &out)
	if code != http.StatusCreated || out.SandboxID == "" || out.EnvdAccessToken == "" {
		return "", "", fmt.Errorf("E2B create of %s: %d: %s", template, code, body)
	}
	return out.SandboxID, out.EnvdAccessToken, nil
}

// e2bDo sends a request to the E2B front at addr (TLS, checked against
// ca) and says its answer.
func e2bDo(addr, ca, method, path string, header map[string]string, body string) (int, string, error) {
	pem, err := os.ReadFile(ca)
	if err != nil {
		return 0, "", err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pem)
	hc := &http.Client{Timeout: time.Minute, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: "dsec-worker"}}}
	req, _ := http.NewRequest(method, "https://"+addr+path, strings.NewReader(body))
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, string(b), err
}

func newToken() string {
	b := make([]byte, 20)
	rand.Read(b)
	return auth.Prefix + hex.EncodeToString(b)
}

func run(t *testing.T, sb *sdk.Sandbox, script string) string {
	t.Helper()
	out, err := tryRun(sb, script)
	if err != nil {
		t.Fatalf("exec in %s: %v", sb.Name, err)
	}
	return out
}

func tryRun(sb *sdk.Sandbox, script string) (string, error) {
	var out bytes.Buffer
	res, err := sb.Exec(context.Background(), sdk.ExecOptions{Args: []string{"sh", "-c", script}, Stdout: &out, Stderr: &out})
	if err == nil && res.ExitCode != 0 {
		err = fmt.Errorf("exit %d: %s", res.ExitCode, out.String())
	}
	return out.String(), err
}

// workerPid is the PID of the worker that listens on ip, as the host
// sees it.
func workerPid(t *testing.T, ip string) int {
	t.Helper()
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		args := strings.Split(string(b), "\x00")
		if len(args) > 0 && strings.HasSuffix(args[0], "/dsecd") && bytes.Contains(b, []byte("daemon\x00--listen\x00tcp://"+ip+":")) {
			return pid
		}
	}
	t.Fatal(errors.New("no worker listens on " + ip))
	return 0
}
