package runtime_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
)

// waitPrimed waits until p has n sandboxes ready and returns the dirs
// of root's primed sandboxes.
func waitPrimed(t *testing.T, p *runtime.Primed, root string, n int) []string {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		// Those no longer wanted are removed in the background.
		dirs := unnamedDirs(root)
		if p.Ready() == n && len(dirs) == n {
			return dirs
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d primed sandboxes ready, dirs %v, want %d", p.Ready(), dirs, n)
		}
	}
}

// unnamedDirs are the directories of root's sandboxes no name points
// at: primed ones and calls'.
func unnamedDirs(root string) []string {
	var dirs []string
	for _, id := range runtime.Unnamed(root) {
		dirs = append(dirs, filepath.Join(root, "sandboxes", id))
	}
	return dirs
}

func primedState(t *testing.T, dir string) runtime.State {
	t.Helper()
	var st runtime.State
	b, err := os.ReadFile(filepath.Join(dir, "state.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	return st
}

// TestPrimed: a create on the layers of the last one takes the sandbox
// made ahead (its init, its mounts) and gets its own name, host name,
// limits and state; one that asks for more (a policy) or other layers
// makes its own; nothing is left after the sandboxes and the primer go.
func TestPrimed(t *testing.T) {
	root, s := layers(t)
	ctx := context.Background()
	m := &runtime.Host{Root: root, Store: s, Drivers: prepared(runtime.NewDrivers(runtime.DriverConfig{Root: root, Spares: 1}))}
	p := m.StartPrimed(1)
	m.Primed = p
	closed := false
	t.Cleanup(func() {
		if !closed {
			p.Close()
			m.Drivers.Close()
		}
		runtimetest.Clean(root)
	})
	create := func(name string, policy *api.Policy, layers ...string) *runtime.Sandbox {
		t.Helper()
		sb, err := m.Create(ctx, runtime.Spec{Name: name, Layers: layers, Policy: policy,
			Limits: cgroup.Limits{Pids: 128}, Env: []string{"STEP=" + name}})
		p.Refill() // as the worker does once the create is answered
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sb.Remove() })
		return sb
	}

	first := create("first", nil, "ws:1", "bb:1") // nothing primed yet: made anew
	if st := first.Current(); runtime.IDOf(root, "first") != st.ID || first.Dir() != filepath.Join(root, "sandboxes", st.ID) || st.CgroupName != "sb-"+st.ID+runtime.CgroupSuffix(root) {
		t.Fatalf("the first sandbox is not named by its ID: %+v in %s", st, first.Dir())
	}
	dirs := waitPrimed(t, p, root, 1)
	pst := primedState(t, dirs[0])

	second := create("second", nil, "ws:1", "bb:1")
	st := second.Current()
	if st.Pid != pst.Pid || st.ID != pst.ID || st.CgroupName != pst.CgroupName || st.Name != "second" || st.Hostname != "second" || st.Status != runtime.Running {
		t.Fatalf("second did not take the primed sandbox %+v: %+v", pst, st)
	}
	// Its ID, directory and group are the primed one's: only its name
	// is new.
	if second.Dir() != dirs[0] || runtime.IDOf(root, "second") != pst.ID {
		t.Fatalf("dir %s, named %q, want the primed %s", second.Dir(), runtime.IDOf(root, "second"), dirs[0])
	}
	if got := primedState(t, second.Dir()); got.Name != "second" || got.Pid != pst.Pid || got.Limits.Pids != 128 {
		t.Fatalf("saved state %+v", got)
	}
	if max, _ := os.ReadFile(filepath.Join(cgroup.Root, "pids", cgroup.DefaultParent, st.CgroupName, "pids.max")); strings.TrimSpace(string(max)) != fmt.Sprint(128+driver.InitPids) {
		t.Fatalf("pids.max %q, want the create's 128 and the init's share", max)
	}
	out, code := sh(t, second, "1", "hostname; cat /work/hello; echo $STEP; echo kept > /work/new")
	if code != 0 || out != "second\nfrom the workspace\nsecond\n" {
		t.Fatalf("exit %d, %q", code, out)
	}
	if b, err := os.ReadFile(filepath.Join(second.Upper(), "work", "new")); err != nil || string(b) != "kept\n" {
		t.Fatalf("the upper under the new name: %q %v", b, err)
	}
	// The layers are held by the sandbox's ID, the primed one's.
	users, _ := filepath.Glob(filepath.Join(root, "lower", "*", "users", "*"))
	var names []string
	for _, u := range users {
		names = append(names, filepath.Base(u))
	}
	if strings.Count(strings.Join(names, " "), st.ID) != 2 || strings.Count(strings.Join(names, " "), first.Current().ID) != 2 {
		t.Fatalf("layer users %v", names)
	}
	// A second create of the name fails as it does without priming, and
	// leaves the sandbox that has it and its layers alone.
	waitPrimed(t, p, root, 1)
	if _, err := m.Create(ctx, runtime.Spec{Name: "second", Layers: []string{"ws:1", "bb:1"}}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("a second create of a name: %v", err)
	}
	p.Refill()
	if held, _ := filepath.Glob(filepath.Join(root, "lower", "*", "users", st.ID)); len(held) != 2 {
		t.Fatalf("second's layers after a create of its name failed: %v", held)
	}
	// A worker restarted now finds the sandbox under its name.
	if sb, err := (&runtime.Host{Root: root, Store: s}).Load("second"); err != nil || sb.Current().Status != runtime.Running {
		t.Fatalf("load: %v", err)
	} else {
		sb.Close()
	}

	// A call's sandbox (run --rm, a FnCall call) takes the primed one
	// with its limits and host name, and keeps its directory, state file
	// and layer users: it never outlives its worker.
	pdir := waitPrimed(t, p, root, 1)[0]
	pst = primedState(t, pdir)
	call, err := m.Create(ctx, runtime.Spec{Name: "call", Pool: "(run)",
		Layers: []string{"ws:1", "bb:1"}, Limits: cgroup.Limits{Pids: 64}})
	p.Refill()
	if err != nil {
		t.Fatal(err)
	}
	if st := call.Current(); st.Pid != pst.Pid || st.Name != "call" || st.Hostname != "call" || st.Status != runtime.Running || st.Pool != "(run)" || call.Dir() != pdir {
		t.Fatalf("the call's sandbox did not take the primed %s as it is: %+v in %s", pdir, st, call.Dir())
	}
	if max, _ := os.ReadFile(filepath.Join(cgroup.Root, "pids", cgroup.DefaultParent, pst.CgroupName, "pids.max")); strings.TrimSpace(string(max)) != fmt.Sprint(64+driver.InitPids) {
		t.Fatalf("pids.max %q, want the call's 64 and the init's share", max)
	}
	if out, code := sh(t, call, "1", "hostname; cat /work/hello"); code != 0 || out != "call\nfrom the workspace\n" {
		t.Fatalf("exit %d, %q", code, out)
	}
	// Its command's result is told, not journaled (a persisting
	// sandbox's is: second's); a replay finds the exec in memory.
	if _, err := os.Stat(filepath.Join(second.Dir(), "execs", "1", "result.json")); err != nil {
		t.Fatalf("second's result: %v", err)
	}
	if _, err := os.Stat(filepath.Join(pdir, "execs", "1", "result.json")); !os.IsNotExist(err) {
		t.Fatalf("the call's result was journaled: %v", err)
	}
	if e, replayed, err := call.Run(ctx, runtime.ExecSpec{ID: "1", Args: []string{"/bin/sh", "-c", "hostname; cat /work/hello"}}); err != nil || !replayed {
		t.Fatalf("replay of the call's exec: %v, replayed %v", err, replayed)
	} else if res, err := e.Result(ctx); err != nil || res.ExitCode != 0 {
		t.Fatalf("replayed result %+v, %v", res, err)
	}
	if got := primedState(t, pdir); got.Name == "call" {
		t.Fatalf("the call's state was written: %+v", got)
	}
	if names, _ := runtime.List(root); slices.Contains(names, "call") {
		t.Fatalf("the call's sandbox is listed: %v", names)
	}
	if held, _ := filepath.Glob(filepath.Join(root, "lower", "*", "users", filepath.Base(pdir))); len(held) != 2 {
		t.Fatalf("the call's layers: %v", held)
	}
	if err := call.Remove(); err != nil {
		t.Fatal(err)
	}
	if held, _ := filepath.Glob(filepath.Join(root, "lower", "*", "users", filepath.Base(pdir))); len(held) != 0 {
		t.Fatalf("the removed call's sandbox still holds layers: %v", held)
	}
	if _, err := os.Stat(pdir); !os.IsNotExist(err) {
		t.Fatalf("the call's directory: %v", err)
	}

	// A policy is more than a primed sandbox has: made anew, the
	// primed one (made again meanwhile) stays.
	waitPrimed(t, p, root, 1)
	pol := &api.Policy{APIVersion: "dsec/v1", Kind: "Policy", Files: &api.FilePolicy{Hidden: []string{"/etc/answer"}}}
	third := create("third", pol, "ws:1", "bb:1")
	if third.Current().Pid == primedState(t, waitPrimed(t, p, root, 1)[0]).Pid {
		t.Fatal("a create with a policy took the primed sandbox")
	}
	if out, _ := sh(t, third, "1", "cat /etc/answer"); strings.Contains(out, "42") {
		t.Fatalf("the policy did not hold: %q", out)
	}

	// Other layers: made anew, and the primed sandboxes follow them.
	old := waitPrimed(t, p, root, 1)[0]
	oldPid := primedState(t, old).Pid
	fourth := create("fourth", nil, "bb:1")
	if fourth.Current().Pid == oldPid {
		t.Fatal("a create on other layers took the primed sandbox")
	}
	now := waitPrimed(t, p, root, 1)
	if now[0] == old || len(primedState(t, now[0]).Digests) != 1 {
		t.Fatalf("primed %v (was %s) not made on the new layers", now, old)
	}
	for _, sb := range []*runtime.Sandbox{first, second, third, fourth} {
		if err := sb.Remove(); err != nil {
			t.Fatal(err)
		}
	}
	closed = true
	p.Close()
	m.Drivers.Close()
	if left := runtimetest.Leftovers(root); len(left) != 0 {
		t.Fatalf("left behind: %v", left)
	}
}

