package sdk_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// TestRunRm: dsec run --rm is a call on the container backend. Its
// sandbox is made for it (never a pool's, even one of the same
// template), named and listed while the command runs; the worker removes
// it when the command ends (its name at once free again: a create of it
// waits for the removal) or when the client goes away, and a worker
// killed during the run leaves it to the next worker to remove.
func TestRunRm(t *testing.T) {
	tmpl := api.SandboxSpec{Layers: []string{"bb:1"}}
	w, c := setupWith(t, runtimetest.Config{Pools: []worker.PoolConfig{{Name: "p", Size: 1, Spec: tmpl}}})
	ctx := context.Background()
	waitFor(t, "the pool to fill", func() bool { return warm(t, c, "p") == 1 })
	spec := func(name string) *api.SandboxSpec {
		s := tmpl
		s.Name = name
		return &s
	}
	dir := func(name string) string { // while it runs
		t.Helper()
		info, err := c.Sandbox(name).Inspect(ctx)
		if err != nil || info.ID == "" {
			t.Fatalf("inspect %s: %+v %v", name, info, err)
		}
		return filepath.Join(w.Root, "sandboxes", info.ID)
	}
	// A run makes its sandbox from its spec, never from a pool.
	for what, o := range map[string]sdk.CallOptions{"a pool": {Pool: "p", Spec: spec("r0"), Run: true}, "no spec": {Run: true}} {
		o.Args = []string{"true"}
		if _, err := c.Call(ctx, o); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "give a spec and no pool") {
			t.Errorf("a run with %s: %v", what, err)
		}
	}

	out, res := call(t, c, sdk.CallOptions{Spec: spec("r1"), Run: true}, "echo out; exit 4")
	if out != "out\n" || res.ExitCode != 4 || res.Sandbox != "r1" || res.Warm || res.Pool != "" {
		t.Fatalf("run --rm: %q %+v", out, res)
	}
	// Gone from the API with the answer's end; the name is free at once.
	if l, err := c.List(ctx); err != nil || len(l) != 0 {
		t.Fatalf("ps right after run --rm: %+v %v", l, err)
	}
	if _, err := c.Sandbox("r1").Inspect(ctx); !errdefs.IsNotFound(err) {
		t.Fatalf("inspect right after run --rm: %v", err)
	}
	again := create(t, c, api.SandboxSpec{Name: "r1", Layers: tmpl.Layers})
	if got, _ := run(t, again, "x", "ls /tmp"); got != "" {
		t.Fatalf("a sandbox of a run --rm's name sees its files: %q", got)
	}
	if err := again.Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
	if n := warm(t, c, "p"); n != 1 {
		t.Fatalf("run --rm took the pool's sandbox: %d warm", n)
	}

	// A client that goes away ends the run and its sandbox.
	running := func(name string) func() bool {
		return func() bool {
			info, err := c.Sandbox(name).Inspect(ctx)
			return err == nil && info.Rm && info.Status == api.StatusRunning && info.Execs == 1
		}
	}
	cctx, cancel := context.WithCancel(ctx)
	errc := make(chan error, 1)
	go func() {
		_, err := c.Call(cctx, sdk.CallOptions{Spec: spec("r2"), Run: true, ExecOptions: sdk.ExecOptions{Args: []string{"sleep", "100"}}})
		errc <- err
	}()
	waitFor(t, "the run to list its sandbox", running("r2"))
	r2 := dir("r2")
	if err := createErr(c, api.SandboxSpec{Name: "r2", Layers: tmpl.Layers}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("a create of a running run --rm's name: %v", err)
	}
	cancel()
	if err := <-errc; err == nil {
		t.Fatal("a cancelled run returned no error")
	}
	waitFor(t, "the abandoned run's sandbox to go", func() bool {
		_, err := os.Stat(r2)
		return errors.Is(err, os.ErrNotExist)
	})

	// A worker killed during the run: the next one removes the sandbox.
	go func() {
		_, err := c.Call(ctx, sdk.CallOptions{Spec: spec("r3"), Run: true, ExecOptions: sdk.ExecOptions{Args: []string{"sleep", "100"}}})
		errc <- err
	}()
	waitFor(t, "the run to list its sandbox", running("r3"))
	r3 := dir("r3")
	w.Kill()
	if err := <-errc; !sdk.IsInfra(err) {
		t.Fatalf("the run of a killed worker: %v, want an infrastructure error", err)
	}
	runtimetest.StartWorker(t, w.Root)
	if _, err := os.Stat(r3); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a run --rm's sandbox outlived its worker: %v", err)
	}
	if l, err := c.List(ctx); err != nil || len(l) != 0 {
		t.Fatalf("ps after the restart: %+v %v", l, err)
	}
}

