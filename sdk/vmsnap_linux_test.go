package sdk_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	lremote "github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// background starts the guest processes a memory snapshot must keep: a
// counter that counts in its shell's memory (and says so in a file), and
// a server listening on port 8080 that answers with a file.
const background = `mkdir -p /www && echo served > /www/index.html && httpd -p 8080 -h /www &&
	(i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done) >/dev/null 2>&1 </dev/null &
	echo $! > /tmp/counter.pid; sleep 0.5; cat /tmp/count`

// count reads the counter, and says whether its process (the one that
// was started, not one started since) still runs.
func count(t *testing.T, sb *sdk.Sandbox, id string) (int, bool) {
	t.Helper()
	for try := 0; ; try++ {
		// (The counter rewrites its file: a read between its truncation
		// and its write finds it empty. Another read, another step.)
		step := id
		if try > 0 {
			step = id + "-" + strconv.Itoa(try)
		}
		out, res := run(t, sb, step, `kill -0 $(cat /tmp/counter.pid) 2>/dev/null && echo alive; cat /tmp/count`)
		if res.ExitCode != 0 {
			t.Fatalf("%s: %q %+v", id, out, res)
		}
		f := append([]string{""}, strings.Fields(out)...)
		n, err := strconv.Atoi(f[len(f)-1])
		f = f[1:]
		if err != nil && try < 3 {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		if err != nil {
			t.Fatalf("%s: %q", id, out)
		}
		return n, len(f) > 0 && f[0] == "alive"
	}
}

// counting makes a microVM of 256 MiB named name that runs background
// (and more, a script), and returns it and its counter's count now.
func counting(t *testing.T, c *sdk.Client, name, more string) (*sdk.Sandbox, int) {
	t.Helper()
	spec := vmSpec(name)
	spec.Memory = 256 << 20
	sb := create(t, c, spec)
	if out, res := run(t, sb, "bg", background+more); res.ExitCode != 0 {
		t.Fatalf("background: %q %+v", out, res)
	}
	n, _ := count(t, sb, "before")
	return sb, n
}

// TestMicroVMMemorySnapshot: a memory snapshot of a microVM keeps its
// processes: a counter counting in memory and a listening server go on
// in the sandbox itself, in every branch of the snapshot, each its own
// from then on (its files, its counter, its host name, its RNG), and in
// a sandbox restored from it on a second host root that pulled it from
// a dir: remote.
func TestMicroVMMemorySnapshot(t *testing.T) {
	_, c := setupWith(t, runtimetest.Config{MicroVM: microvmtest.Settings(t)})
	ctx := context.Background()
	sb, before := counting(t, c, "src", "")
	snap, err := sb.PackDiff(ctx, api.PackRequest{Tag: "src:1", Memory: true})
	if err != nil {
		t.Fatal(err)
	}
	m := snap.Memory
	if m == nil || m.MemoryBytes != 256<<20 || m.StateBytes == 0 || m.RAMBytes == 0 || m.RAMBytes > 256<<20 || m.DiskBytes == 0 || m.PausedSeconds <= 0 {
		t.Fatalf("the snapshot's memory: %+v", m)
	}
	t.Logf("memory snapshot: paused %.3fs, state %d, RAM %d, disk %d bytes", m.PausedSeconds, m.StateBytes, m.RAMBytes, m.DiskBytes)
	// The sandbox itself runs on, its counter too.
	after, alive := count(t, sb, "after")
	if !alive || after < before {
		t.Fatalf("after the snapshot the counter is at %d (alive %v), was %d", after, alive, before)
	}
	// Two branches: each continues the guest, then goes its own way.
	t0 := time.Now()
	brs, err := c.Branch(ctx, api.BranchRequest{Snapshot: "src:1", N: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("2 branches in %v", time.Since(t0))
	rng := map[string]bool{}
	for i, br := range brs {
		info, err := br.Inspect(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.Backend != "microvm" || info.Memory != 256<<20 || info.Snapshot != "src:1" {
			t.Errorf("branch %d: %+v", i, info)
		}
		n, alive := count(t, br, "count")
		if !alive || n < before {
			t.Errorf("branch %d: the counter is at %d (alive %v): it does not go on from %d", i, n, alive, before)
		}
		time.Sleep(300 * time.Millisecond)
		if m, _ := count(t, br, "again"); m <= n {
			t.Errorf("branch %d: the counter stays at %d", i, m)
		}
		out, _ := run(t, br, "serve", "wget -q -O - http://127.0.0.1:8080/; hostname")
		if want := "served\n" + info.Name + "\n"; out != want {
			t.Errorf("branch %d: the server and host name: %q, want %q", i, out, want)
		}
		out, _ = run(t, br, "own", "test -e /tmp/other && echo shared; echo "+strconv.Itoa(i)+" > /tmp/other; od -An -tx1 -N16 /dev/urandom")
		if strings.Contains(out, "shared") {
			t.Errorf("branch %d sees another branch's file", i)
		}
		if rng[out] {
			t.Errorf("branch %d draws the same random bytes as another: its RNG was not reseeded", i)
		}
		rng[out] = true
		// The source's step ids are the branch's own to use.
		if _, res := run(t, br, "bg", "true"); res.ExitCode != 0 {
			t.Errorf("branch %d: a step id its source used: %+v", i, res)
		}
	}
	// A branch evicted and resumed goes on too.
	if err := brs[0].Evict(ctx); err != nil {
		t.Fatal(err)
	}
	if err := brs[0].Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if n, alive := count(t, brs[0], "resumed"); !alive || n < before {
		t.Errorf("an evicted branch resumed: the counter is at %d (alive %v)", n, alive)
	}
}

// TestMicroVMMemorySnapshotNAT: each branch of a memory snapshot of a
// sandbox in network mode nat has an address and a hardware address of
// its own, and reaches what its allowlist names; a branch of network
// mode none keeps its NIC, on no network; a snapshot taken without a
// NIC cannot start in network mode nat.
func TestMicroVMMemorySnapshotNAT(t *testing.T) {
	_, c := setupWith(t, runtimetest.Config{MicroVM: microvmtest.Settings(t)})
	runtimetest.Outside(t, "dsecvsnat", "10.203.0")
	ctx := context.Background()
	nat := &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy", Network: &api.NetworkPolicy{Mode: api.NetworkNAT,
		Egress: []api.EgressRule{{To: "10.203.0.2", Ports: []api.PortRange{{Low: 8080, High: 8080}}}}}}
	spec := vmSpec("natsrc")
	spec.Memory, spec.Policy = 256<<20, nat
	sb := create(t, c, spec)
	const dial = "for i in 1 2 3 4 5; do nc -w 2 10.203.0.2 8080 </dev/null 2>&1 && exit 0; sleep 0.2; done; exit 1"
	if out, res := run(t, sb, "out", dial); res.ExitCode != 0 || !strings.Contains(out, "hello from outside") {
		t.Fatalf("the source reaches nothing: %q %+v", out, res)
	}
	if _, err := sb.PackDiff(ctx, api.PackRequest{Tag: "natsrc:1", Memory: true}); err != nil {
		t.Fatal(err)
	}
	brs, err := c.Branch(ctx, api.BranchRequest{Snapshot: "natsrc:1", N: 2, Spec: api.SandboxSpec{Policy: nat}})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for i, br := range append(brs, sb) {
		info, err := br.Inspect(ctx)
		if err != nil {
			t.Fatal(err)
		}
		out, res := run(t, br, "addr", "ip -4 -o addr show eth0; cat /sys/class/net/eth0/address")
		if res.ExitCode != 0 || !strings.Contains(out, " "+info.Address+"/") {
			t.Errorf("sandbox %d's eth0 does not have its address %s: %q", i, info.Address, out)
		}
		f := strings.Fields(out)
		if mac := f[len(f)-1]; seen[info.Address] || seen[mac] {
			t.Errorf("sandbox %d shares its address %s or hardware address %s", i, info.Address, mac)
		} else {
			seen[info.Address], seen[mac] = true, true
		}
		if out, res := run(t, br, "reach", dial); res.ExitCode != 0 || !strings.Contains(out, "hello from outside") {
			t.Errorf("sandbox %d reaches nothing: %q %+v", i, out, res)
		}
	}
	// Network mode none: the guest's NIC is on no network.
	none, err := c.Branch(ctx, api.BranchRequest{Snapshot: "natsrc:1", N: 1, NamePrefix: "cut"})
	if err != nil {
		t.Fatal(err)
	}
	if out, res := run(t, none[0], "cut", "nc -w 2 10.203.0.2 8080 </dev/null 2>&1"); res.ExitCode == 0 || strings.Contains(out, "hello") {
		t.Errorf("a branch of network mode none reached the server: %q %+v", out, res)
	}
	// No NIC in the snapshot: no nat branch of it.
	plain := create(t, c, vmSpec("plain"))
	if _, err := plain.PackDiff(ctx, api.PackRequest{Tag: "plain:1", Memory: true}); err != nil {
		t.Fatal(err)
	}
	_, err = c.Branch(ctx, api.BranchRequest{Snapshot: "plain:1", N: 1, Spec: api.SandboxSpec{Policy: nat}})
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "had no network device") {
		t.Errorf("a nat branch of a guest without a NIC: %v", err)
	}
}

// TestMicroVMMemorySnapshotHosts: a memory snapshot goes to a dir:
// remote with its layers and memory, and a second worker's host that
// pulled it continues its guest; a host whose QEMU is another build
// refuses it, saying so, and keeps nothing of the attempt; a container
// has no memory to snapshot (not implemented); and QEMU killed in the
// middle of a snapshot leaves no snapshot, blob or ingest behind.
func TestMicroVMMemorySnapshotHosts(t *testing.T) {
	set := microvmtest.Settings(t)
	w, c := setupWith(t, runtimetest.Config{MicroVM: set})
	ctx := context.Background()
	sb, before := counting(t, c, "far", "")
	if _, err := sb.PackDiff(ctx, api.PackRequest{Tag: "far:1", Memory: true}); err != nil {
		t.Fatal(err)
	}
	shared, err := lremote.Open("dir://"+filepath.Join(t.TempDir(), "shared"), lremote.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := layer.ParseRef("far:1")
	local := must(store.Open(filepath.Join(w.Root, "store")))
	if _, err := lremote.Copy(ctx, lremote.Local(local), shared, ref, false, nil); err != nil {
		t.Fatal(err)
	}

	// A second host, which pulls it (dsec layer pull).
	w2, c2 := setupWith(t, runtimetest.Config{MicroVM: set})
	if _, err := lremote.Copy(ctx, shared, lremote.Local(must(store.Open(filepath.Join(w2.Root, "store")))), ref, false, nil); err != nil {
		t.Fatal(err)
	}
	brs, err := c2.Branch(ctx, api.BranchRequest{Snapshot: "far:1", N: 1})
	if err != nil {
		t.Fatal(err)
	}
	if n, alive := count(t, brs[0], "far"); !alive || n < before {
		t.Errorf("on the second host the counter is at %d (alive %v), from %d", n, alive, before)
	}

	// Another QEMU build: the same binary and a byte more.
	qemu := set.QEMU
	if qemu == "" {
		qemu = must(exec.LookPath("qemu-system-x86_64"))
	}
	other := filepath.Join(t.TempDir(), "qemu-system-x86_64")
	b := must(os.ReadFile(qemu))
	if err := os.WriteFile(other, append(b, 0), 0o755); err != nil {
		t.Fatal(err)
	}
	oset := set
	oset.QEMU = other
	w3, c3 := setupWith(t, runtimetest.Config{MicroVM: oset})
	if _, err := lremote.Copy(ctx, shared, lremote.Local(must(store.Open(filepath.Join(w3.Root, "store")))), ref, false, nil); err != nil {
		t.Fatal(err)
	}
	_, err = c3.Create(ctx, api.SandboxSpec{Name: "refused", Snapshot: "far:1"})
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "another QEMU build") {
		t.Errorf("a host of another QEMU build: %v", err)
	}
	if l, _ := c3.List(ctx); len(l) != 0 {
		t.Errorf("the refused restore left %+v", l)
	}

	// A container: no memory to snapshot.
	ct := create(t, c, api.SandboxSpec{Name: "ct"})
	if _, err := ct.PackDiff(ctx, api.PackRequest{Tag: "ct:1", Memory: true}); !errdefs.IsNotImplemented(err) {
		t.Errorf("a container's memory snapshot: %v, want not implemented", err)
	}

	// QEMU killed as it saves: no snapshot, blob or ingest is left.
	blobs := func() []string {
		l, _ := filepath.Glob(filepath.Join(w.Root, "store", "blobs", "sha256", "*"))
		return l
	}
	had := blobs()
	info, err := sb.Inspect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pids := qemuPids(t, info.Pid)
	done := make(chan error, 1)
	go func() {
		_, err := sb.PackDiff(ctx, api.PackRequest{Tag: "far:2", Memory: true})
		done <- err
	}()
	ingest := filepath.Join(w.Root, "store", "ingest")
	killed := false
	for deadline := time.Now().Add(time.Minute); !killed && time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		ents, _ := os.ReadDir(ingest)
		for _, e := range ents {
			if fi, err := e.Info(); err == nil && fi.Size() > 0 {
				syscall.Kill(pids[0], syscall.SIGKILL)
				killed = true
			}
		}
	}
	if !killed {
		t.Fatal("the snapshot wrote nothing to kill QEMU in the middle of")
	}
	if err := <-done; err == nil {
		t.Fatal("a snapshot whose QEMU was killed succeeded")
	}
	if _, err := layer.Resolve(ctx, local, "far:2"); !errdefs.IsNotFound(err) {
		t.Errorf("the killed snapshot is tagged: %v", err)
	}
	if now := blobs(); len(now) != len(had) {
		t.Errorf("the killed snapshot left blobs: %d before, %d after", len(had), len(now))
	}
	if ents, _ := os.ReadDir(ingest); len(ents) != 0 {
		t.Errorf("the killed snapshot left %d ingests", len(ents))
	}
}

