// Package kubetest starts a real Kubernetes cluster for a test, offline,
// on this machine: etcd, kube-apiserver, kube-controller-manager and
// kube-scheduler on a bridge of its own, and nodes that are network
// namespaces, each with its containerd (Debian's, with runc) and its
// kubelet. The binaries are make cluster-tools' (DSEC_CLUSTER_TOOLS);
// images are OCI archives (scripts/image.sh) imported into every node.
// Everything is undone at the test's end: processes, pods' groups,
// namespaces, the bridge, and the kernel settings the kubelets change;
// what a test killed before its end left is cleared when the next one
// starts (Claim).
package kubetest

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/testenv"
)

// The cluster's network: the control plane on the host's side of a
// bridge, node I at .(10+I); nothing routes past it.
const (
	bridge   = "dsk8s0"
	prefix   = "10.251.0."
	HostIP   = prefix + "1"
	apiPort  = "6443"
	services = "10.96.0.0/24"
)

// Cluster is a running cluster.
type Cluster struct {
	Dir        string // its files: certificates, logs, the nodes'
	Bin        string // the cluster tools' directory
	Kubeconfig string // an admin's
	Nodes      []*Node

	t     testing.TB
	procs []*proc // the control plane's, in start order

	mu      sync.Mutex
	started []*proc // every process, for dead
}

// Node is a node of the cluster.
type Node struct {
	Name, IP string
	NetNS    string // its network namespace's name
	Dir      string
	Socket   string // its containerd's

	c                   *Cluster
	containerd, kubelet *proc
}

// proc is a process the cluster started.
type proc struct {
	name   string
	cmd    *exec.Cmd
	log    string
	done   chan struct{}
	killed atomic.Bool
}

// Tools is the directory of the cluster tools (DSEC_CLUSTER_TOOLS, make
// cluster-tools): a test without them is skipped, or fails where
// DSEC_REQUIRE_ROOT says every privileged test must run (CI).
func Tools(t testing.TB) string {
	t.Helper()
	testenv.RequireRoot(t, "a cluster's nodes, mounts and groups")
	dir := os.Getenv("DSEC_CLUSTER_TOOLS")
	if dir == "" {
		if testenv.MustRun() {
			t.Fatal("no cluster tools: DSEC_CLUSTER_TOOLS is unset (make test sets it, after make cluster-tools)")
		}
		t.Skip("SKIPPED: no cluster tools: DSEC_CLUSTER_TOOLS is unset (make cluster-tools builds them; make test sets it)")
	}
	for _, b := range []string{"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl", "helm"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			t.Fatalf("the cluster tools: %v (make cluster-tools)", err)
		}
	}
	for _, b := range []string{"containerd", "runc", "nsenter", "ctr"} {
		if _, err := exec.LookPath(b); err != nil {
			t.Fatalf("%s is missing (make cluster-deps installs it)", b)
		}
	}
	return dir
}

// sysctls are the kernel settings a kubelet sets on the whole machine:
// kept before, put back after.
var sysctls = []string{"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
	"kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes"}

// Claim makes this process the machine's only cluster test, and clears
// what a test process killed before its cleanups (a CI run stopped
// half-way) left of its cluster: with the bridge still there, every
// later test failed at its first step. The claim is an exclusive lock
// on a file, held until this process exits; another process that holds
// it is a live cluster test, which this one then waits for (up to
// five minutes) rather than clearing its cluster. The processes killed
// are a dead cluster's own, found by where they are: in a node's
// groups (its pods: containers, and dsec's workers), or holding its
// directory on their command line (its containerds' shims).
func Claim(t testing.TB) {
	t.Helper()
	claimOnce.Do(func() { claimErr = claim() })
	if claimErr != nil {
		t.Fatal(claimErr)
	}
}

var (
	claimOnce sync.Once
	claimErr  error
)

// claimFile is where a cluster test holds its lock.
const claimFile = "/run/dsec-kubetest.lock"

func claim() error {
	f, err := os.OpenFile(claimFile, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return fmt.Errorf("kubetest: %w", err)
	}
	for deadline := time.Now().Add(5 * time.Minute); ; time.Sleep(time.Second) {
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return fmt.Errorf("kubetest: lock %s: %w", claimFile, err)
		}
		if time.Now().After(deadline) {
			f.Close()
			return fmt.Errorf("kubetest: another cluster test has held %s for 5 minutes: wait for it to end, or stop it (lslocks shows its pid)", claimFile)
		}
	}
	claimed = f // held until the process exits
	sweep()
	return nil
}