// lowerMounts lists the layer mounts under root: mount id by mount point.
func lowerMounts(t *testing.T, root string) map[string]string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && strings.HasPrefix(f[4], filepath.Join(root, "lower")+"/") {
			out[f[4]] = f[0]
		}
	}
	return out
}

// TestKeepLayers: a layer stays mounted a while after its last sandbox
// (worker.Config.KeepLayers); the next sandbox uses that same mount; it
// goes when the time is up, and when the worker exits.
func TestKeepLayers(t *testing.T) {
	// No primed sandbox: it would hold the layer as the next one's.
	w, c := setupWith(t, runtimetest.Config{KeepLayers: 2 * time.Second, Admission: worker.Admission{Primed: -1}})
	ctx := context.Background()
	cycle := func() {
		sb := create(t, c, api.SandboxSpec{Layers: []string{"bb:1"}})
		if out, res := run(t, sb, "x", "echo hi"); out != "hi\n" || res.ExitCode != 0 {
			t.Fatalf("%q %+v", out, res)
		}
		if err := sb.Remove(ctx, true); err != nil {
			t.Fatal(err)
		}
	}
	cycle()
	kept := lowerMounts(t, w.Root)
	if len(kept) != 1 {
		t.Fatalf("after the last sandbox went: layer mounts %v, want bb:1's kept", kept)
	}
	users, _ := filepath.Glob(filepath.Join(w.Root, "lower", "*", "users", "*"))
	if len(users) != 0 {
		t.Fatalf("a kept layer has users %v", users)
	}
	cycle()
	if again := lowerMounts(t, w.Root); !maps.Equal(again, kept) {
		t.Fatalf("the next sandbox mounted the layer again: %v, was %v", again, kept)
	}
	waitFor(t, "the kept layer unmounted after 2 s, its directory removed", func() bool {
		dirs, _ := filepath.Glob(filepath.Join(w.Root, "lower", "*"))
		return len(lowerMounts(t, w.Root)) == 0 && len(dirs) == 0
	})
	cycle()
	if err := c.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the worker gone", func() bool { return syscall.Kill(w.Pid(), 0) != nil })
	if left := lowerMounts(t, w.Root); len(left) != 0 { // its 2 s are not up yet
		t.Fatalf("the worker exited and left its kept layer mounted: %v", left)
	}
}

