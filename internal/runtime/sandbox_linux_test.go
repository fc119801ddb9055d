package runtime_test

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/lazy"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/disk"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/agent"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/vmm"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
)

// TestMain doubles as a sandbox init and as a lazy layer's fetcher.
func TestMain(m *testing.M) {
	container.MaybeInit()
	vmm.MaybeRun()   // a microVM's shim
	agent.MaybeRun() // its guest's agent
	if os.Getenv("DSEC_TEST_FETCHER") == "1" {
		err := lazy.Serve(context.Background(), os.Args[len(os.Args)-1], 300*time.Millisecond, slog.Default())
		if err != nil && !errors.Is(err, lazy.ErrBusy) {
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// layers builds the test layers (bb:1, ws:1) into a fresh root's store.
func layers(t *testing.T) (string, *store.Store) {
	t.Helper()
	root := t.TempDir()
	t.Cleanup(func() { disk.ReleaseUppers(root) }) // last: after the sandboxes
	runtimetest.Layers(t, root)
	s, err := store.Open(filepath.Join(root, "store"))
	if err != nil {
		t.Fatal(err)
	}
	return root, s
}

func sh(t *testing.T, sb *runtime.Sandbox, id, script string) (string, int) {
	t.Helper()
	e, _, err := sb.Run(context.Background(), runtime.ExecSpec{ID: id, Args: []string{"/bin/sh", "-c", script}})
	if err != nil {
		t.Fatal(err)
	}
	res, err := e.Result(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	out, _ := os.ReadFile(e.StdoutPath())
	errb, _ := os.ReadFile(e.StderrPath())
	return string(out) + string(errb), res.ExitCode
}

func TestSandboxLifecycle(t *testing.T) {
	root, s := layers(t)
	ctx := context.Background()
	sb, err := (&runtime.Host{Root: root, Store: s}).Create(ctx, runtime.Spec{Name: "rollout-1", Layers: []string{"ws:1", "bb:1"},
		Limits: cgroup.Limits{MemoryBytes: 256 << 20, Pids: 256}})
	if err != nil {
		t.Fatal(err)
	}
	removed := false
	t.Cleanup(func() {
		if !removed {
			sb.Remove()
		}
	})
	out, code := sh(t, sb, "1", "cat /work/hello /etc/answer; hostname; echo step > /work/new; echo changed > /etc/answer")
	if code != 0 || out != "from the workspace\n42\nrollout-1\n" {
		t.Fatalf("exit %d, %q", code, out)
	}
	if b, err := os.ReadFile(filepath.Join(sb.Upper(), "work", "new")); err != nil || string(b) != "step\n" {
		t.Fatalf("the write is not in the upper: %q %v", b, err)
	}
	// The worker goes away and a new one re-adopts the sandbox.
	sb.Close()
	again, err := (&runtime.Host{Root: root, Store: s}).Load("rollout-1")
	if err != nil {
		t.Fatal(err)
	}
	out, _ = sh(t, again, "2", "cat /work/new")
	if out != "step\n" {
		t.Fatalf("state lost across re-adoption: %q", out)
	}
	if _, err := (&runtime.Host{Root: root, Store: s}).Create(ctx, runtime.Spec{Name: "rollout-1", Layers: []string{"bb:1"}}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("duplicate name: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(sb.Upper(), "etc", "answer")); string(b) != "changed\n" {
		t.Fatalf("overwriting a base file: upper has %q", b)
	}
	removed = true
	if err := again.Remove(); err != nil {
		t.Fatal(err)
	}
	if l := runtimetest.Leftovers(root); len(l) > 0 {
		t.Fatalf("left behind: %v", l)
	}
	if _, err := (&runtime.Host{Root: root, Store: s}).Load("rollout-1"); !errdefs.IsNotFound(err) {
		t.Fatalf("load after remove: %v", err)
	}
}

func TestFailedCreateLeavesNothing(t *testing.T) {
	root, s := layers(t)
	_, err := (&runtime.Host{Root: root, Store: s}).Create(context.Background(), runtime.Spec{Name: "bad", Layers: []string{"ws:1",
		"missing:1"}})
	if !errdefs.IsNotFound(err) {
		t.Fatalf("missing layer: %v", err)
	}
	if l := runtimetest.Leftovers(root); len(l) > 0 {
		t.Fatalf("a failed create left: %v", l)
	}
	if _, err := (&runtime.Host{Root: root, Store: s}).Create(context.Background(), runtime.Spec{Name: "../x",
		Layers: []string{"bb:1"}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("bad name: %v", err)
	}
}

// TestLazyLayers: a host without the layers creates a sandbox from a
// remote; the layers are mounted lazily and go away with the sandbox.
func TestLazyLayers(t *testing.T) {
	_, s := layers(t)
	ctx := context.Background()
	shared, err := remote.Open("dir://"+filepath.Join(t.TempDir(), "shared"), remote.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tag := range []string{"bb:1", "ws:1"} {
		ref, _ := layer.ParseRef(tag)
		if _, err := remote.Copy(ctx, remote.Local(s), shared, ref, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	host, sb := createOnSecondHost(t, shared, runtime.Spec{Name: "lazy-1", Layers: []string{"ws:1", "bb:1"}})
	if out, code := sh(t, sb, "1", "cat /work/hello"); code != 0 || out != "from the workspace\n" {
		t.Fatalf("exit %d, %q", code, out)
	}
	removeOnSecondHost(t, host, sb)
}

// createOnSecondHost creates a sandbox on a new host whose store is
// empty, so its layers come lazily from shared.
func createOnSecondHost(t *testing.T, shared remote.Target, o runtime.Spec) (string, *runtime.Sandbox) {
	t.Helper()
	host := t.TempDir()
	hs, err := store.Open(filepath.Join(host, "store"))
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("DSEC_TEST_FETCHER", "1")
	h := &runtime.Host{Root: host, Store: hs, Remote: shared, Fetcher: lazy.Start{Path: os.Args[0]}}
	sb, err := h.Create(context.Background(), o)
	os.Unsetenv("DSEC_TEST_FETCHER")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Remove() }) // a second Remove finds nothing to do
	return host, sb
}

// removeOnSecondHost removes sb and checks its host is left clean once
// the fetchers have gone.
func removeOnSecondHost(t *testing.T, host string, sb *runtime.Sandbox) {
	t.Helper()
	if err := sb.Remove(); err != nil {
		t.Fatal(err)
	}
	// The fetchers see no user and exit, unmounting their layers.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		l := runtimetest.Leftovers(host)
		if len(l) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("left behind 10 s after the removal: %v", l)
		}
	}
}

// made makes spec's sandbox on a root of its own, which the test's
// end cleans and holds to leave nothing behind.
func made(t *testing.T, spec runtime.Spec) (string, *store.Store, *runtime.Sandbox) {
	t.Helper()
	root, s := layers(t)
	sb, err := (&runtime.Host{Root: root, Store: s}).Create(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		runtimetest.Clean(root)
		if l := runtimetest.Leftovers(root); len(l) > 0 {
			t.Errorf("left behind: %v", l)
		}
	})
	return root, s, sb
}

// TestUnknownBackend: a sandbox of a backend this worker does not run (a
// newer dsec's) is loaded, stopped, and never started or taken down by
// this one; running, it is not loaded. Nothing of it is touched.
func TestUnknownBackend(t *testing.T) {
	ctx := context.Background()
	root, s, sb := made(t, runtime.Spec{Name: "newer", Layers: []string{"bb:1"}})
	if err := sb.Stop(); err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(sb.Dir(), "state.json")
	orig, err := os.ReadFile(state)
	if err != nil {
		t.Fatal(err)
	}
	setBackend := func(b []byte) {
		if err := os.WriteFile(state, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	newer := []byte(strings.Replace(string(orig), `"name": "newer",`, `"name": "newer", "backend": "warp",`, 1))
	setBackend(newer)
	again, err := (&runtime.Host{Root: root, Store: s}).Load("newer")
	if err != nil || again.Current().Status != runtime.Stopped {
		t.Fatalf("load a stopped sandbox of backend warp: %v", err)
	}
	if err := again.Start(ctx); !errdefs.IsNotImplemented(err) || !strings.Contains(err.Error(), `unknown backend "warp"`) {
		t.Errorf("start it: %v, want not implemented, naming the backend", err)
	}
	if err := again.Remove(); !errdefs.IsNotImplemented(err) {
		t.Errorf("remove it: %v, want not implemented", err)
	}
	if _, err := os.Stat(sb.Dir()); err != nil {
		t.Errorf("its directory went: %v", err)
	}
	setBackend([]byte(strings.Replace(string(newer), `"status": "stopped"`, `"status": "running"`, 1)))
	if _, err := (&runtime.Host{Root: root, Store: s}).Load("newer"); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), `unknown backend "warp"`) {
		t.Errorf("load a running sandbox of backend warp: %v, want the backend named", err)
	}
	setBackend(orig) // Clean takes it down
}

// TestLoadEmptiedState: a state a crash emptied (one written without
// waiting for the disk: a call's sandbox's here) is taken as none: the
// sandbox is removed, and it is not found, rather than failing every
// load with a state that does not parse.
func TestLoadEmptiedState(t *testing.T) {
	root, s, sb := made(t, runtime.Spec{Name: "emptied", Layers: []string{"bb:1"}, Pool: "(call)"})
	if err := sb.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(sb.Dir(), "state.json"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := (&runtime.Host{Root: root, Store: s}).Load("emptied"); !errdefs.IsNotFound(err) {
		t.Fatalf("load a sandbox whose state a crash emptied: %v, want not found", err)
	}
	if _, err := os.Stat(sb.Dir()); !os.IsNotExist(err) {
		t.Errorf("its directory stayed: %v", err)
	}
}
