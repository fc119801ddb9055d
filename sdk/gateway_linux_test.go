package sdk_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
	"github.com/dsec-project/dsec/internal/gateway"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// fleetWorker is a worker of a test's fleet: TCP with TLS on loopback,
// its root, config (to start it again) and an admin token.
type fleetWorker struct {
	w     *runtimetest.Worker
	cfg   runtimetest.Config
	url   string
	ca    string
	admin string
}

func startFleetWorker(t testing.TB) *fleetWorker {
	t.Helper()
	return startFleetWorkerWith(t, runtimetest.Config{})
}

// startFleetWorkerWith is startFleetWorker with cfg (its TCP API set
// here).
func startFleetWorkerWith(t testing.TB, cfg runtimetest.Config) *fleetWorker {
	t.Helper()
	certs := t.TempDir()
	if err := auth.MakeCerts(certs, []string{"localhost", "127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	cfg.Listen = []string{"tcp://" + addr}
	cfg.TLS = worker.TLS{Cert: filepath.Join(certs, auth.ServerFile), Key: filepath.Join(certs, auth.ServerKeyFile)}
	w, _ := setupWith(t, cfg)
	admin, _, err := auth.Open(w.Root).Create(auth.Admin, 0)
	if err != nil {
		t.Fatal(err)
	}
	return &fleetWorker{w: w, cfg: cfg, url: "tcp://" + addr, ca: filepath.Join(certs, auth.CAFile), admin: admin}
}

// hosts numbers the hosts startHost makes in this test process.
var hosts atomic.Int32

// startHost starts a worker as a host of its own on this kernel: in a
// network namespace of its own (linked to the test's by a veth pair of
// its own, 10.P.N.1 here and 10.P.N.2 there, where it listens) and
// a mount namespace of its own, on its own root, with cfg.
func startHost(t testing.TB, cfg runtimetest.Config) *fleetWorker {
	t.Helper()
	// (Named by this process too: a run cut short leaves its own.)
	n := hosts.Add(1)
	ns, link := fmt.Sprintf("dsgw%d-h%d", os.Getpid(), n), fmt.Sprintf("dsgw%dh%d", os.Getpid()%100000, n%1000)
	sub := fmt.Sprintf("10.%d.%d", 240+os.Getpid()%8, n%256)
	ip := sub + ".2"
	sh := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	sh("netns", "add", ns)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
	sh("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
	t.Cleanup(func() { exec.Command("ip", "link", "del", link).Run() })
	sh("addr", "add", sub+".1/30", "dev", link)
	sh("link", "set", link, "up")
	sh("-n", ns, "addr", "add", ip+"/30", "dev", "eth0")
	sh("-n", ns, "link", "set", "eth0", "up")
	sh("-n", ns, "link", "set", "lo", "up")
	sh("-n", ns, "route", "add", "default", "via", sub+".1")
	certs := t.TempDir()
	if err := auth.MakeCerts(certs, []string{"localhost", ip}); err != nil {
		t.Fatal(err)
	}
	cfg.Listen = []string{"tcp://" + ip + ":7443"}
	cfg.TLS = worker.TLS{Cert: filepath.Join(certs, auth.ServerFile), Key: filepath.Join(certs, auth.ServerKeyFile)}
	cfg.MountNS, cfg.NetNS = true, ns
	// Its root a shared mount, as a host's / is under systemd: what the
	// worker mounts there is the test's to see and clean, and the next
	// worker's (a new mount namespace) to take back.
	root := t.TempDir()
	runtimetest.Layers(t, root)
	if err := unix.Mount(root, root, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) }) // (after the worker's cleanups)
	if err := unix.Mount("", root, "", unix.MS_SHARED|unix.MS_REC, ""); err != nil {
		t.Fatal(err)
	}
	w, _ := setupAt(t, root, cfg)
	admin, _, err := auth.Open(w.Root).Create(auth.Admin, 0)
	if err != nil {
		t.Fatal(err)
	}
	return &fleetWorker{w: w, cfg: cfg, url: "tcp://" + ip + ":7443", ca: filepath.Join(certs, auth.CAFile), admin: admin}
}

// startGateway serves a gateway of ws on loopback until the test ends
// (or stop), heartbeating every 100 ms; a worker silent for 1.5 s is
// down (a loaded machine's worker may take a few heartbeats to answer).
func startGateway(t testing.TB, root string, ws []*fleetWorker) (addr string, stop func()) {
	return startGatewayWith(t, gateway.Config{Tokens: auth.Open(root), Heartbeat: 100 * time.Millisecond, DownAfter: 1500 * time.Millisecond}, ws, worker.TLS{})
}

// startGatewayWith serves a gateway of cfg and ws on loopback (with
// TLS's certificate, if any) until the test ends, or stop.
func startGatewayWith(t testing.TB, cfg gateway.Config, ws []*fleetWorker, tls worker.TLS) (addr string, stop func()) {
	t.Helper()
	for _, w := range ws {
		cfg.Workers = append(cfg.Workers, gateway.Worker{URL: w.url, Token: w.admin, CA: w.ca})
	}
	g, err := gateway.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	l, err := worker.ListenTCP("tcp://"+freeAddr(t), tls, false)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	g.Heartbeat(ctx)
	go g.Run(ctx)
	srv := &http.Server{Handler: g}
	go srv.Serve(l)
	stop = func() { cancel(); srv.Close() }
	t.Cleanup(stop)
	return l.Addr().String(), stop
}

// TestGateway: three workers as three hosts (each in network and mount
// namespaces of its own, with its own root, TCP API and CA) behind one
// gateway, driven with the gateway's tokens exactly as one worker:
// creates spread over the workers, execs (with input) and files reach
// the sandbox's worker, a name is the fleet's, a tenant sees only its
// own sandboxes on every worker; a worker killed is down within its
// heartbeats (its sandboxes unreachable, a request about one an
// infrastructure failure at once, creates elsewhere) and, started
// again, serves its sandboxes again; a gateway started anew routes as
// the first did.
func TestGateway(t *testing.T) {
	ctx := context.Background()
	ws := []*fleetWorker{startHost(t, runtimetest.Config{}), startHost(t, runtimetest.Config{}), startHost(t, runtimetest.Config{})}
	gwRoot := t.TempDir()
	tokens := auth.Open(gwRoot)
	mint := func(scope string) string {
		s, _, err := tokens.Create(scope, 0)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	aliceToken, bobToken, adminToken := mint(auth.Sandboxes), mint(auth.Sandboxes), mint(auth.Admin)
	addr, stop := startGateway(t, gwRoot, ws)
	client := func(token string) *sdk.Client {
		c, err := sdk.New(sdk.Options{Host: "tcp://" + addr, Token: token})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	alice, bob, admin := client(aliceToken), client(bobToken), client(adminToken)
	waitUp := func(want int) []api.Node {
		t.Helper()
		var nodes []api.Node
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			var err error
			if nodes, err = admin.Nodes(ctx); err == nil {
				up := 0
				for _, n := range nodes {
					if n.Up {
						up++
					}
				}
				if up == want {
					return nodes
				}
			}
		}
		t.Fatalf("%d workers up, want %d: %+v", len(nodes), want, nodes)
		return nil
	}
	waitUp(3)
	if _, err := alice.Nodes(ctx); !errdefs.IsPermissionDenied(err) {
		t.Errorf("a tenant's node ls: %v", err)
	}
	if v, err := alice.Version(ctx); err != nil || !v.Gateway || !slices.Contains(v.Backends, "container") {
		t.Errorf("the gateway's version: %+v %v", v, err)
	}

	// Six creates: two on each worker.
	where := map[string]string{} // sandbox: its worker
	for _, name := range []string{"a0", "a1", "a2", "a3", "a4", "a5"} {
		sb, err := alice.Create(ctx, api.SandboxSpec{Name: name, Layers: []string{"ws:1", "bb:1"}, Memory: 64 << 20})
		if err != nil {
			t.Fatal(err)
		}
		where[name] = sb.Info.Node
	}
	per := map[string]int{}
	for _, n := range where {
		per[n]++
	}
	for _, w := range ws {
		if per[w.url] != 2 {
			t.Errorf("sandboxes per worker: %v, want 2 on each", per)
			break
		}
	}
	// Execs, with input, and files, on each worker.
	for name := range where {
		sb := alice.Sandbox(name)
		var out bytes.Buffer
		res, err := sb.Exec(ctx, sdk.ExecOptions{ID: "cat", Args: []string{"sh", "-c", "cat; echo $((6*7))"}, Stdin: strings.NewReader("in\n"), Stdout: &out})
		if err != nil || res.ExitCode != 0 || out.String() != "in\n42\n" {
			t.Errorf("exec in %s through the gateway: %+v %v %q", name, res, err, out.String())
		}
		if err := sb.WriteFile(ctx, "/tmp/f", strings.NewReader(name), 0o644); err != nil {
			t.Errorf("write in %s: %v", name, err)
		} else if b := new(bytes.Buffer); sb.ReadFile(ctx, "/tmp/f", b) != nil || b.String() != name {
			t.Errorf("read in %s: %q", name, b)
		}
	}
	// A name is the fleet's.
	if _, err := alice.Create(ctx, api.SandboxSpec{Name: "a0", Layers: []string{"ws:1", "bb:1"}}); !errdefs.IsAlreadyExists(err) {
		t.Errorf("a0 again: %v", err)
	}
	// Bob sees none of Alice's, anywhere; Alice none of his.
	if l, err := bob.List(ctx); err != nil || len(l) != 0 {
		t.Errorf("bob's list: %+v %v", l, err)
	}
	for name := range where {
		if _, err := bob.Sandbox(name).Inspect(ctx); !errdefs.IsNotFound(err) {
			t.Errorf("bob inspecting %s: %v", name, err)
		}
		if _, err := bob.Sandbox(name).Exec(ctx, sdk.ExecOptions{Args: []string{"true"}}); !errdefs.IsNotFound(err) {
			t.Errorf("bob's exec in %s: %v", name, err)
		}
	}
	// Nor by a header his request's Connection names, which a relay
	// drops as hop-by-hop: the gateway's own go on after that.
	for _, hop := range []string{auth.OnBehalfHeader, auth.OnBehalfHeader + ", Authorization"} {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "GET /v1/sandboxes/a0/execs/cat HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer %s\r\nConnection: %s, close\r\n\r\n", bobToken, hop)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil || resp.StatusCode != http.StatusNotFound {
			t.Errorf("bob's request for a0's exec with Connection: %s: %v %v", hop, resp.Status, err)
		}
		conn.Close()
	}
	// Nor by an E2B front's headers, which vouch for a spec as the
	// admin's: the gateway sends on only its own front's. Unbounded
	// memory is the admin's to ask for, in a create or a call.
	for _, path := range []string{"/v1/sandboxes", "/v1/calls"} {
		body := `{"layers":["ws:1","bb:1"],"memory":-1}`
		if path == "/v1/calls" {
			body = `{"spec":` + body + `,"run":true,"args":["true"]}`
		}
		req, _ := http.NewRequest("POST", "http://"+addr+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+bobToken)
		req.Header.Set(e2b.HeaderTemplate, "base")
		req.Header.Set(e2b.HeaderActAs, e2b.ActAsAdmin)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("bob's %s unbounded, as a template's: %s", path, resp.Status)
		}
	}
	// A name is free again as soon as its sandbox is removed.
	if err := alice.Sandbox("a5").Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
	if sb, err := alice.Create(ctx, api.SandboxSpec{Name: "a5", Layers: []string{"ws:1", "bb:1"}, Memory: 64 << 20}); err != nil {
		t.Errorf("a5 again, once removed: %v", err)
	} else {
		where["a5"] = sb.Info.Node
	}
	if _, err := bob.Create(ctx, api.SandboxSpec{Name: "b0", Layers: []string{"ws:1", "bb:1"}, Memory: 64 << 20}); err != nil {
		t.Fatal(err)
	}
	if l, err := alice.List(ctx); err != nil || len(l) != 6 || slices.ContainsFunc(l, func(s api.Sandbox) bool { return s.Name == "b0" }) {
		t.Errorf("alice's list: %d %v", len(l), err)
	}

	// A batch of 60, spread over the three as they have room.
	items, err := batchOf(t, alice, api.SandboxSpec{Name: "g", Layers: []string{"ws:1", "bb:1"}, Memory: 64 << 20}, 60)
	if err != nil {
		t.Fatal(err)
	}
	per = map[string]int{}
	for i, it := range items {
		if it.Error != nil || it.Sandbox == nil || it.Sandbox.Name != api.BatchName("g", i) || it.Sandbox.Status != api.StatusRunning {
			t.Fatalf("batch item %d: %+v %+v", i, it, it.Error)
		}
		per[it.Sandbox.Node]++
	}
	for _, w := range ws {
		if per[w.url] < 15 {
			t.Errorf("a batch of 60 per worker: %v, want about 20 on each", per)
			break
		}
	}
	if _, err := batchOf(t, alice, api.SandboxSpec{Name: "g", Layers: []string{"ws:1", "bb:1"}}, 2); !errdefs.IsAlreadyExists(err) {
		t.Errorf("a batch of taken names: %v", err)
	}
	if res, err := alice.Sandbox("g-59").Exec(ctx, sdk.ExecOptions{Args: []string{"true"}}); err != nil || res.ExitCode != 0 {
		t.Errorf("exec in g-59: %+v %v", res, err)
	}

	// A worker killed: down within its heartbeats.
	dead := ws[1]
	dead.w.Crash()
	var onDead string
	for name, n := range where {
		if n == dead.url {
			onDead = name
		}
	}
	if onDead == "" {
		t.Fatalf("no sandbox on worker %s: %v", dead.url, where)
	}
	waitUp(2)
	start := time.Now()
	_, err = alice.Sandbox(onDead).Exec(ctx, sdk.ExecOptions{Args: []string{"true"}})
	if !sdk.IsInfra(err) || time.Since(start) > 2*time.Second {
		t.Errorf("exec in %s on the dead worker: %v after %v, want an infrastructure failure at once", onDead, err, time.Since(start))
	}
	// Bob: not found, as on a worker up.
	if _, err := bob.Sandbox(onDead).Exec(ctx, sdk.ExecOptions{Args: []string{"true"}}); !errdefs.IsNotFound(err) {
		t.Errorf("bob's exec in %s on the dead worker: %v", onDead, err)
	}
	l, err := alice.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range l {
		if (s.Node == dead.url) != (s.Status == api.StatusUnreachable) {
			t.Errorf("%s on %s is %s", s.Name, s.Node, s.Status)
		}
	}
	for i := range 4 {
		sb, err := alice.Create(ctx, api.SandboxSpec{Layers: []string{"ws:1", "bb:1"}, Memory: 64 << 20})
		if err != nil {
			t.Fatalf("create %d with a worker down: %v", i, err)
		}
		if sb.Info.Node == dead.url {
			t.Errorf("a create went to the dead worker")
		}
	}
	// Started again, it serves its sandboxes again.
	dead.w = runtimetest.StartWorkerWith(t, dead.w.Root, dead.cfg)
	waitUp(3)
	var out bytes.Buffer
	if res, err := alice.Sandbox(onDead).Exec(ctx, sdk.ExecOptions{Args: []string{"cat", "/tmp/f"}, Stdout: &out}); err != nil || res.ExitCode != 0 || out.String() != onDead {
		t.Errorf("exec in %s once its worker is back: %+v %v %q", onDead, res, err, out.String())
	}

	// A gateway started anew routes as the first did, and keeps its
	// cordons.
	if err := admin.Cordon(ctx, ws[2].url, true); err != nil {
		t.Fatal(err)
	}
	stop()
	addr, _ = startGateway(t, gwRoot, ws)
	alice, admin = client(aliceToken), client(adminToken)
	if nodes, err := admin.Nodes(ctx); err != nil || len(nodes) != 3 || !nodes[2].Cordoned || nodes[0].Cordoned {
		t.Errorf("the cordons of a gateway started anew: %+v %v", nodes, err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		out.Reset()
		res, err := alice.Sandbox("a3").Exec(ctx, sdk.ExecOptions{Args: []string{"cat", "/tmp/f"}, Stdout: &out})
		if err == nil && res.ExitCode == 0 && out.String() == "a3" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("exec in a3 through a new gateway: %+v %v %q", res, err, out.String())
		}
	}
	all, err := alice.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range all {
		if err := alice.Sandbox(s.Name).Remove(ctx, true); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("remove %s: %v", s.Name, err)
		}
	}
}