// TestPrimedSandboxes: through the worker, a create on the layers of
// the last one takes the sandbox made ahead for it (its init: the same
// pid) under its own name; a pool's fills neither take it nor move it
// to their layers; a worker killed leaves it to the next, which removes
// it while the user's sandboxes run on.
func TestPrimedSandboxes(t *testing.T) {
	w, c := setup(t)
	ctx := context.Background()
	primed := func() runtime.State {
		t.Helper()
		var st runtime.State
		waitFor(t, "one primed sandbox", func() bool {
			ids := runtime.Unnamed(w.Root)
			if len(ids) != 1 {
				return false
			}
			b, err := os.ReadFile(filepath.Join(w.Root, "sandboxes", ids[0], "state.json"))
			if err != nil || json.Unmarshal(b, &st) != nil || st.Status != runtime.Running {
				return false
			}
			v, err := c.Version(ctx) // made, and ready to be taken
			return err == nil && v.Warm != nil && v.Warm.Primed == 1
		})
		return st
	}
	a := create(t, c, api.SandboxSpec{Name: "a"})
	p := primed()
	b := create(t, c, api.SandboxSpec{Name: "b"})
	if info, err := b.Inspect(ctx); err != nil || info.Pid != p.Pid {
		t.Fatalf("b (%+v, %v) did not take the primed sandbox (init %d)", info, err, p.Pid)
	}
	if out, res := run(t, b, "x", "hostname; cat /etc/answer /work/hello"); out != "b\n42\nfrom the workspace\n" || res.ExitCode != 0 {
		t.Fatalf("%q %+v", out, res)
	}
	p = primed() // made again for the next
	if _, err := c.ResizePool(ctx, "p", api.PoolSpec{Size: 1, Spec: &api.SandboxSpec{Layers: []string{"bb:1"}}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the pool filled", func() bool {
		pools, _ := c.Pools(ctx)
		return len(pools) == 1 && pools[0].Warm == 1
	})
	if again := primed(); again.Pid != p.Pid || len(again.Digests) != 2 {
		t.Fatalf("the pool's fill moved the primed sandbox: %+v, was %+v", again, p)
	}
	if err := c.RemovePool(ctx, "p"); err != nil {
		t.Fatal(err)
	}
	w.Kill()
	w = runtimetest.StartWorker(t, w.Root)
	waitFor(t, "the dead worker's primed sandbox removed, its init gone", func() bool {
		_, err := os.Stat(filepath.Join("/proc", strconv.Itoa(p.Pid)))
		return len(runtime.Unnamed(w.Root)) == 0 && err != nil
	})
	c, _ = sdk.New(sdk.Options{Root: w.Root})
	if out, _ := run(t, c.Sandbox("b"), "y", "hostname"); out != "b\n" {
		t.Fatalf("b after the restart: %q", out)
	}
	for _, sb := range []*sdk.Sandbox{a, c.Sandbox("b")} {
		if err := c.Sandbox(sb.Name).Remove(ctx, true); err != nil {
			t.Fatal(err)
		}
	}
	if left := runtimetest.Leftovers(w.Root); len(left) > 0 {
		t.Fatalf("left %v", left)
	}
}

// TestFirstRequest: a client's first request goes over the connection
// New dialed, outside the transport's pool. It streams stdin both ways,
// gets the worker's early answer to a request whose body it is still
// writing, and ends when its context does; the next request then goes
// through the pool.
func TestFirstRequest(t *testing.T) {
	w, c := setup(t)
	create(t, c, api.SandboxSpec{Name: "fr"})
	fresh := func() *sdk.Client {
		c, err := sdk.New(sdk.Options{Root: w.Root})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	ctx := context.Background()
	big := bytes.Repeat([]byte("x"), 1<<20)

	var out bytes.Buffer
	res, err := fresh().Sandbox("fr").Exec(ctx, sdk.ExecOptions{Args: []string{"wc", "-c"}, Stdin: bytes.NewReader(big), Stdout: &out})
	if err != nil || res.ExitCode != 0 || strings.TrimSpace(out.String()) != "1048576" {
		t.Fatalf("1 MiB of stdin: %q %+v %v", out.String(), res, err)
	}

	// The worker answers before it reads the body; a stdin that never
	// ends must not hold the answer back.
	pr, pw := io.Pipe()
	defer pw.Close()
	go pw.Write(big)
	if _, err := fresh().Sandbox("nope").Exec(ctx, sdk.ExecOptions{Args: []string{"cat"}, Stdin: pr}); !errdefs.IsNotFound(err) {
		t.Fatalf("exec with an endless stdin in an unknown sandbox: %v", err)
	}

	c2 := fresh()
	tctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := c2.Sandbox("fr").Exec(tctx, sdk.ExecOptions{Args: []string{"sleep", "5"}}); !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 3*time.Second {
		t.Fatalf("first request past its deadline: %v after %v", err, time.Since(start))
	}
	if out, res := run(t, c2.Sandbox("fr"), "second", "echo again"); out != "again\n" || res.ExitCode != 0 {
		t.Fatalf("the request after: %q %+v", out, res)
	}
}