// rss is a process's resident memory (VmRSS), in bytes.
func rss(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			return must(strconv.ParseInt(f[1], 10, 64)) << 10
		}
	}
	t.Fatalf("no VmRSS in %s", b)
	return 0
}

// TestMicroVMBalloon: what the guest frees goes back to the host (its
// balloon reports free pages, QEMU punches them out of the guest's
// memory file), and inspect shows the guest's memory used beside what
// the host holds for it.
func TestMicroVMBalloon(t *testing.T) {
	_, c := setupWith(t, runtimetest.Config{MicroVM: microvmtest.Settings(t)})
	ctx := context.Background()
	spec := vmSpec("balloon")
	spec.Memory = 512 << 20
	sb := create(t, c, spec)
	info, err := sb.Inspect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	qemu := qemuPids(t, info.Pid)[0]
	r0 := rss(t, qemu)
	// 200 MB of page cache, then freed: the file's pages go with it.
	if out, res := run(t, sb, "fill", "dd if=/dev/urandom of=/tmp/big bs=1M count=200 2>&1 && sync"); res.ExitCode != 0 {
		t.Fatalf("fill: %q %+v", out, res)
	}
	r1 := rss(t, qemu)
	if r1-r0 < 180<<20 {
		t.Fatalf("200 MB written in the guest: QEMU went from %d to %d MiB resident", r0>>20, r1>>20)
	}
	var used int64
	for deadline := time.Now().Add(10 * time.Second); used == 0 && time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if info, err := sb.Inspect(ctx); err == nil && info.VM != nil {
			used = info.VM.GuestMemoryUsed
			if info.VM.GuestMemory < 400<<20 || info.VM.GuestMemory > 512<<20 || info.MemoryBytes < r1/2 {
				t.Errorf("inspect: guest memory %d, host %d", info.VM.GuestMemory, info.MemoryBytes)
			}
		}
	}
	if used <= 0 || used > 256<<20 { // its cache is not used: it is available
		t.Errorf("the guest's memory used: %d MiB", used>>20)
	}
	if out, res := run(t, sb, "free", "rm /tmp/big"); res.ExitCode != 0 {
		t.Fatalf("free: %q %+v", out, res)
	}
	var r2 int64
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if r2 = rss(t, qemu); r1-r2 >= 150<<20 {
			break
		}
	}
	t.Logf("QEMU resident: %d MiB booted, %d MiB with 200 MB in use, %d MiB once freed", r0>>20, r1>>20, r2>>20)
	if r1-r2 < 150<<20 {
		t.Errorf("the guest freed 200 MB and QEMU still holds %d of %d MiB: the balloon gave back nothing", r2>>20, r1>>20)
	}
}