// claimed is the claim's open file: its lock goes with the process.
var claimed *os.File

// sweep clears a dead cluster test's cluster (see Claim).
func sweep() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), "dsk8s-*"))
	groups, _ := filepath.Glob(filepath.Join(cgroup.Root, "*", "dsk8s-n*"))
	v2, _ := filepath.Glob(filepath.Join(cgroup.Root, "dsk8s-n*")) // a unified host's
	groups = append(groups, v2...)
	nodes := map[string]bool{}
	for _, g := range groups {
		nodes[filepath.Base(g)] = true
	}
	for n := range nodes {
		killTree(n)
	}
	for _, d := range dirs {
		killMatching(d + "/")
	}
	for _, d := range dirs {
		unmountUnder(d)
		os.RemoveAll(d)
	}
	for n := range nodes {
		removeTree(n)
	}
	netns, _ := filepath.Glob("/run/netns/dsk8s-n*")
	for _, ns := range netns {
		exec.Command("ip", "netns", "delete", filepath.Base(ns)).Run()
	}
	exec.Command("ip", "link", "delete", bridge).Run()
	if len(dirs) > 0 {
		os.Remove(filepath.Join(kubeletShared, "device-plugins", "kubelet.sock"))
	}
	// What the dead test saved, put back: the kernel settings its
	// kubelets changed (panic_on_oops among them), and the kubelets'
	// shared directory gone if it made it.
	var st hostState
	if b, err := os.ReadFile(stateFile); err == nil && json.Unmarshal(b, &st) == nil {
		st.restore()
	}
	os.Remove(stateFile)
}

// stateFile holds what a cluster test changes on the host and puts back
// at its end (hostState), for the next test to put back if it was
// killed first.
const stateFile = "/run/dsec-kubetest.state"

// hostState is what a cluster test found on the host before its
// kubelets ran.
type hostState struct {
	Sysctls map[string]string `json:"sysctls"` // sysctls' values
	// MadeShared says kubeletShared was not there.
	MadeShared bool `json:"made_shared"`
}

// restore puts the host back as st found it.
func (st hostState) restore() {
	if st.MadeShared {
		os.RemoveAll(kubeletShared)
	}
	for k, v := range st.Sysctls {
		os.WriteFile("/proc/sys/"+k, []byte(v), 0o644)
	}
}

// Start starts a cluster of n nodes and imports images (OCI archives,
// each with the name its key gives: NAME, the archive's ref its tag)
// into every node; it is torn down when the test ends.
func Start(t testing.TB, n int, images map[string]string) *Cluster {
	t.Helper()
	bin := Tools(t)
	Claim(t)
	dir, err := os.MkdirTemp("", "dsk8s-")
	if err != nil {
		t.Fatal(err)
	}
	c := &Cluster{Dir: dir, Bin: bin, t: t}
	_, err = os.Stat(kubeletShared)
	st := hostState{Sysctls: map[string]string{}, MadeShared: err != nil}
	for _, k := range sysctls {
		if b, err := os.ReadFile("/proc/sys/" + k); err == nil {
			st.Sysctls[k] = string(b)
		}
	}
	if b, err := json.Marshal(st); err != nil {
		t.Fatal(err)
	} else if err := os.WriteFile(stateFile, b, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.stop()
		c.unnetwork(n)
		st.restore()
		os.Remove(stateFile)
		if t.Failed() {
			c.dumpLogs()
		}
		os.RemoveAll(dir)
	})
	c.network(n)
	c.certs(n)
	c.controlPlane()
	for i := 1; i <= n; i++ {
		c.Nodes = append(c.Nodes, c.node(i))
	}
	var wg sync.WaitGroup
	for _, nd := range c.Nodes {
		for name, archive := range images {
			wg.Go(func() { nd.importImage(name, archive) })
		}
	}
	wg.Wait()
	for _, nd := range c.Nodes {
		nd.kubelet = c.start(nd.Name+"-kubelet", nd.NetNS, filepath.Join(bin, "kubelet"), nd.kubeletArgs()...)
	}
	c.waitFor(2*time.Minute, "every node Ready", func() bool {
		out, err := c.Kubectl("get", "nodes", "-o", `jsonpath={range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}`)
		return err == nil && strings.Count(out, "True") == n
	})
	c.waitFor(time.Minute, "the default service account", func() bool {
		_, err := c.Kubectl("-n", "default", "get", "serviceaccount", "default")
		return err == nil
	})
	return c
}