// TestSweepPrimed: a primed sandbox, and a call's made of one, outlive
// a worker that dies (as every sandbox does); the next one's
// SweepUnnamed removes them whole.
func TestSweepPrimed(t *testing.T) {
	root, s := layers(t)
	m := &runtime.Host{Root: root, Store: s}
	p := m.StartPrimed(1)
	m.Primed = p
	t.Cleanup(func() { runtimetest.Clean(root) })
	sb, err := m.Create(context.Background(), runtime.Spec{Name: "a", Layers: []string{"bb:1"}})
	if err != nil {
		t.Fatal(err)
	}
	p.Refill()
	if err := sb.Remove(); err != nil {
		t.Fatal(err)
	}
	// A call's sandbox keeps the primed one's directory (TestPrimed):
	// it goes with those primed.
	callPid := primedState(t, waitPrimed(t, p, root, 1)[0]).Pid
	if _, err := m.Create(context.Background(), runtime.Spec{Name: "c", Pool: "(run)",
		Layers: []string{"bb:1"}}); err != nil {
		t.Fatal(err)
	}
	p.Refill()
	var pid int
	for deadline := time.Now().Add(20 * time.Second); pid == 0; time.Sleep(5 * time.Millisecond) {
		dirs := unnamedDirs(root)
		for _, d := range dirs {
			var st runtime.State
			b, _ := os.ReadFile(filepath.Join(d, "state.json")) // none yet while it is made
			if json.Unmarshal(b, &st) == nil && p.Ready() == 1 && len(dirs) == 2 && st.Pid != callPid {
				pid = st.Pid // made again, beside the call's
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d primed sandboxes ready, dirs %v, want 1 beside the call's", p.Ready(), dirs)
		}
	}
	// The worker "dies": its primer is not closed, the sandboxes run on.
	next := &runtime.Host{Root: root, Store: s} // the next worker's
	if err := next.SweepUnnamed(); err != nil {
		t.Fatal(err)
	}
	for _, pid := range []int{callPid, pid} {
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			if _, err := os.Stat(filepath.Join("/proc", strconv.Itoa(pid))); os.IsNotExist(err) {
				break // killed, and reaped by its starter
			}
			if time.Now().After(deadline) {
				t.Fatalf("the init %d still runs", pid)
			}
		}
	}
	if err := next.Lowers().Sweep(nil); err != nil {
		t.Fatal(err)
	}
	if left := runtimetest.Leftovers(root); len(left) != 0 {
		t.Fatalf("left behind: %v", left)
	}
	p.Close() // what it had ready is gone already
}

// prepared is ds, making what it keeps ahead of need.
func prepared(ds *runtime.Drivers) *runtime.Drivers {
	ds.Prepare()
	return ds
}
