package sdk_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// The ways a worker ends: stopped on purpose (SIGTERM, as a supervisor
// does; the shutdown request of dsec daemon stop) or killed.
var stopWays = []string{"SIGTERM", "shutdown", "SIGKILL"}

// TestStopTakesWhatWasMadeAhead: a worker stopped on purpose takes
// along what it made ahead of need (its spare inits, its primed sandbox,
// its FnCall pool's warm sandboxes, those being made as it stops too),
// and leaves no process, group or mount of them on the host; one killed
// with SIGKILL leaves them, and the next worker on the root removes
// them before it serves. Either way the user's sandbox runs on, and the
// next worker adopts it. Made ahead, they are listed by no dsec ps: the
// checks that removed every listed sandbox, stopped the worker and
// removed the root found a pool's init living on.
func TestStopTakesWhatWasMadeAhead(t *testing.T) {
	for _, way := range stopWays {
		t.Run(way, func(t *testing.T) {
			stopTakesMadeAhead(t, way, api.SandboxSpec{Layers: []string{"bb:1"}}, runtimetest.Config{})
		})
	}
}

// TestMicroVMStopTakesWhatWasMadeAhead is TestStopTakesWhatWasMadeAhead
// with guests: the primed sandbox and the pool's warm ones are microVMs,
// paused (their groups frozen), their QEMUs processes of their groups.
func TestMicroVMStopTakesWhatWasMadeAhead(t *testing.T) {
	tmpl := vmSpec("")
	tmpl.Layers, tmpl.Memory = []string{"bb:1"}, 256<<20
	for _, way := range stopWays {
		t.Run(way, func(t *testing.T) {
			stopTakesMadeAhead(t, way, tmpl, runtimetest.Config{MicroVM: microvmtest.Settings(t)})
		})
	}
}

// stopTakesMadeAhead runs a worker with two spares, a primed sandbox and
// a pool of two sandboxes of tmpl, and a sandbox of the user's of tmpl,
// and ends it the way way says: with a warm sandbox of the pool ready
// and another being made.
func stopTakesMadeAhead(t *testing.T, way string, tmpl api.SandboxSpec, cfg runtimetest.Config) {
	const size = 2
	cfg.Admission = worker.Admission{Spares: 2, Primed: 1}
	cfg.Pools = []worker.PoolConfig{{Name: "p", Size: size, Spec: tmpl}}
	w, c := setupWith(t, cfg)
	root, ctx := w.Root, context.Background()
	spec := tmpl
	spec.Name = "kept"
	kept := create(t, c, spec) // the next is primed on its layers
	info, err := kept.Inspect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	madeAhead := func() bool {
		v, err := c.Version(ctx)
		return err == nil && len(w.Spares()) == 2 && v.Warm.Primed == 1 && warm(t, c, "p") == size
	}
	waitFor(t, "the spares, the primed sandbox and the pool's", madeAhead)
	// What the checks did: a call, a create that takes the primed
	// sandbox, every listed sandbox but the kept one removed. The pool
	// and the primed sandbox are being made again as the worker ends.
	if _, res := call(t, c, sdk.CallOptions{Pool: "p"}, "true"); !res.Warm {
		t.Fatalf("the call found no warm sandbox: %+v", res)
	}
	spec.Name = "taken"
	if err := create(t, c, spec).Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
	listed, err := c.List(ctx)
	if err != nil || len(listed) != 1 || listed[0].Name != "kept" {
		t.Fatalf("ps lists %+v (%v), want the kept sandbox alone", listed, err)
	}
	before := hostState(t, root)
	if way == "SIGKILL" {
		w.Crash()
		if left := notKept(root, info.ID); len(left) == 0 { // else the next worker has nothing to remove
			t.Fatal("a worker killed with SIGKILL left nothing it made ahead")
		}
	} else {
		w.Stop(t, way == "shutdown")
		if left := notKept(root, info.ID); len(left) > 0 {
			t.Errorf("a worker stopped by %s left what it made ahead: %s", way, strings.Join(left, "\n  "))
		}
	}
	if unix.Kill(info.Pid, 0) != nil {
		t.Fatalf("the user's sandbox (init %d) did not outlive its worker", info.Pid)
	}

	// The next worker, once it serves: the last one's spares, primed
	// sandbox and pool's sandboxes are gone; its own are made anew; the
	// user's sandbox is adopted.
	w = runtimetest.StartWorkerWith(t, root, cfg)
	after := hostState(t, root)
	for _, what := range before {
		if strings.Contains(what, info.ID) {
			continue
		}
		if slices.Contains(after, what) {
			t.Errorf("the next worker keeps what the one ended by %s made ahead: %s", way, what)
		}
	}
	if out, res := run(t, c.Sandbox("kept"), "after", "echo $((6*7))"); out != "42\n" || res.ExitCode != 0 {
		t.Fatalf("the kept sandbox after its worker ended by %s: %q %+v", way, out, res)
	}
	// Its own primed sandbox waits for its first create.
	waitFor(t, "the next worker's own spares and pool's", func() bool { return len(w.Spares()) == 2 && warm(t, c, "p") == size })
}