// network makes the bridge and each node's namespace, linked to it.
func (c *Cluster) network(n int) {
	c.ip("link", "add", bridge, "type", "bridge")
	c.ip("addr", "add", HostIP+"/24", "dev", bridge)
	c.ip("link", "set", bridge, "up")
	for i := 1; i <= n; i++ {
		ns, veth := fmt.Sprintf("dsk8s-n%d", i), fmt.Sprintf("dsk8s-v%d", i)
		c.ip("netns", "add", ns)
		c.ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
		c.ip("link", "set", veth, "master", bridge, "up")
		c.ip("-n", ns, "addr", "add", prefix+strconv.Itoa(10+i)+"/24", "dev", "eth0")
		c.ip("-n", ns, "link", "set", "eth0", "up")
		c.ip("-n", ns, "link", "set", "lo", "up")
		// A default route through the host's side, that goes nowhere
		// past it: the kubelet wants one to pick the node's address.
		c.ip("-n", ns, "route", "add", "default", "via", HostIP)
	}
}

// unnetwork undoes network.
func (c *Cluster) unnetwork(n int) {
	for i := 1; i <= n; i++ {
		exec.Command("ip", "netns", "delete", fmt.Sprintf("dsk8s-n%d", i)).Run()
	}
	exec.Command("ip", "link", "delete", bridge).Run()
}