// TestMicroVMEvict: a paused microVM evicted gives its memory back to
// the host (its guest saved in its directory), says so, and resumes
// where it was: its processes, its files, across worker restarts; a
// stop forgets the saved guest and a start boots afresh on its disk.
func TestMicroVMEvict(t *testing.T) {
	cfg := runtimetest.Config{MicroVM: microvmtest.Settings(t)}
	w, c := setupWith(t, cfg)
	ctx := context.Background()
	sb, before := counting(t, c, "evicted", "; echo kept > /root/file")
	if err := sb.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	// A worker that restarts finds it paused, and evicts it.
	w.Kill()
	w = runtimetest.StartWorkerWith(t, w.Root, cfg)
	info, err := sb.Inspect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	shim := info.Pid
	if err := sb.Evict(ctx); err != nil {
		t.Fatal(err)
	}
	if info, err = sb.Inspect(ctx); err != nil {
		t.Fatal(err)
	}
	if info.Status != api.StatusPaused || info.VM == nil || !info.VM.Evicted || info.MemoryBytes != 0 || info.Pid != 0 || processAlive(shim) {
		t.Fatalf("evicted: %+v %+v (its shim %d alive: %v)", info, info.VM, shim, processAlive(shim))
	}
	if _, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"true"}}); err == nil {
		t.Error("an evicted sandbox ran a command")
	}
	// And one that restarts again finds it evicted, and resumes it.
	w.Kill()
	w = runtimetest.StartWorkerWith(t, w.Root, cfg)
	if err := sb.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if n, alive := count(t, sb, "after"); !alive || n < before {
		t.Errorf("resumed: the counter is at %d (alive %v), was %d", n, alive, before)
	}
	if out, _ := run(t, sb, "file", "cat /root/file"); out != "kept\n" {
		t.Errorf("resumed: %q", out)
	}
	left, _ := filepath.Glob(filepath.Join(w.Root, "sandboxes", "*", "saved.*"))
	if len(left) > 0 {
		t.Errorf("the saved guest is kept after it was restored: %v", left)
	}
	// Evicted, then stopped and started: a fresh boot on its disk.
	if err := sb.Evict(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Start(ctx); err != nil {
		t.Fatal(err)
	}
	// (A fresh boot's pids repeat: its counter's number may be taken by
	// another; the count standing still says it is not counting.)
	if out, _ := run(t, sb, "cold", "cat /root/file; a=$(cat /tmp/count); sleep 1; [ $a = $(cat /tmp/count) ] && echo fresh"); out != "kept\nfresh\n" {
		t.Errorf("started after an eviction and a stop: %q", out)
	}
}

// processAlive: pid runs (a zombie, its parent not yet reaping it, is
// dead).
func processAlive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	_, after, _ := strings.Cut(string(b), ") ")
	return !strings.HasPrefix(after, "Z") && !strings.HasPrefix(after, "X")
}