// gatewayClient is a client of the gateway at addr with a new token of
// spec's, of the gateway's on root.
func gatewayClient(t *testing.T, root, addr string, spec auth.Spec) *sdk.Client {
	t.Helper()
	secret, _, err := auth.Open(root).New(spec)
	if err != nil {
		t.Fatal(err)
	}
	c, err := sdk.New(sdk.Options{Host: "tcp://" + addr, Token: secret})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestGatewaySnapshots: three workers that publish their snapshots to
// one shared dir: remote, behind a gateway. A snapshot packed on one
// worker is listed once, and branched on another (the first cordoned)
// from the remote; a fork (a branch like a sandbox) goes to that
// sandbox's worker; branch names are the fleet's; a create on a
// snapshot goes where it may; another tenant sees none of it; a
// snapshot is removed from every worker that holds it.
func TestGatewaySnapshots(t *testing.T) {
	ctx := context.Background()
	shared := "dir://" + filepath.Join(t.TempDir(), "shared")
	var ws []*fleetWorker
	for range 3 {
		ws = append(ws, startHost(t, runtimetest.Config{RemoteURL: shared, PublishSnapshots: true}))
	}
	gwRoot := t.TempDir()
	addr, _ := startGateway(t, gwRoot, ws)
	client := func(scope string) *sdk.Client { return gatewayClient(t, gwRoot, addr, auth.Spec{Scope: scope}) }
	alice, bob, admin := client(auth.Sandboxes), client(auth.Sandboxes), client(auth.Admin)
	v, err := admin.Version(ctx)
	if err != nil || !v.Gateway {
		t.Fatalf("version through the gateway: %+v, %v", v, err)
	}
	read := func(sb *sdk.Sandbox) string {
		t.Helper()
		var b bytes.Buffer
		if err := sb.ReadFile(ctx, "/state", &b); err != nil {
			t.Fatalf("read /state of %s: %v", sb.Name, err)
		}
		return b.String()
	}

	src := create(t, alice, api.SandboxSpec{Name: "src"})
	if err := src.WriteFile(ctx, "/state", strings.NewReader("step-1"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := src.PackDiff(ctx, api.PackRequest{Tag: "roll:1"}); err != nil {
		t.Fatal(err)
	}
	snaps, err := alice.Snapshots(ctx)
	if err != nil || len(snaps) != 1 || snaps[0].Name != "roll:1" {
		t.Fatalf("alice's snapshots through the gateway: %+v, %v", snaps, err)
	}
	if snaps, err := bob.Snapshots(ctx); err != nil || len(snaps) != 0 {
		t.Errorf("bob's snapshots: %+v, %v", snaps, err)
	}
	if _, err := bob.Branch(ctx, api.BranchRequest{Snapshot: "roll:1", N: 1}); !errdefs.IsNotFound(err) {
		t.Errorf("bob branches alice's snapshot: %v", err)
	}

	// Its worker cordoned, the branches go to another, which finds the
	// snapshot in the remote; they are numbered on across the fleet.
	home := src.Info.Node
	if err := admin.Cordon(ctx, home, true); err != nil {
		t.Fatal(err)
	}
	brs, err := alice.Branch(ctx, api.BranchRequest{Snapshot: "roll:1", N: 2})
	if err != nil {
		t.Fatal(err)
	}
	more, err := alice.Branch(ctx, api.BranchRequest{Snapshot: "roll:1", N: 1})
	if err != nil {
		t.Fatal(err)
	}
	brs = append(brs, more...)
	var names []string
	for _, b := range brs {
		names = append(names, b.Name)
		if b.Info.Node == home || b.Info.Node == "" {
			t.Errorf("branch %s on %q, the cordoned worker's %s", b.Name, b.Info.Node, home)
		}
		if got := read(b); got != "step-1" {
			t.Errorf("branch %s reads %q", b.Name, got)
		}
	}
	if want := []string{"roll-1-1", "roll-1-2", "roll-1-3"}; !slices.Equal(names, want) {
		t.Errorf("branch names %v, want %v", names, want)
	}
	// Two at once take numbers one after the other.
	twin := make([][]*sdk.Sandbox, 2)
	var wg sync.WaitGroup
	for i := range twin {
		wg.Go(func() {
			var err error
			if twin[i], err = alice.Branch(ctx, api.BranchRequest{Snapshot: "roll:1", N: 1}); err != nil {
				t.Errorf("branch %d of two at once: %v", i, err)
			}
		})
	}
	wg.Wait()
	for _, b := range twin {
		brs = append(brs, b...)
	}
	if len(brs) != 5 || brs[3].Name == brs[4].Name {
		t.Errorf("two branches at once: %d made", len(brs))
	}
	onSnap, err := alice.Create(ctx, api.SandboxSpec{Snapshot: "roll:1"})
	if err != nil {
		t.Fatal(err)
	}
	if onSnap.Info.Node == home || read(onSnap) != "step-1" {
		t.Errorf("a create on the snapshot: on %s (cordoned %s)", onSnap.Info.Node, home)
	}
	if err := admin.Cordon(ctx, home, false); err != nil {
		t.Fatal(err)
	}

	// A fork is on its sandbox's worker.
	forks, err := alice.Branch(ctx, api.BranchRequest{Snapshot: "roll:1", N: 1, NamePrefix: "fork", Like: "src"})
	if err != nil {
		t.Fatal(err)
	}
	if forks[0].Name != "fork-1" || forks[0].Info.Node != home {
		t.Errorf("fork %s on %s, want fork-1 on %s", forks[0].Name, forks[0].Info.Node, home)
	}
	if _, err := bob.Branch(ctx, api.BranchRequest{Snapshot: "roll:1", N: 1, Like: "src"}); !errdefs.IsNotFound(err) {
		t.Errorf("bob forks alice's sandbox: %v", err)
	}

	// Removed while sandboxes stand on it: refused; then from everywhere.
	if err := alice.RemoveSnapshot(ctx, "roll:1", false); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("removing a snapshot sandboxes stand on: %v", err)
	}
	for _, sb := range append(append(brs, forks...), onSnap) {
		if err := sb.Remove(ctx, true); err != nil {
			t.Fatal(err)
		}
	}
	if err := alice.RemoveSnapshot(ctx, "roll:1", false); err != nil {
		t.Fatal(err)
	}
	if snaps, err := alice.Snapshots(ctx); err != nil || len(snaps) != 0 {
		t.Errorf("alice's snapshots after rm: %+v, %v", snaps, err)
	}
	if err := alice.RemoveSnapshot(ctx, "roll:1", false); !errdefs.IsNotFound(err) {
		t.Errorf("removing it again: %v", err)
	}
	// Its tag is the fleet's still: the shared remote names it.
	if _, err := src.PackDiff(ctx, api.PackRequest{Tag: "roll:1"}); !errdefs.IsAlreadyExists(err) || !strings.Contains(err.Error(), "shared remote") {
		t.Errorf("a pack under a tag the shared remote holds: %v", err)
	}
	src.Remove(ctx, true)

	// The admin squashes a chain through the gateway, on the worker
	// that holds it, which publishes the squash: branched on another
	// (the first cordoned) from the remote. A tenant may not squash, and
	// a tag some worker holds is refused.
	asrc := create(t, admin, api.SandboxSpec{Name: "asrc"})
	for i, state := range []string{"a-1", "a-2"} {
		if err := asrc.WriteFile(ctx, "/state", strings.NewReader(state), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := asrc.PackDiff(ctx, api.PackRequest{Tag: fmt.Sprint("chain:", i+1)}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := alice.Squash(ctx, "chain:2", "flat:1"); !errdefs.IsPermissionDenied(err) {
		t.Errorf("a tenant's squash: %v, want permission denied", err)
	}
	if _, err := admin.Squash(ctx, "chain:2", "chain:1"); !errdefs.IsAlreadyExists(err) {
		t.Errorf("a squash to a tag a worker holds: %v, want already exists", err)
	}
	if _, err := admin.Squash(ctx, "nothing:1", "flat:1"); !errdefs.IsNotFound(err) {
		t.Errorf("a squash of no snapshot: %v, want not found", err)
	}
	flat, err := admin.Squash(ctx, "chain:2", "flat:1")
	if err != nil || flat.Name != "flat:1" || flat.Folded < 2 {
		t.Fatalf("a squash through the gateway: %+v, %v", flat, err)
	}
	if err := admin.Cordon(ctx, asrc.Info.Node, true); err != nil {
		t.Fatal(err)
	}
	fb, err := admin.Branch(ctx, api.BranchRequest{Snapshot: "flat:1", N: 1})
	if err != nil || len(fb) != 1 || fb[0].Info.Node == asrc.Info.Node {
		t.Fatalf("a branch of the squash, its worker cordoned: %+v, %v", fb, err)
	}
	if got := read(fb[0]); got != "a-2" {
		t.Errorf("the squash's branch reads %q, want a-2", got)
	}
	admin.Cordon(ctx, asrc.Info.Node, false)
	for _, sb := range append(fb, asrc) {
		sb.Remove(ctx, true)
	}
}

// TestSandboxPorts: a sandbox's server (in network mode nat) is reached
// through the API's port route: on its worker, through a gateway, and
// through E2B's PORT-ID route of the worker's front and of a gateway's
// front (which has no other way to a sandbox on another host); another
// tenant reaches nothing, nor does a sandbox without an address.
func TestSandboxPorts(t *testing.T) {
	ctx := context.Background()
	e2bAddr := freeAddr(t)
	fw := startFleetWorkerWith(t, runtimetest.Config{E2B: worker.E2B{Listen: e2bAddr}})
	gwRoot := t.TempDir()
	gw := gateway.Config{Tokens: auth.Open(gwRoot), Heartbeat: 100 * time.Millisecond, DownAfter: 1500 * time.Millisecond}
	for _, w := range []*fleetWorker{fw} {
		gw.Workers = append(gw.Workers, gateway.Worker{URL: w.url, Token: w.admin, CA: w.ca})
	}
	g, err := gateway.New(gw)
	if err != nil {
		t.Fatal(err)
	}
	gctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g.Heartbeat(gctx)
	go g.Run(gctx)
	gwAPI := httptest.NewServer(g)
	defer gwAPI.Close()
	inproc, stopInProc := e2b.InProcess(gctx, g.ActAs())
	defer stopInProc()
	front, err := e2b.New(e2b.Options{Transport: inproc, Fleet: g,
		Authorize: func(key string) (string, bool, error) {
			tok, err := gw.Tokens.Check(key, time.Now())
			return tok.ID, tok.Scope == auth.Admin, err
		}})
	if err != nil {
		t.Fatal(err)
	}
	gwFront := httptest.NewServer(front)
	defer gwFront.Close()
	gwAdmin, _, err := gw.Tokens.Create(auth.Admin, 0)
	if err != nil {
		t.Fatal(err)
	}
	gwTenant, _, err := gw.Tokens.Create(auth.Sandboxes, 0)
	if err != nil {
		t.Fatal(err)
	}

	c, err := sdk.New(sdk.Options{Host: fw.url, Token: fw.admin, TLSCA: fw.ca})
	if err != nil {
		t.Fatal(err)
	}
	nat := &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy", Network: &api.NetworkPolicy{Mode: api.NetworkNAT}}
	web := create(t, c, api.SandboxSpec{Name: "web", Policy: nat})
	if out, res := run(t, web, "httpd", "mkdir -p /www && echo served > /www/index.html && httpd -p 8080 -h /www && "+
		"echo /:user:secret > /www.conf && httpd -p 8081 -h /www -c /www.conf"); res.ExitCode != 0 {
		t.Fatalf("httpd: %q %+v", out, res)
	}
	info, err := web.Inspect(ctx)
	if err != nil || info.Address == "" {
		t.Fatalf("web's address: %+v, %v", info, err)
	}
	// Another process of the host's reaches no sandbox: only the
	// worker's own connections (the port route's) get answers.
	if conn, err := net.DialTimeout("tcp", info.Address+":8080", time.Second); err == nil {
		conn.Close()
		t.Errorf("a host process reached the sandbox's server at %s:8080", info.Address)
	}
	plain := create(t, c, api.SandboxSpec{Name: "plain"})
	defer plain.Remove(ctx, true)
	defer web.Remove(ctx, true)

	workerTLS, err := auth.ClientTLS(fw.ca, "", "")
	if err != nil {
		t.Fatal(err)
	}
	toWorker := &http.Client{Transport: &http.Transport{TLSClientConfig: workerTLS}}
	get := func(client *http.Client, url string, header map[string]string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest("GET", url, nil)
		for k, v := range header {
			req.Header.Set(k, v)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("GET %s: %v", url, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	bearer := func(tok string) map[string]string { return map[string]string{"Authorization": "Bearer " + tok} }
	workerURL := "https://" + strings.TrimPrefix(fw.url, "tcp://")
	for _, c := range []struct {
		what   string
		client *http.Client
		url    string
		header map[string]string
		code   int
		body   string
	}{
		{"the worker's API", toWorker, workerURL + "/v1/sandboxes/web/ports/8080/index.html", bearer(fw.admin), 200, "served\n"},
		{"a gateway's API", http.DefaultClient, gwAPI.URL + "/v1/sandboxes/web/ports/8080/index.html", bearer(gwAdmin), 200, "served\n"},
		{"another tenant's", http.DefaultClient, gwAPI.URL + "/v1/sandboxes/web/ports/8080/index.html", bearer(gwTenant), 404, "no sandbox web"},
		{"no address", http.DefaultClient, gwAPI.URL + "/v1/sandboxes/plain/ports/8080/", bearer(gwAdmin), 503, "no address to reach port 8080"},
		{"a server's own 401, through a gateway", http.DefaultClient, gwAPI.URL + "/v1/sandboxes/web/ports/8081/index.html", bearer(gwAdmin), 401, ""},
		{"a bad port", toWorker, workerURL + "/v1/sandboxes/web/ports/http/", bearer(fw.admin), 400, "bad port"},
		{"the worker's E2B front", toWorker, "https://" + e2bAddr + "/index.html",
			map[string]string{"E2b-Sandbox-Id": "web", "E2b-Sandbox-Port": "8080", "X-Access-Token": fw.admin}, 200, "served\n"},
		{"a gateway's E2B front", http.DefaultClient, gwFront.URL + "/index.html",
			map[string]string{"E2b-Sandbox-Id": "web", "E2b-Sandbox-Port": "8080", "X-Access-Token": gwAdmin}, 200, "served\n"},
		{"a gateway's E2B front, another tenant's key", http.DefaultClient, gwFront.URL + "/index.html",
			map[string]string{"E2b-Sandbox-Id": "web", "E2b-Sandbox-Port": "8080", "X-Access-Token": gwTenant}, 404, ""},
	} {
		if code, body := get(c.client, c.url, c.header); code != c.code || !strings.Contains(body, c.body) {
			t.Errorf("%s: %d %q, want %d %q", c.what, code, body, c.code, c.body)
		}
	}
}