// hostState is what of root's sandboxes is on the host, each thing
// named by the sandbox's ID: its processes (but a worker's own, in no
// sandbox's group), its groups, its mounts and its directory. The
// layers' mounts and the uppers' file system, which sandboxes share and
// the next worker mounts again, are left out.
func hostState(t *testing.T, root string) []string {
	var out []string
	for _, p := range runtimetest.Processes(root) {
		if !strings.HasSuffix(p, "()") {
			out = append(out, "process "+p)
		}
	}
	groups, err := runtime.Groups(nil, root)
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range groups {
		out = append(out, "group "+g)
	}
	b, _ := os.ReadFile("/proc/self/mountinfo")
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], filepath.Join(root, "sandboxes")+"/") {
			out = append(out, "mount "+f[4])
		}
	}
	dirs, _ := os.ReadDir(filepath.Join(root, "sandboxes"))
	for _, d := range dirs {
		out = append(out, "sandbox dir "+d.Name())
	}
	return out
}

// notKept is what of root's sandboxes is on the host once its worker
// has exited, but the sandbox id's: its processes, groups and directory,
// its layers' mounts, and the uppers' file system if its upper is there.
func notKept(root, id string) []string {
	var st runtime.State
	b, _ := os.ReadFile(filepath.Join(root, "sandboxes", id, "state.json"))
	json.Unmarshal(b, &st)
	var out []string
	for _, l := range append(runtimetest.Processes(root), runtimetest.Leftovers(root)...) {
		switch {
		case strings.Contains(l, id), l == "sandbox name "+st.Name:
		case st.UpperFS != "" && (l == "mount "+filepath.Join(root, "uppers") || strings.HasPrefix(l, "loop device ") && strings.HasSuffix(l, " on "+filepath.Join(root, "uppers.img"))):
		case strings.HasPrefix(l, "mount "+filepath.Join(root, "lower")+"/") && heldBy(l, id):
		default:
			out = append(out, l)
		}
	}
	return out
}

// heldBy says whether the layer mount a Leftovers line names is one the
// sandbox id holds.
func heldBy(line, id string) bool {
	mnt := strings.TrimPrefix(line, "mount ")
	layerDir := filepath.Dir(mnt)
	_, err := os.Stat(filepath.Join(layerDir, "users", id))
	return err == nil
}

// TestNextWorkerRaisesParentLimit: the next worker on a root, whose
// config leaves the host a smaller reserve (a config change, an
// upgrade), raises the memory limit of all sandboxes together while a
// sandbox of the last one keeps their parent group, and creates. On
// cgroup v1 it wrote memory.limit_in_bytes above the memory+swap limit
// the last one had set, which v1 refuses, and every create failed.
func TestNextWorkerRaisesParentLimit(t *testing.T) {
	mem, parent := hostMemory(t), ownParent(t, "raise")
	cfg := runtimetest.Config{CgroupParent: parent, Admission: worker.Admission{HostReserve: mem - 3<<30, Primed: -1, Spares: -1}}
	w, c := setupWith(t, cfg)
	limit := func() int64 {
		t.Helper()
		file := filepath.Join(cgroup.Root, "memory", parent, "memory.limit_in_bytes")
		if _, err := os.Stat(filepath.Join(cgroup.Root, "cgroup.controllers")); err == nil {
			file = filepath.Join(cgroup.Root, parent, "memory.max")
		}
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		return n
	}
	create(t, c, api.SandboxSpec{Name: "kept"})
	if n := limit(); n != 3<<30 {
		t.Fatalf("all sandboxes together are bounded by %d, want 3 GiB", n)
	}
	w.Stop(t, false)
	cfg.Admission.HostReserve = 0 // the default
	w = runtimetest.StartWorkerWith(t, w.Root, cfg)
	v, err := c.Version(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	create(t, c, api.SandboxSpec{Name: "next"})
	if n := limit(); n != v.Limits.MemoryBytes || n <= 3<<30 {
		t.Fatalf("all sandboxes together are bounded by %d after the next worker raised it to %d", n, v.Limits.MemoryBytes)
	}
}
