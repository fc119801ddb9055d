package runtime_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
)

// TestIdentity: a sandbox's ID names its directory, cgroup and layer
// user, and its name is a link to it; a sandbox an older dsec made
// (sandboxes/NAME, no ID in its state) is listed, loaded, started and
// removed as before, its name its ID; a name whose sandbox is gone and
// a sandbox no name points at are swept.
func TestIdentity(t *testing.T) {
	root, s := layers(t)
	ctx := context.Background()
	m := &runtime.Host{Root: root, Store: s}
	t.Cleanup(func() { runtimetest.Clean(root) })
	sb, err := m.Create(ctx, runtime.Spec{Name: "old", Layers: []string{"bb:1"}})
	if err != nil {
		t.Fatal(err)
	}
	st := sb.Current()
	users, _ := filepath.Glob(filepath.Join(root, "lower", "*", "users", st.ID))
	if len(st.ID) != 13 || st.ID[0] != '_' || sb.Dir() != filepath.Join(root, "sandboxes", st.ID) || runtime.IDOf(root, "old") != st.ID ||
		st.CgroupName != "sb-"+st.ID+runtime.CgroupSuffix(root) || len(users) != 1 || st.Hostname != "old" {
		t.Fatalf("sandbox old: %+v in %s, layer users %v", st, sb.Dir(), users)
	}
	if _, err := cgroup.NewTree("").Open(st.CgroupName); err != nil {
		t.Fatal(err)
	}
	if out, _ := sh(t, sb, "1", "echo kept > /keep; hostname"); out != "old\n" {
		t.Fatalf("%q", out)
	}

	// Made an older dsec's: stopped, moved to sandboxes/NAME, its state
	// without an ID and with the group name that dsec gave, no link.
	if err := sb.Stop(); err != nil {
		t.Fatal(err)
	}
	legacy := filepath.Join(root, "sandboxes", "old")
	if err := os.Rename(sb.Dir(), legacy); err != nil {
		t.Fatal(err)
	}
	os.Remove(filepath.Join(root, "names", "old"))
	var raw map[string]any
	b, _ := os.ReadFile(filepath.Join(legacy, "state.json"))
	json.Unmarshal(b, &raw)
	delete(raw, "id")
	raw["cgroup"] = "sb-old" + runtime.CgroupSuffix(root)
	b, _ = json.Marshal(raw)
	if err := os.WriteFile(filepath.Join(legacy, "state.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	if names, _ := runtime.List(root); !slices.Equal(names, []string{"old"}) || runtime.IDOf(root, "old") != "old" {
		t.Fatalf("list %v, id %q", names, runtime.IDOf(root, "old"))
	}
	if _, err := m.Create(ctx, runtime.Spec{Name: "old", Layers: []string{"bb:1"}}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("a create of an older sandbox's name: %v", err)
	}
	old, err := (&runtime.Host{Root: root, Store: s}).Load("old")
	if err != nil {
		t.Fatal(err)
	}
	if err := old.Start(ctx); err != nil {
		t.Fatal(err)
	}
	st = old.Current()
	users, _ = filepath.Glob(filepath.Join(root, "lower", "*", "users", "old"))
	if st.ID != "old" || old.Dir() != legacy || st.CgroupName != "sb-old"+runtime.CgroupSuffix(root) || len(users) != 1 {
		t.Fatalf("the older sandbox: %+v in %s, layer users %v", st, old.Dir(), users)
	}
	if out, _ := sh(t, old, "2", "cat /keep"); out != "kept\n" {
		t.Fatalf("the older sandbox lost its files: %q", out)
	}
	if err := old.Remove(); err != nil {
		t.Fatal(err)
	}

	// A name whose sandbox went (a worker died removing it) and a
	// sandbox no name points at (one died making it).
	os.MkdirAll(filepath.Join(root, "names"), 0o700)
	if err := os.Symlink("../sandboxes/_0123456789ab", filepath.Join(root, "names", "ghost")); err != nil {
		t.Fatal(err)
	}
	half, err := m.Create(ctx, runtime.Spec{Name: "half", Layers: []string{"bb:1"}})
	if err != nil {
		t.Fatal(err)
	}
	half.Close()
	os.Remove(filepath.Join(root, "names", "half"))
	if _, err := (&runtime.Host{Root: root, Store: s}).Load("ghost"); !errdefs.IsNotFound(err) {
		t.Fatalf("load of a name whose sandbox is gone: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(root, "names", "ghost")); !os.IsNotExist(err) {
		t.Fatalf("the dangling name stays: %v", err)
	}
	if ids := runtime.Unnamed(root); len(ids) != 1 || ids[0] != half.Current().ID {
		t.Fatalf("unnamed %v, want %s", ids, half.Current().ID)
	}
	if err := (&runtime.Host{Root: root, Store: s}).SweepUnnamed(); err != nil {
		t.Fatal(err)
	}
	if l := runtimetest.Leftovers(root); len(l) > 0 {
		t.Fatalf("left behind: %v", l)
	}
}