func (c *Cluster) ip(args ...string) {
	c.t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		c.t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// certs writes the cluster's CA, the API server's certificate, an
// admin's and each node's client certificates with their kubeconfigs,
// and the service accounts' signing key.
func (c *Cluster) certs(n int) {
	now := time.Now().Add(-time.Hour)
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "dsk8s CA"}, NotBefore: now,
		NotAfter: now.Add(48 * time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		c.t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	c.write("ca.pem", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}))
	serial := int64(2)
	issue := func(name string, tmpl *x509.Certificate) {
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tmpl.SerialNumber, tmpl.NotBefore, tmpl.NotAfter = big.NewInt(serial), now, now.Add(48*time.Hour)
		serial++
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			c.t.Fatal(err)
		}
		kb, _ := x509.MarshalECPrivateKey(key)
		c.write(name+".pem", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
		c.write(name+"-key.pem", pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}))
	}
	issue("apiserver", &x509.Certificate{Subject: pkix.Name{CommonName: "kube-apiserver"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses: []net.IP{net.ParseIP(HostIP), net.ParseIP("127.0.0.1"), net.ParseIP("10.96.0.1")},
		DNSNames:    []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}})
	client := func(name, cn, org string) {
		issue(name, &x509.Certificate{Subject: pkix.Name{CommonName: cn, Organization: []string{org}},
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
		c.write(name+".kubeconfig", []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: dsk8s
  cluster: {server: "https://%s:%s", certificate-authority: %q}
users:
- name: %s
  user: {client-certificate: %q, client-key: %q}
contexts:
- name: dsk8s
  context: {cluster: dsk8s, user: %s, namespace: dsec}
current-context: dsk8s
`, HostIP, apiPort, c.path("ca.pem"), name, c.path(name+".pem"), c.path(name+"-key.pem"), name)))
	}
	client("admin", "admin", "system:masters")
	for i := 1; i <= n; i++ {
		client(fmt.Sprintf("n%d", i), fmt.Sprintf("system:node:n%d", i), "system:nodes")
	}
	c.Kubeconfig = c.path("admin.kubeconfig")
	sa, _ := rsa.GenerateKey(rand.Reader, 2048)
	c.write("sa-key.pem", pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(sa)}))
}

func (c *Cluster) path(name string) string { return filepath.Join(c.Dir, name) }

func (c *Cluster) write(name string, b []byte) {
	c.t.Helper()
	if err := os.WriteFile(c.path(name), b, 0o600); err != nil {
		c.t.Fatal(err)
	}
}

// controlPlane starts etcd, the API server, the controller manager and
// the scheduler, and waits for the API server to be ready.
func (c *Cluster) controlPlane() {
	b := func(name string) string { return filepath.Join(c.Bin, name) }
	c.procs = append(c.procs, c.start("etcd", "", b("etcd"), "--data-dir", c.path("etcd"),
		"--listen-client-urls", "http://127.0.0.1:23790", "--advertise-client-urls", "http://127.0.0.1:23790",
		"--listen-peer-urls", "http://127.0.0.1:23800", "--initial-advertise-peer-urls", "http://127.0.0.1:23800",
		"--initial-cluster", "default=http://127.0.0.1:23800", "--unsafe-no-fsync", "--log-level", "warn"))
	c.procs = append(c.procs, c.start("kube-apiserver", "", b("kube-apiserver"), "--etcd-servers", "http://127.0.0.1:23790",
		"--bind-address", HostIP, "--advertise-address", HostIP, "--secure-port", apiPort,
		"--tls-cert-file", c.path("apiserver.pem"), "--tls-private-key-file", c.path("apiserver-key.pem"),
		"--client-ca-file", c.path("ca.pem"), "--service-account-key-file", c.path("sa-key.pem"),
		"--service-account-signing-key-file", c.path("sa-key.pem"), "--service-account-issuer", "https://kubernetes.default.svc",
		"--service-cluster-ip-range", services, "--authorization-mode", "Node,RBAC", "--allow-privileged",
		"--kubelet-client-certificate", c.path("admin.pem"), "--kubelet-client-key", c.path("admin-key.pem"),
		"--kubelet-preferred-address-types", "InternalIP", "--profiling=false", "--v", "1"))
	c.waitFor(time.Minute, "the API server ready", func() bool {
		out, err := c.Kubectl("get", "--raw", "/readyz")
		return err == nil && strings.TrimSpace(out) == "ok"
	})
	c.procs = append(c.procs, c.start("kube-controller-manager", "", b("kube-controller-manager"),
		"--kubeconfig", c.Kubeconfig, "--leader-elect=false", "--service-account-private-key-file", c.path("sa-key.pem"),
		"--root-ca-file", c.path("ca.pem"), "--use-service-account-credentials", "--controllers", "*,-node-ipam-controller",
		"--bind-address", "127.0.0.1", "--secure-port", "10257", "--v", "1"))
	c.procs = append(c.procs, c.start("kube-scheduler", "", b("kube-scheduler"), "--kubeconfig", c.Kubeconfig,
		"--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", "10259", "--v", "1"))
}

// node starts node i's containerd (its kubelet starts once the images
// are in).
func (c *Cluster) node(i int) *Node {
	n := &Node{Name: fmt.Sprintf("n%d", i), IP: prefix + strconv.Itoa(10+i), NetNS: fmt.Sprintf("dsk8s-n%d", i), c: c}
	n.Dir = c.path(n.Name)
	n.Socket = filepath.Join(n.Dir, "containerd.sock")
	for _, d := range []string{"cni", "containerd", "kubelet", "pod-logs"} {
		if err := os.MkdirAll(filepath.Join(n.Dir, d), 0o755); err != nil {
			c.t.Fatal(err)
		}
	}
	c.write(n.Name+"/cni/10-bridge.conflist", []byte(fmt.Sprintf(`{"cniVersion": "1.0.0", "name": "dsk8s-%s", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.89.%d.0/24"}]], "dataDir": %q}}]}`, n.Name, i, filepath.Join(n.Dir, "ipam"))))
	c.write(n.Name+"/containerd.toml", []byte(fmt.Sprintf(`version = 2
root = %q
state = %q
[grpc]
  address = %q
[plugins."io.containerd.internal.v1.opt"]
  path = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/dsec/pause:1"
  restrict_oom_score_adj = true
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
`, filepath.Join(n.Dir, "containerd/root"), filepath.Join(n.Dir, "containerd/state"), n.Socket,
		filepath.Join(n.Dir, "containerd/opt"), filepath.Join(n.Dir, "cni"))))
	c.write(n.Name+"/resolv.conf", []byte("nameserver "+HostIP+"\n"))
	c.write(n.Name+"/kubelet.yaml", []byte(fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /dsk8s-%s
oomScoreAdj: 0
podLogsDir: %q
address: %s
readOnlyPort: 0
healthzPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: %q}
authorization: {mode: AlwaysAllow}
resolvConf: %q
failSwapOn: false
containerRuntimeEndpoint: unix://%s
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "1Mi", nodefs.available: "1%%", imagefs.available: "1%%", nodefs.inodesFree: "1%%"}
makeIPTablesUtilChains: false
serializeImagePulls: false
`, n.Name, filepath.Join(n.Dir, "pod-logs"), n.IP, c.path("ca.pem"), filepath.Join(n.Dir, "resolv.conf"), n.Socket)))
	// The kubelet's groups' root, in every hierarchy (the cpuset's with
	// all the CPUs and memory nodes).
	for _, h := range cgroup.Hierarchies() {
		d := filepath.Join(h, "dsk8s-"+n.Name)
		if err := os.MkdirAll(d, 0o755); err != nil {
			c.t.Fatal(err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if b, err := os.ReadFile(filepath.Join(h, f)); err == nil {
				os.WriteFile(filepath.Join(d, f), b, 0o644)
			}
		}
	}
	n.containerd = c.start(n.Name+"-containerd", n.NetNS, "containerd", "--config", filepath.Join(n.Dir, "containerd.toml"))
	c.waitFor(30*time.Second, n.Name+"'s containerd", func() bool {
		return exec.Command("ctr", "-a", n.Socket, "version").Run() == nil
	})
	return n
}

func (n *Node) kubeletArgs() []string {
	return []string{"--config", filepath.Join(n.Dir, "kubelet.yaml"), "--kubeconfig", n.c.path(n.Name + ".kubeconfig"),
		"--root-dir", filepath.Join(n.Dir, "kubelet"), "--cert-dir", filepath.Join(n.Dir, "kubelet", "pki"),
		"--hostname-override", n.Name, "--node-ip", n.IP, "--v", "1"}
}

// importImage imports the OCI archive as name (its tag the archive's).
func (n *Node) importImage(name, archive string) {
	out, err := exec.Command("ctr", "-a", n.Socket, "-n", "k8s.io", "images", "import", "--base-name", name, archive).CombinedOutput()
	if err != nil {
		n.c.t.Errorf("%s: import %s: %v: %s", n.Name, archive, err, out)
	}
}

// StopKubelet stops n's kubelet (kill -9: a node that stops answering).
func (n *Node) StopKubelet() { n.kubelet.kill() }

// Kubectl runs kubectl as the cluster's admin and returns its output.
func (c *Cluster) Kubectl(args ...string) (string, error) {
	return c.KubectlIn(nil, args...)
}

// KubectlIn is Kubectl with stdin.
func (c *Cluster) KubectlIn(stdin []byte, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(c.Bin, "kubectl"), append([]string{"--kubeconfig", c.Kubeconfig}, args...)...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("kubectl %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}

// Helm runs helm as the cluster's admin, its state under the cluster's
// directory, and returns its output.
func (c *Cluster) Helm(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(c.Bin, "helm"), append([]string{"--kubeconfig", c.Kubeconfig}, args...)...)
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+c.path("helm/cache"), "HELM_CONFIG_HOME="+c.path("helm/config"), "HELM_DATA_HOME="+c.path("helm/data"))
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("helm %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}

// MustKubectl is Kubectl, failing the test on an error.
func (c *Cluster) MustKubectl(args ...string) string {
	c.t.Helper()
	out, err := c.Kubectl(args...)
	if err != nil {
		c.t.Fatal(err)
	}
	return out
}

// WaitFor waits up to d for ok, failing the test past it.
func (c *Cluster) WaitFor(d time.Duration, what string, ok func() bool) {
	c.t.Helper()
	c.waitFor(d, what, ok)
}

func (c *Cluster) waitFor(d time.Duration, what string, ok func() bool) {
	c.t.Helper()
	for deadline := time.Now().Add(d); !ok(); time.Sleep(250 * time.Millisecond) {
		if p := c.dead(); p != nil {
			c.t.Fatalf("waiting for %s: %s exited (%v); its log: %s", what, p.name, p.cmd.ProcessState, p.log)
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("waited %s for %s", d, what)
		}
	}
}

// start starts a process of the cluster, in network namespace netns
// ("": the host's), its output to a log.
func (c *Cluster) start(name, netns, path string, args ...string) *proc {
	c.t.Helper()
	if netns != "" {
		args = append([]string{"--net=/run/netns/" + netns, "--", path}, args...)
		path = "nsenter"
	}
	log := c.path(name + ".log")
	f, err := os.Create(log)
	if err != nil {
		c.t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command(path, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("%s: %v", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: log, done: make(chan struct{})}
	go func() { cmd.Wait(); close(p.done) }()
	c.mu.Lock()
	c.started = append(c.started, p)
	c.mu.Unlock()
	return p
}

// dead is a process of the cluster that exited on its own, if any.
func (c *Cluster) dead() *proc {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range c.started {
		select {
		case <-p.done:
			if !p.killed.Load() {
				return p
			}
		default:
		}
	}
	return nil
}

// kill kills p and waits for it.
func (p *proc) kill() {
	if p == nil {
		return
	}
	p.killed.Store(true)
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// stop stops the cluster: pods first (their groups' processes killed,
// as a kubelet does), then the kubelets, the containers' shims and the
// containerds, then the control plane.
func (c *Cluster) stop() {
	for _, n := range c.Nodes {
		n.kubelet.kill()
	}
	for _, n := range c.Nodes {
		// Every container's process and shim: in the node's groups, or
		// a shim of its containerd.
		killTree("dsk8s-" + n.Name)
		killMatching(n.Socket)
		n.containerd.kill()
		unmountUnder(n.Dir)
	}
	for i := len(c.procs) - 1; i >= 0; i-- {
		c.procs[i].kill()
	}
	for _, n := range c.Nodes {
		removeTree("dsk8s-" + n.Name)
	}
	// What every kubelet on a host shares, made by ours.
	os.Remove(filepath.Join(kubeletShared, "device-plugins", "kubelet.sock"))
}

// kubeletShared is what every kubelet on a host writes to, whatever its
// root: removed after the cluster if it was not there before.
const kubeletShared = "/var/lib/kubelet"

// killTree kills every process in group (a path below each hierarchy's
// root) and the groups below it.
func killTree(group string) {
	for _, h := range cgroup.Hierarchies() {
		filepath.WalkDir(filepath.Join(h, group), func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				b, _ := os.ReadFile(filepath.Join(p, "cgroup.procs"))
				for _, f := range strings.Fields(string(b)) {
					if pid, err := strconv.Atoi(f); err == nil {
						syscall.Kill(pid, syscall.SIGKILL)
					}
				}
			}
			return nil
		})
	}
}

// removeTree removes group and the groups below it, deepest first,
// waiting for their processes to go.
func removeTree(group string) {
	for _, h := range cgroup.Hierarchies() {
		var dirs []string
		filepath.WalkDir(filepath.Join(h, group), func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			for try := 0; try < 200; try++ {
				if err := os.Remove(dirs[i]); err == nil || errors.Is(err, os.ErrNotExist) {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
	}
}

// killMatching kills the processes whose command line holds s (the
// shims of a containerd, named by its socket), and waits for them.
func killMatching(s string) {
	for try := 0; try < 100; try++ {
		found := false
		ents, _ := os.ReadDir("/proc")
		for _, e := range ents {
			pid, err := strconv.Atoi(e.Name())
			if err != nil || pid == os.Getpid() {
				continue
			}
			if b, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline")); bytes.Contains(b, []byte(s)) {
				syscall.Kill(pid, syscall.SIGKILL)
				found = true
			}
		}
		if !found {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// unmountUnder unmounts every mount below dir, deepest first.
func unmountUnder(dir string) {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var mps []string
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			mps = append(mps, f[4])
		}
	}
	for i := len(mps) - 1; i >= 0; i-- {
		syscall.Unmount(mps[i], syscall.MNT_DETACH)
	}
}

// dumpLogs prints the end of every process's log, for a failed test.
func (c *Cluster) dumpLogs() {
	logs, _ := filepath.Glob(c.path("*.log"))
	pods, _ := filepath.Glob(c.path("*/pod-logs/*/*/*.log")) // (the pods' containers')
	for _, l := range append(logs, pods...) {
		b, _ := os.ReadFile(l)
		if len(b) > 6000 {
			b = b[len(b)-6000:]
		}
		rel, _ := filepath.Rel(c.Dir, l)
		c.t.Logf("--- %s (its end):\n%s", rel, b)
	}
}
