package vms_test

import (
	"bytes"
	"context"
	"image"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/gateway"
	"github.com/dsec-project/dsec/internal/layer/lazy"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime/backend/backendtest"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/agent"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/vmm"
	"github.com/dsec-project/dsec/internal/runtime/driver/vms"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/vm"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// The vm backend through a real worker and the SDK: its own package, so
// that its boots (some 30 s each under TCG) run beside the sdk package's
// tests rather than after them.

// TestMain doubles as a sandbox init, a guest's shim and agent, and a
// worker.
func TestMain(m *testing.M) {
	container.MaybeInit()
	vmm.MaybeRun()
	agent.MaybeRun()
	runtimetest.MaybeWorker()
	os.Exit(m.Run())
}

// staticAgent is a static dsec-init: the agent a guest runs on its own
// libc.
func staticAgent(t testing.TB) string {
	t.Helper()
	a, err := microvmtest.Agent()
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// setup starts a worker of cfg on a fresh root with the test layers (bb:1,
// ws:1); cleanup kills it, removes every sandbox and checks nothing is
// left.
func setup(t *testing.T, cfg runtimetest.Config) (*runtimetest.Worker, *sdk.Client) {
	t.Helper()
	root := t.TempDir()
	runtimetest.Layers(t, root)
	w := runtimetest.StartWorkerWith(t, root, cfg)
	t.Cleanup(func() {
		w.Kill()
		runtimetest.Clean(root)
		if l := runtimetest.Leftovers(root); len(l) > 0 {
			t.Errorf("left behind: %v", l)
		}
	})
	c, err := sdk.New(sdk.Options{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	return w, c
}

func create(t *testing.T, c *sdk.Client, spec api.SandboxSpec) *sdk.Sandbox {
	t.Helper()
	sb, err := c.Create(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	return sb
}

// TestConformance holds the vm backend to the conformance suite every
// backend passes: full VMs booted through UEFI firmware from a Debian
// image, their agent a service of the guest's systemd (TCG here: each
// boot takes some 30 s). Its snapshots are block diffs of the VM's disk,
// which its branches boot.
func TestConformance(t *testing.T) {
	cfg := runtimetest.Config{VM: vms.Settings{Agent: staticAgent(t)}}
	backendtest.Run(t, func(t *testing.T) *backendtest.Env {
		w, c := setup(t, cfg)
		return &backendtest.Env{
			Backend: vms.VM,
			Layers:  []string{runtimetest.VMImage(t, w.Root)},
			Client:  c,
			Restart: func(t *testing.T) *sdk.Client {
				w.Kill()
				w = runtimetest.StartWorkerWith(t, w.Root, cfg)
				c, err := sdk.New(sdk.Options{Root: w.Root})
				if err != nil {
					t.Fatal(err)
				}
				return c
			},
			Leftovers: func() []string { return runtimetest.Leftovers(w.Root) },
			Root:      w.Root,
			BlockDiff: true,
		}
	})
}

// tcpWorker is a worker's config that serves TCP with TLS on loopback
// too, and what makes it a gateway's worker once started.
func tcpWorker(t *testing.T) (runtimetest.Config, func(*runtimetest.Worker) gateway.Worker) {
	t.Helper()
	certs := t.TempDir()
	if err := auth.MakeCerts(certs, []string{"localhost", "127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	cfg := runtimetest.Config{Listen: []string{"tcp://" + addr},
		TLS: worker.TLS{Cert: filepath.Join(certs, auth.ServerFile), Key: filepath.Join(certs, auth.ServerKeyFile)}}
	return cfg, func(w *runtimetest.Worker) gateway.Worker {
		admin, _, err := auth.Open(w.Root).Create(auth.Admin, 0)
		if err != nil {
			t.Fatal(err)
		}
		return gateway.Worker{URL: "tcp://" + addr, Token: admin, CA: filepath.Join(certs, auth.CAFile)}
	}
}

// gatewayOf serves a gateway of workers on loopback until the test
// ends, and returns a client of an admin token of its.
func gatewayOf(t *testing.T, workers ...gateway.Worker) *sdk.Client {
	t.Helper()
	root := t.TempDir()
	g, err := gateway.New(gateway.Config{Tokens: auth.Open(root), Workers: workers, Heartbeat: 100 * time.Millisecond, DownAfter: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	g.Heartbeat(ctx)
	go g.Run(ctx)
	srv := &http.Server{Handler: g}
	go srv.Serve(l)
	t.Cleanup(func() { cancel(); srv.Close() })
	secret, _, err := auth.Open(root).New(auth.Spec{Scope: auth.Admin})
	if err != nil {
		t.Fatal(err)
	}
	c, err := sdk.New(sdk.Options{Host: "tcp://" + l.Addr().String(), Token: secret})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestVMSnapshots: a full VM's snapshots are block diffs of its disk,
// each over the last: a second one holds only what changed since the
// first, and one over its bound is refused without changing the chain;
// the sandbox runs on over them, and after a stop and a start boots its
// whole chain; a worker that publishes its snapshots pushes them to its
// remote; a sandbox booted from the first sees only what the first
// holds, and its writes past its disk bound are an I/O error in the
// guest, which answers on; the lineage lists both, and a snapshot another stands on is
// not removed without force; a memory snapshot's branches continue the
// guest (testMemorySnapshot).
func TestVMSnapshots(t *testing.T) {
	shared := t.TempDir() // the worker publishes its snapshots there
	// (Chains of 4 images at most: the fourth snapshot flattens.)
	w, c := setup(t, runtimetest.Config{VM: vms.Settings{Agent: staticAgent(t), MaxChain: 4}, RemoteURL: "dir://" + shared, PublishSnapshots: true})
	img := runtimetest.VMImage(t, w.Root)
	ctx := context.Background()
	sb := create(t, c, api.SandboxSpec{Name: "src", Backend: vms.VM, Layers: []string{img}})
	run := func(sb *sdk.Sandbox, script string) string {
		t.Helper()
		var out bytes.Buffer
		res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"sh", "-c", script}, Stdout: &out, Stderr: &out})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("%s in %s: %v %+v: %s", script, sb.Name, err, res, out.String())
		}
		return out.String()
	}
	// 4 MiB of one file, then 1 MiB of another: the second diff holds
	// the second, not the first again.
	run(sb, "head -c 4194304 /dev/urandom > /root/big && echo one > /root/step")
	s1, err := sb.PackDiff(ctx, api.PackRequest{Tag: "vs:1"})
	if err != nil {
		t.Fatal(err)
	}
	run(sb, "head -c 1048576 /dev/urandom > /root/small && echo two > /root/step")
	// A diff over the bound is refused before anything is taken.
	if _, err := sb.PackDiff(ctx, api.PackRequest{Tag: "vs:big", MaxBytes: 64 << 10}); !errdefs.IsOutOfRange(err) || !strings.Contains(err.Error(), "over the bound of 65536") {
		t.Errorf("a diff over --max-bytes: %v, want out of range", err)
	}
	s2, err := sb.PackDiff(ctx, api.PackRequest{Tag: "vs:2"})
	if err != nil {
		t.Fatal(err)
	}
	if s1.Bytes < 4<<20 || s1.Incremental || s1.Parent != img {
		t.Errorf("the first snapshot: %+v, want 4 MiB and more over %s", s1, img)
	}
	if s2.Bytes < 1<<20 || s2.Bytes >= s1.Bytes || !s2.Incremental || s2.Parent != "vs:1" {
		t.Errorf("the second snapshot: %+v, want a diff of what changed since vs:1 (%d bytes)", s2, s1.Bytes)
	}
	// Published as they were made: the remote holds both, whole.
	rs, err := store.Open(shared)
	if err != nil {
		t.Fatal(err)
	}
	for _, sn := range []api.Snapshot{s1, s2} {
		if got, err := vm.Lookup(ctx, rs, sn.Name); err != nil || got.Blob.Digest.String() != sn.Digest || got.Sandbox != "src" {
			t.Errorf("%s in the remote: %+v %v", sn.Name, got, err)
		}
	}
	if _, err := sb.PackDiff(ctx, api.PackRequest{Tag: "vs:2"}); !errdefs.IsAlreadyExists(err) {
		t.Errorf("a snapshot's tag again: %v", err)
	}
	sum := run(sb, "cat /root/step; md5sum /root/big /root/small | cut -d' ' -f1")
	if !strings.HasPrefix(sum, "two\n") {
		t.Fatalf("the source after two snapshots: %q", sum)
	}
	// A branch of the first: its files, not what came after.
	br, err := c.Branch(ctx, api.BranchRequest{Snapshot: "vs:1", N: 1, Spec: api.SandboxSpec{Disk: 64 << 20}})
	if err != nil || len(br) != 1 {
		t.Fatalf("branch vs:1: %v %v", br, err)
	}
	if out := run(br[0], "cat /root/step; ls /root/small 2>/dev/null || echo none; md5sum /root/big | cut -d' ' -f1"); out != "one\nnone\n"+strings.Split(sum, "\n")[1]+"\n" {
		t.Errorf("a branch of vs:1: %q, want step one, no second file, the first's bytes (%q)", out, sum)
	}
	if info, err := br[0].Inspect(ctx); err != nil || info.Backend != vms.VM {
		t.Errorf("the branch: %+v %v", info, err)
	}
	// Its writes past its disk bound are an I/O error in the guest
	// (QEMU's werror=report), not a paused VM: it answers on.
	var out bytes.Buffer
	res, err := br[0].Exec(ctx, sdk.ExecOptions{Args: []string{"sh", "-c", "head -c 134217728 /dev/urandom > /root/fill && sync /root/fill"}, Stdout: &out, Stderr: &out})
	if err != nil || res.ExitCode == 0 || !strings.Contains(out.String(), "error") {
		t.Errorf("128 MiB written past a 64 MiB disk bound: %+v %v, %q; want an I/O error", res, err, out.String())
	}
	if out := run(br[0], "echo alive"); out != "alive\n" {
		t.Errorf("the branch after its disk filled: %q", out)
	}
	// The source, stopped and started, boots its chain: all it wrote.
	if err := sb.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if out := run(sb, "cat /root/step; md5sum /root/big /root/small | cut -d' ' -f1"); out != sum {
		t.Errorf("the source after a stop and a start: %q, want %q", out, sum)
	}
	nodes, err := c.Snapshots(ctx)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]api.SnapshotNode{}
	for _, n := range nodes {
		got[n.Name] = n
	}
	if n := got["vs:1"]; n.Parent != img || !slices.Equal(n.Children, []string{"vs:2"}) || !slices.Contains(n.Sandboxes, "src") || !slices.Contains(n.Sandboxes, br[0].Name) ||
		!slices.Equal(n.Branches, []string{br[0].Name}) {
		t.Errorf("vs:1 in the lineage: %+v", n)
	}
	if n := got["vs:2"]; n.Parent != "vs:1" || !n.Incremental || !slices.Equal(n.Sandboxes, []string{"src"}) || len(n.Branches) != 0 {
		t.Errorf("vs:2 in the lineage: %+v", n)
	}
	if err := c.RemoveSnapshot(ctx, "vs:1", false); !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "snapshot vs:2") {
		t.Errorf("removing vs:1, which vs:2 stands on: %v", err)
	}
	if err := br[0].Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
	mem := testMemorySnapshot(t, c, sb, run)
	// Another host's worker, whose store holds none of it, continues the
	// memory snapshot published: it pulls it from the remote as it makes
	// the branch.
	w2, c2 := setup(t, runtimetest.Config{VM: vms.Settings{Agent: staticAgent(t)}, RemoteURL: "dir://" + shared})
	t0 := time.Now()
	far, err := c2.Branch(ctx, api.BranchRequest{Snapshot: "vs:3", N: 1, NamePrefix: "far"})
	if err != nil || len(far) != 1 {
		t.Fatalf("branch vs:3 on another worker: %v %v", far, err)
	}
	if out := run(far[0], "cat /dev/shm/marker; kill -0 $(cat /dev/shm/pid) && echo alive; cat /root/step"); out != "in-memory\nalive\ntwo\n" {
		t.Errorf("a branch of the published memory snapshot on another worker: %q, want the guest as it was", out)
	}
	took := time.Since(t0)
	// Its disks stayed in the remote, read lazily: what the guest read
	// since it went on, not the disks.
	fs2, err := store.Open(filepath.Join(w2.Root, "store"))
	if err != nil {
		t.Fatal(err)
	}
	pulled, err := vm.Lookup(ctx, fs2, "vs:3")
	if err != nil || !pulled.Lazy() {
		t.Fatalf("the other worker's store after the branch: %+v %v, want vs:3 with its disks' window tables", pulled, err)
	}
	var fetched, total int64
	for _, d := range pulled.Chain {
		if _, err := os.Stat(fs2.BlobPath(d.Digest)); err == nil {
			t.Errorf("disk %s was pulled into the other worker's store, not read lazily", d.Digest)
		}
		st, err := lazy.ReadStats(w2.Root, d.Digest)
		if err != nil {
			t.Errorf("disk %s: no lazy reads: %v", d.Digest, err)
			continue
		}
		fetched, total = fetched+st.BytesFetched, total+st.BytesTotal
	}
	if fetched == 0 || fetched > total/2 {
		t.Errorf("the branch fetched %d bytes of its %d-byte disk chain, want what it read", fetched, total)
	}
	if _, err := os.Stat(fs2.BlobPath(pulled.State.Digest)); err != nil {
		t.Errorf("the saved guest was not pulled: %v", err)
	}
	t.Logf("another worker pulled the memory snapshot (its disks lazily: %d of %d MiB fetched) and continued it in %v",
		fetched>>20, total>>20, took.Round(time.Millisecond))
	// A snapshot there of the lazily read disk: its chain's tables are
	// the pulled image's, so it is read lazily wherever it goes too.
	far1, err := far[0].PackDiff(ctx, api.PackRequest{Tag: "far:1"})
	if err != nil {
		t.Fatal(err)
	}
	if img, err := vm.Lookup(ctx, fs2, far1.Name); err != nil || !img.Lazy() || len(img.Chain) != 5 {
		t.Errorf("a snapshot of a VM read lazily: %+v %v, want a chain of 5 with its window tables", img, err)
	}
	// Stopped and started, it boots its chain again, its disks still
	// read lazily (the store's images name their tables).
	if err := far[0].Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := far[0].Start(ctx); err != nil {
		t.Fatal(err)
	}
	if out := run(far[0], "cat /root/step"); out != "two\n" {
		t.Errorf("the lazily read branch after a stop and a start: %q", out)
	}
	if err := far[0].Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
	testFlatten(t, w.Root, sb, run)
	for _, s := range append(mem, sb) {
		if err := s.Remove(ctx, true); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"vs:5", "vs:4", "vs:3", "vs:2"} {
		if err := c.RemoveSnapshot(ctx, name, false); err != nil {
			t.Errorf("removing %s, which nothing stands on: %v", name, err)
		}
	}
}

// testFlatten: a snapshot of sb, whose disk is a chain of 4 images (its
// worker's vm.max_chain), flattens it first, while the guest runs: the
// snapshot is the whole disk, alone, and the next one a diff over it;
// a stop and a start boot the short chain, with all the guest wrote.
func testFlatten(t *testing.T, root string, sb *sdk.Sandbox, run func(*sdk.Sandbox, string) string) {
	ctx := context.Background()
	s, err := store.Open(filepath.Join(root, "store"))
	if err != nil {
		t.Fatal(err)
	}
	chain := func(tag string) []ocispec.Descriptor {
		t.Helper()
		img, err := vm.Lookup(ctx, s, tag)
		if err != nil || !img.Lazy() {
			t.Fatalf("VM image %s: %+v %v", tag, img, err)
		}
		return img.Chain
	}
	if n := len(chain("vs:3")); n != 4 {
		t.Fatalf("vs:3 is a chain of %d images, want 4", n)
	}
	run(sb, "echo flat > /root/flat && sync")
	s4, err := sb.PackDiff(ctx, api.PackRequest{Tag: "vs:4"})
	if err != nil {
		t.Fatal(err)
	}
	flat := chain("vs:4")
	if len(flat) != 1 || s4.Incremental || len(s4.Layers) != 0 || flat[0].Size < 100<<20 {
		t.Errorf("a snapshot of a chain of 4: %+v, its chain %v: want the whole disk, alone", s4, flat)
	}
	run(sb, "echo over > /root/over && sync")
	s5, err := sb.PackDiff(ctx, api.PackRequest{Tag: "vs:5"})
	if err != nil {
		t.Fatal(err)
	}
	if c5 := chain("vs:5"); len(c5) != 2 || c5[0].Digest != flat[0].Digest || c5[1].Size > 64<<20 || !s5.Incremental {
		t.Errorf("the next snapshot: %+v, its chain %v: want a diff over vs:4's disk", s5, c5)
	}
	run(sb, "echo top > /root/top && sync")
	if err := sb.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if out := run(sb, "cat /root/step /root/flat /root/over /root/top"); out != "two\nflat\nover\ntop\n" {
		t.Errorf("after a flatten, a snapshot, a stop and a start: %q", out)
	}
}

// testMemorySnapshot: a memory snapshot of sb (running, its disk at
// vs:2) holds its guest whole: a branch goes on where the guest was, its
// memory-only files, its processes and its screen (text typed at the
// console's prompt) as they were, while the source goes on apart; a
// disk-only branch boots the snapshot's disk instead. It returns the
// branches made.
func testMemorySnapshot(t *testing.T, c *sdk.Client, sb *sdk.Sandbox, run func(*sdk.Sandbox, string) string) []*sdk.Sandbox {
	ctx := context.Background()
	run(sb, "echo in-memory > /dev/shm/marker && (setsid sleep 3600 </dev/null >/dev/null 2>&1 & echo $! > /dev/shm/pid)")
	calm := settled(t, sb, nil)
	if err := sb.Type(ctx, "dsec-memory"); err != nil {
		t.Fatal(err)
	}
	typed := settled(t, sb, calm)
	s3, err := sb.PackDiff(ctx, api.PackRequest{Tag: "vs:3", Memory: true})
	if err != nil {
		t.Fatal(err)
	}
	if s3.Memory == nil || s3.Memory.StateBytes < 1<<20 || s3.Parent != "vs:2" || !s3.Incremental {
		t.Errorf("a memory snapshot: %+v (memory %+v), want a saved guest over vs:2", s3, s3.Memory)
	}
	run(sb, "echo after > /dev/shm/marker") // the source goes on apart
	t0 := time.Now()
	br, err := c.Branch(ctx, api.BranchRequest{Snapshot: "vs:3", N: 1, NamePrefix: "warm"})
	if err != nil || len(br) != 1 {
		t.Fatalf("branch vs:3: %v %v", br, err)
	}
	restored := time.Since(t0)
	if out := run(br[0], "cat /dev/shm/marker; kill -0 $(cat /dev/shm/pid) && echo alive; cat /root/step"); out != "in-memory\nalive\ntwo\n" {
		t.Errorf("a branch of the memory snapshot: %q, want its memory-only file, its process and its disk as they were", out)
	}
	// Both roots thawed: each writes its own disk.
	for _, s := range []*sdk.Sandbox{sb, br[0]} {
		if out := run(s, "echo "+s.Name+" > /root/own && sync /root/own && cat /root/own"); out != s.Name+"\n" {
			t.Errorf("%s writes its disk after the memory snapshot: %q", s.Name, out)
		}
	}
	if shot, _ := screenshot(t, br[0]); !diff(typed, shot).Empty() {
		t.Errorf("the branch's screen differs from its source's at the snapshot in %v", diff(typed, shot))
	}
	if out := run(sb, "cat /dev/shm/marker"); out != "after\n" {
		t.Errorf("the source after its memory snapshot: %q", out)
	}
	t.Logf("a full VM continued from its memory snapshot in %v (snapshot: guest paused %v, saved state %d MiB)",
		restored.Round(time.Millisecond), time.Duration(s3.Memory.PausedSeconds*float64(time.Second)).Round(time.Millisecond), s3.Memory.StateBytes>>20)
	// Disk only: the snapshot's disk, booted; its memory is not.
	cold, err := c.Branch(ctx, api.BranchRequest{Snapshot: "vs:3", N: 1, NamePrefix: "cold", Spec: api.SandboxSpec{DiskOnly: true}})
	if err != nil || len(cold) != 1 {
		t.Fatalf("branch vs:3 --disk-only: %v %v", cold, err)
	}
	if out := run(cold[0], "cat /dev/shm/marker 2>/dev/null || echo none; cat /root/step"); out != "none\ntwo\n" {
		t.Errorf("a disk-only branch of the memory snapshot: %q, want its disk alone", out)
	}
	if shot, _ := screenshot(t, cold[0]); diff(typed, shot).Empty() {
		t.Error("a disk-only branch, booted, shows the screen its source had at the snapshot")
	}
	return append(br, cold...)
}

// settled is sb's screen once two screenshots a second apart agree,
// and (with from) differ from from in a rectangle of at least least
// pixels each way (nothing: any change).
func settled(t *testing.T, sb *sdk.Sandbox, from *image.RGBA, least ...image.Point) *image.RGBA {
	t.Helper()
	var min image.Point
	if len(least) > 0 {
		min = least[0]
	}
	away := func(shot *image.RGBA) bool {
		if from == nil {
			return true
		}
		d := diff(from, shot)
		return !d.Empty() && d.Dx() >= min.X && d.Dy() >= min.Y
	}
	var last *image.RGBA
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(time.Second) {
		shot, _ := screenshot(t, sb)
		if last != nil && diff(last, shot).Empty() && away(shot) {
			return shot
		}
		last = shot
		if time.Now().After(deadline) {
			t.Fatal("the screen never settled")
		}
	}
}

// TestVMNetwork: a full VM of network mode nat reaches what its policy
// allows (a server outside the host), through the NIC its agent
// configures; a branch of its memory snapshot, nat too, goes on with an
// address and a hardware address of its own and reaches the server,
// and one of network mode none does not.
func TestVMNetwork(t *testing.T) {
	w, c := setup(t, runtimetest.Config{VM: vms.Settings{Agent: staticAgent(t)}})
	runtimetest.Outside(t, "dsecfvnat", "10.207.0")
	img := runtimetest.VMImage(t, w.Root)
	ctx := context.Background()
	nat := &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy", Network: &api.NetworkPolicy{Mode: api.NetworkNAT,
		Egress: []api.EgressRule{{To: "10.207.0.2", Ports: []api.PortRange{{Low: 8080, High: 8080}}}}}}
	sb := create(t, c, api.SandboxSpec{Name: "net", Backend: vms.VM, Layers: []string{img}, Policy: nat})
	sh := func(sb *sdk.Sandbox, script string) (string, int) {
		t.Helper()
		var out bytes.Buffer
		res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"bash", "-c", script}, Stdout: &out, Stderr: &out})
		if err != nil {
			t.Fatalf("%s in %s: %v", script, sb.Name, err)
		}
		return out.String(), res.ExitCode
	}
	const dial = "for i in 1 2 3 4 5; do timeout 3 bash -c 'exec 3<>/dev/tcp/10.207.0.2/8080 && cat <&3' 2>&1 && exit 0; sleep 0.5; done; exit 1"
	if out, code := sh(sb, dial); code != 0 || !strings.Contains(out, "hello from outside") {
		t.Fatalf("a full VM of network mode nat reaches nothing: %q (exit %d)", out, code)
	}
	if _, err := sb.PackDiff(ctx, api.PackRequest{Tag: "vn:1", Memory: true}); err != nil {
		t.Fatal(err)
	}
	br, err := c.Branch(ctx, api.BranchRequest{Snapshot: "vn:1", N: 1, Spec: api.SandboxSpec{Policy: nat}})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]string{}
	for _, s := range []*sdk.Sandbox{sb, br[0]} {
		info, err := s.Inspect(ctx)
		if err != nil {
			t.Fatal(err)
		}
		out, code := sh(s, "hostname -I; cat /sys/class/net/e*/address")
		f := strings.Fields(out)
		if code != 0 || len(f) < 2 || !slices.Contains(f, info.Address) {
			t.Errorf("%s does not have its address %s: %q", s.Name, info.Address, out)
			continue
		}
		mac := f[len(f)-1]
		if o, ok := seen[info.Address]; ok || seen[mac] != "" {
			t.Errorf("%s shares its address %s or hardware address %s with %s", s.Name, info.Address, mac, o+seen[mac])
		}
		seen[info.Address], seen[mac] = s.Name, s.Name
		if out, code := sh(s, dial); code != 0 || !strings.Contains(out, "hello from outside") {
			t.Errorf("%s reaches nothing: %q (exit %d)", s.Name, out, code)
		}
	}
	// Network mode none: the continued guest's NIC is on no network.
	cut, err := c.Branch(ctx, api.BranchRequest{Snapshot: "vn:1", N: 1, NamePrefix: "cut"})
	if err != nil {
		t.Fatal(err)
	}
	if out, code := sh(cut[0], "timeout 3 bash -c 'exec 3<>/dev/tcp/10.207.0.2/8080 && cat <&3' 2>&1"); code == 0 || strings.Contains(out, "hello") {
		t.Errorf("a branch of network mode none reached the server: %q", out)
	}
	for _, s := range []*sdk.Sandbox{sb, br[0], cut[0]} {
		if err := s.Remove(ctx, true); err != nil {
			t.Fatal(err)
		}
	}
}
