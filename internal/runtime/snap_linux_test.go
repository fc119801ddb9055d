package runtime_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/disk"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/snap"
)

// snapFixture is a root with the test layers and the sandboxes a test
// made, all removed (and checked for leftovers) at its end.
type snapFixture struct {
	t     *testing.T
	root  string
	s     *store.Store
	m     *runtime.Host
	sbs   []*runtime.Sandbox
	n     int    // exec ids
	shell string // default /bin/sh
}

func newSnapFixture(t *testing.T) *snapFixture {
	root, s := layers(t)
	// As a worker makes them: uppers on the root's uppers file system,
	// with the default bound.
	f := &snapFixture{t: t, root: root, s: s, m: &runtime.Host{Root: root, Store: s, DiskBound: 10 << 30}}
	t.Cleanup(func() {
		for _, sb := range f.sbs {
			sb.Remove()
		}
		if err := disk.ReleaseUppers(root); err != nil {
			t.Error(err)
		}
		if left := runtimetest.Leftovers(root); len(left) > 0 {
			t.Errorf("leftovers: %v", left)
		}
	})
	return f
}

func (f *snapFixture) create(o runtime.Spec) *runtime.Sandbox {
	f.t.Helper()
	sb, err := f.m.Create(context.Background(), o)
	if err != nil {
		f.t.Fatal(err)
	}
	f.sbs = append(f.sbs, sb)
	return sb
}

func (f *snapFixture) pack(sb *runtime.Sandbox, tag string, lim snap.Limits) (*runtime.Packed, error) {
	ref, err := layer.ParseRef(tag)
	if err != nil {
		f.t.Fatal(err)
	}
	return sb.PackDiff(context.Background(), runtime.PackOptions{Store: f.s, Ref: ref, Limits: lim})
}

func (f *snapFixture) mustPack(sb *runtime.Sandbox, tag string) *runtime.Packed {
	f.t.Helper()
	p, err := f.pack(sb, tag, snap.Limits{})
	if err != nil {
		f.t.Fatal(err)
	}
	return p
}

func (f *snapFixture) run(sb *runtime.Sandbox, script string) {
	f.t.Helper()
	shell := f.shell
	if shell == "" {
		shell = "/bin/sh"
	}
	f.runShell(sb, shell, script)
}

func (f *snapFixture) runShell(sb *runtime.Sandbox, shell, script string) {
	f.t.Helper()
	f.n++
	e, _, err := sb.Run(context.Background(), runtime.ExecSpec{ID: fmt.Sprint(f.n), Args: []string{shell, "-c", "set -e; " + script}})
	if err != nil {
		f.t.Fatal(err)
	}
	res, err := e.Result(context.Background())
	if err != nil {
		f.t.Fatal(err)
	}
	if res.ExitCode != 0 {
		out, _ := os.ReadFile(e.StdoutPath())
		errb, _ := os.ReadFile(e.StderrPath())
		f.t.Fatalf("%s: exit %d: %s%s", script, res.ExitCode, out, errb)
	}
}

// view is a sandbox's merged root as the host sees it, minus what
// differs by design: the root directory's own times (each sandbox has
// its own upper root).
func view(t *testing.T, sb *runtime.Sandbox) layertest.Tree {
	t.Helper()
	tr := layertest.ScanDir(t, sb.RootFS())
	r := tr[""]
	r.Mtime, r.MtimeNsec = 0, 0
	tr[""] = r
	return tr
}

func sameView(t *testing.T, what string, want, got layertest.Tree) {
	t.Helper()
	var diffs []string
	for p, w := range want {
		g, ok := got[p]
		switch {
		case !ok:
			diffs = append(diffs, fmt.Sprintf("/%s missing", p))
		case fmt.Sprint(w) != fmt.Sprint(g):
			diffs = append(diffs, fmt.Sprintf("/%s: want %+v, got %+v", p, w, g))
		}
	}
	for p := range got {
		if _, ok := want[p]; !ok {
			diffs = append(diffs, fmt.Sprintf("/%s extra", p))
		}
	}
	if len(diffs) > 0 {
		if len(diffs) > 20 {
			diffs = append(diffs[:20], "...")
		}
		t.Fatalf("%s differs:\n%s", what, strings.Join(diffs, "\n"))
	}
}

// mutate makes every kind of change a layer must carry, from inside the
// sandbox and (for xattrs, which busybox cannot set) through its root.
const mutate = `
echo new > /work/new; chmod 0640 /work/new; chown 1000:100 /work/new
echo appended >> /etc/answer
rm /work/hello
mkdir -p /opt/d/e; echo deep > /opt/d/e/f
rm -r /bin && mkdir /bin && ln -s /sbin-gone/sh /bin/dangling
ln -s /etc/shadow /work/host-link; ln -s ../../../../../../root /work/up
echo h > /work/h1; ln /work/h1 /work/h2
mkfifo /work/fifo
chmod 1777 /tmp; touch /tmp/.keep
`

func setXattr(t *testing.T, p, name, value string) {
	t.Helper()
	if err := unix.Lsetxattr(p, name, []byte(value), 0); err != nil {
		t.Fatal(err)
	}
}

func TestPackDiffBranchIdentity(t *testing.T) {
	f := newSnapFixture(t)
	orig := f.create(runtime.Spec{Name: "orig", Layers: []string{"ws:1", "bb:1"}})
	// /bin goes away in mutate: keep a shell where the tests look for it.
	f.run(orig, "mkdir -p /sbin2 && cp /bin/busybox /sbin2/ && ln -s busybox /sbin2/sh")
	f.run(orig, mutate)
	f.shell = "/sbin2/sh" // in every sandbox from here on
	setXattr(t, filepath.Join(orig.RootFS(), "work/new"), "user.origin", "orig")
	setXattr(t, filepath.Join(orig.RootFS(), "opt/d"), "user.dir", "x")
	want := view(t, orig)

	p1 := f.mustPack(orig, "rollout/a:1")
	lin := p1.Layer.Snapshot
	if lin == nil || lin.Incremental || lin.Parent().Ref != "ws:1" || len(lin.Lowers) != 2 || lin.Sandbox != "orig" {
		t.Fatalf("lineage %+v", lin)
	}
	if p1.Packed.Whiteouts < 1 || p1.Packed.Unchanged != 0 {
		t.Fatalf("pack %v", p1.Packed)
	}
	sameView(t, "the sandbox after its pack", want, view(t, orig))

	b1 := f.create(runtime.Spec{Name: "b1", From: "rollout/a:1"})
	b2 := f.create(runtime.Spec{Name: "b2", From: "rollout/a:1"})
	if st := b1.Current(); st.From != "rollout/a:1" || len(st.Layers) != 3 || st.Layers[0] != "rollout/a:1" {
		t.Fatalf("branch state %+v", st)
	}
	sameView(t, "branch b1", want, view(t, b1))
	sameView(t, "branch b2", want, view(t, b2))

	// Branches share each read-only layer's mount: 3 layers, 3 mounts.
	mnts, _ := filepath.Glob(filepath.Join(f.root, "lower", "*", "mnt"))
	if len(mnts) != 3 {
		t.Fatalf("%d layer mounts for 3 layers: %v", len(mnts), mnts)
	}

	// Branches diverge independently.
	f.run(b1, "echo one > /work/only-b1")
	f.run(b2, "rm /work/new")
	if _, err := os.Lstat(filepath.Join(b2.RootFS(), "work/only-b1")); err == nil {
		t.Fatal("b1's file shows in b2")
	}
	if _, err := os.Lstat(filepath.Join(b1.RootFS(), "work/new")); err != nil {
		t.Fatal("b2's delete shows in b1")
	}
	sameView(t, "the original after its branches diverged", want, view(t, orig))

	// Second generation: an increment over the first snapshot.
	f.run(orig, "rm -r /opt/d/e; echo more >> /work/h1; echo 2 > /work/gen2; rm /work/fifo; chmod 0600 /etc/answer")
	setXattr(t, filepath.Join(orig.RootFS(), "work/new"), "user.gen", "2")
	want2 := view(t, orig)
	p2 := f.mustPack(orig, "rollout/a:2")
	if l := p2.Layer.Snapshot; !l.Incremental || l.Parent().Ref != "rollout/a:1" || len(l.Lowers) != 3 {
		t.Fatalf("second lineage %+v", l)
	}
	if p2.Packed.Unchanged == 0 || p2.Packed.Whiteouts < 2 {
		t.Fatalf("second pack %v: want unchanged files left out and whiteouts for the removed ones", p2.Packed)
	}
	if p2.Layer.Size >= p1.Layer.Size {
		t.Fatalf("increment of %d bytes is not smaller than the first snapshot's %d", p2.Layer.Size, p1.Layer.Size)
	}
	c1 := f.create(runtime.Spec{Name: "c1", From: "rollout/a:2"})
	sameView(t, "a branch of the second generation", want2, view(t, c1))

	// Third generation, from a branch: its diff stands on a:1.
	f.run(b1, "rm -r /opt/d; mkdir /opt/d; echo opaque > /opt/d/x")
	want3 := view(t, b1)
	p3 := f.mustPack(b1, "rollout/b1:3")
	if l := p3.Layer.Snapshot; l.Incremental || l.Parent().Ref != "rollout/a:1" {
		t.Fatalf("branch lineage %+v", l)
	}
	d1 := f.create(runtime.Spec{Name: "d1", From: "rollout/b1:3"})
	sameView(t, "a branch of a branch", want3, view(t, d1))
	// And a third generation on the original: an upper-only directory
	// that went away must be hidden from the increment's parents.
	f.run(orig, "rm -r /opt/d; rm /work/h2")
	want4 := view(t, orig)
	f.mustPack(orig, "rollout/a:3")
	e1 := f.create(runtime.Spec{Name: "e1", From: "rollout/a:3"})
	sameView(t, "the third generation", want4, view(t, e1))

	// Squash folds a:3, a:2 and a:1 into one diff over ws:1 and bb:1.
	to, _ := layer.ParseRef("rollout/flat:3")
	sq, n, err := snap.Squash(context.Background(), f.s, "rollout/a:3", to, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if n.Folded != 3 || len(sq.Snapshot.Lowers) != 2 || sq.Snapshot.Parent().Ref != "ws:1" {
		t.Fatalf("squashed %+v: %+v", n, sq.Snapshot)
	}
	if n.Entries == 0 || n.Bytes == 0 || uint64(n.Entries) != sq.Files-1 {
		t.Errorf("squash tally %+v: want the paths (%d, the root left out) and bytes of the new snapshot", n, sq.Files-1)
	}
	g1 := f.create(runtime.Spec{Name: "g1", From: "rollout/flat:3"})
	sameView(t, "a branch of the squashed chain", want4, view(t, g1))
	sq2, _, err := snap.Squash(context.Background(), f.s, "rollout/b1:3", layer.Ref{Name: "rollout/flatb", Version: "3"}, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	h1 := f.create(runtime.Spec{Name: "h1", From: sq2.Ref})
	sameView(t, "a branch of a squashed branch", want3, view(t, h1))

	// Lineage: who stands on what; rm refuses while anything does.
	users, err := runtime.SnapUsers(f.root)
	if err != nil {
		t.Fatal(err)
	}
	nodes, err := snap.Tree(context.Background(), f.s, users)
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]*snap.Node{}
	for _, n := range nodes {
		byName[n.Name] = n
	}
	a1 := byName["rollout/a:1"]
	if a1 == nil || fmt.Sprint(a1.Children) != "[rollout/a:2 rollout/b1:3]" || fmt.Sprint(a1.Branches) != "[b1 b2]" ||
		fmt.Sprint(a1.Sandboxes) != "[b1 b2 c1 d1 e1]" { // not g1 or h1: they stand on squashed copies
		t.Fatalf("a:1 in the tree: %+v", a1)
	}
	if _, err := snap.Remove(context.Background(), f.s, "rollout/a:1", users, false); !errdefs.IsFailedPrecondition(err) ||
		!strings.Contains(err.Error(), "snapshot rollout/a:2") {
		t.Fatalf("rm of a snapshot others stand on: %v", err)
	}
	if _, err := snap.Remove(context.Background(), f.s, "rollout/flat:3", users, false); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("rm of a snapshot a sandbox stands on: %v", err)
	}
	if _, err := snap.Remove(context.Background(), f.s, "bb:1", users, false); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("snap rm of a layer: %v", err)
	}
	// A create under way on a snapshot nothing else stands on: its
	// lease counts as a user, and every create releases its own.
	if ents, _ := os.ReadDir(filepath.Join(f.s.Dir(), "leases")); len(ents) != 0 {
		t.Errorf("creates left leases: %v", ents)
	}
	lonely, err := layer.Resolve(context.Background(), f.s, "rollout/flatb:3")
	if err != nil {
		t.Fatal(err)
	}
	lease, err := f.s.Lease("create-test")
	if err != nil {
		t.Fatal(err)
	}
	if err := lease.Add(lonely.Digest); err != nil {
		t.Fatal(err)
	}
	if u, err := runtime.SnapUsers(f.root); err != nil {
		t.Fatal(err)
	} else if _, err := snap.Remove(context.Background(), f.s, "rollout/flatb:3", u, false); !errdefs.IsFailedPrecondition(err) ||
		!strings.Contains(err.Error(), "being made (lease create-test)") {
		t.Errorf("rm of a snapshot a create under way resolved: %v", err)
	}
	lease.Release()
	if _, err := snap.Remove(context.Background(), f.s, "rollout/flat:3", users, true); err != nil {
		t.Fatal(err)
	}
}

func TestPackDiffErrors(t *testing.T) {
	f := newSnapFixture(t)
	sb := f.create(runtime.Spec{Name: "x", Layers: []string{"bb:1"}})
	f.run(sb, "echo a > /a")
	f.mustPack(sb, "s:1")
	if _, err := f.pack(sb, "s:1", snap.Limits{}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("existing tag: %v", err)
	}
	f.run(sb, "dd if=/dev/zero of=/big bs=1k count=64 2>/dev/null")
	_, err := f.pack(sb, "s:2", snap.Limits{MaxBytes: 32 << 10})
	if !errdefs.IsOutOfRange(err) || !strings.Contains(err.Error(), "--max-bytes") {
		t.Fatalf("over the byte limit: %v", err)
	}
	if _, err := layer.Resolve(context.Background(), f.s, "s:2"); !errdefs.IsNotFound(err) {
		t.Fatalf("a failed pack left a tag: %v", err)
	}
	if cg := sb.Cgroup(); cg.Frozen() {
		t.Fatal("a failed pack left the sandbox frozen")
	}
	if _, err := f.pack(sb, "s:3", snap.Limits{MaxEntries: 1}); !errdefs.IsOutOfRange(err) {
		t.Fatalf("over the entry limit: %v", err)
	}
	if err := sb.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := f.pack(sb, "s:4", snap.Limits{}); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("stopped sandbox: %v", err)
	}
	// A branch of something that is not a snapshot, or of a snapshot
	// whose layers are gone.
	if _, err := f.m.Create(context.Background(), runtime.Spec{Name: "y", From: "bb:1"}); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("branch of a base layer: %v", err)
	}
	// Untagged (layer rm --force), the layer is found by its digest;
	// gone from the store, the branch fails and leaves nothing.
	bb, err := layer.Remove(context.Background(), f.s, "bb:1")
	if err != nil {
		t.Fatal(err)
	}
	z, err := f.m.Create(context.Background(), runtime.Spec{Name: "z", From: "s:1"})
	if err != nil {
		t.Fatalf("branch over an untagged layer: %v", err)
	}
	if err := z.Remove(); err != nil {
		t.Fatal(err)
	}
	for _, d := range []digest.Digest{bb.Manifest, bb.Digest} {
		if err := os.Remove(f.s.BlobPath(d)); err != nil {
			t.Fatal(err)
		}
	}
	_, err = f.m.Create(context.Background(), runtime.Spec{Name: "y", From: "s:1"})
	if !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), "s:1") {
		t.Fatalf("branch with a missing layer: %v", err)
	}
	if runtime.IDOf(f.root, "y") != "" || len(runtime.Unnamed(f.root)) != 0 {
		t.Fatalf("a failed branch left its name or directory: %q, %v", runtime.IDOf(f.root, "y"), runtime.Unnamed(f.root))
	}
}

// TestLazySnapshotBranch: a snapshot pushed to a shared store goes with
// the layers it stands on, and a host that has none of them branches
// from it lazily (its store stays empty) into the same view.
func TestLazySnapshotBranch(t *testing.T) {
	f := newSnapFixture(t)
	ctx := context.Background()
	orig := f.create(runtime.Spec{Name: "orig", Layers: []string{"ws:1", "bb:1"}})
	f.run(orig, "echo one > /work/step1; rm /work/hello")
	f.mustPack(orig, "lazy/r:1")
	f.run(orig, "echo two >> /work/step1; mkdir -p /opt/x; ln /work/step1 /opt/x/hard")
	want := view(t, orig)
	f.mustPack(orig, "lazy/r:2")

	shared, err := remote.Open("dir://"+filepath.Join(t.TempDir(), "shared"), remote.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := layer.ParseRef("lazy/r:2")
	res, err := remote.Copy(ctx, remote.Local(f.s), shared, ref, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var lowers []string
	for _, l := range res.Lowers {
		lowers = append(lowers, l.Ref)
	}
	if strings.Join(lowers, " ") != "bb:1 ws:1 lazy/r:1" {
		t.Fatalf("pushed lowers %v, want the lineage bottom first", lowers)
	}

	host, sb := createOnSecondHost(t, shared, runtime.Spec{Name: "far", From: "lazy/r:2"})
	sameView(t, "a branch on another host", want, view(t, sb))
	hs, _ := store.Open(filepath.Join(host, "store"))
	if l, _ := layer.List(ctx, hs); len(l) != 0 {
		t.Fatalf("the lazy branch pulled %d layers into its host's store", len(l))
	}
	if st := sb.Current(); st.From != "lazy/r:2" || len(st.Layers) != 4 {
		t.Fatalf("branch state %+v", st)
	}
	removeOnSecondHost(t, host, sb)
}

// TestPackDiffNothingChanged: a pack with nothing changed since the last
// is refused and tags nothing (issue 29, item 0: it made a snapshot its
// own child, and the lineage's walks endless); the lineage stays a DAG,
// a branch of the last snapshot works, and a change packs again. A store
// an older dsec left with such a node lists it as nobody's child.
func TestPackDiffNothingChanged(t *testing.T) {
	f := newSnapFixture(t)
	ctx := context.Background()
	sb := f.create(runtime.Spec{Name: "loop1", Layers: []string{"bb:1"}})
	f.mustPack(sb, "loop1:1")
	_, err := f.pack(sb, "loop1:2", snap.Limits{})
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "nothing changed in sandbox loop1 since snapshot loop1:1") {
		t.Fatalf("an empty increment: %v", err)
	}
	if _, err := layer.Resolve(ctx, f.s, "loop1:2"); !errdefs.IsNotFound(err) {
		t.Fatalf("the refused pack left a tag: %v", err)
	}
	if cg := sb.Cgroup(); cg.Frozen() {
		t.Fatal("the refused pack left the sandbox frozen")
	}
	br := f.create(runtime.Spec{Name: "loop1-b", From: "loop1:1"})
	if out, code := sh(t, br, "b", "cat /etc/answer"); code != 0 || out != "42\n" {
		t.Fatalf("a branch of loop1:1: %q %d", out, code)
	}
	f.run(sb, "echo step > /step")
	f.mustPack(sb, "loop1:2")

	// As an older dsec left it: a snapshot whose image is its parent's.
	first, err := layer.Resolve(ctx, f.s, "loop1:1")
	if err != nil {
		t.Fatal(err)
	}
	empty := t.TempDir()
	ref, _ := layer.ParseRef("old:1")
	self, err := layer.Build(ctx, f.s, layer.BuildOptions{Source: empty, Kind: layer.KindSnapshot, Ref: ref,
		Snapshot: &layer.Lineage{Lowers: []layer.Lower{{Ref: "loop1:1", Digest: first.Digest}}, Sandbox: "loop1"}})
	if err != nil {
		t.Fatal(err)
	}
	ref2, _ := layer.ParseRef("old:2")
	if _, err := layer.Build(ctx, f.s, layer.BuildOptions{Source: empty, Kind: layer.KindSnapshot, Ref: ref2,
		Snapshot: &layer.Lineage{Lowers: []layer.Lower{{Ref: "old:1", Digest: self.Digest}, {Ref: "loop1:1", Digest: first.Digest}}, Sandbox: "loop1"}}); err != nil {
		t.Fatal(err)
	}
	nodes, err := snap.Tree(ctx, f.s, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		if slices.Contains(n.Children, n.Name) {
			t.Errorf("%s is its own child: %+v", n.Name, n)
		}
		if n.Name == "old:1" && slices.Contains(n.Children, "old:2") {
			t.Errorf("old:2, the very image of old:1, is listed as its child")
		}
	}
	if _, err := f.m.Create(ctx, runtime.Spec{Name: "old-b", From: "old:2"}); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "stands on its own image") {
		t.Errorf("a branch of a snapshot standing on its own image: %v", err)
	}
	if _, err := snap.Remove(ctx, f.s, "old:2", nil, false); err != nil {
		t.Errorf("remove a snapshot that only its own image stands on: %v", err)
	}
}

// TestPackDiffKeepsFrozen: a sandbox frozen before a pack-diff (a batch
// one the worker froze under memory pressure) is frozen after it; one
// that ran runs again.
func TestPackDiffKeepsFrozen(t *testing.T) {
	f := newSnapFixture(t)
	sb := f.create(runtime.Spec{Name: "frozen", Layers: []string{"bb:1"}})
	if out, code := sh(t, sb, "w", "echo a > /a"); code != 0 {
		t.Fatal(out)
	}
	f.mustPack(sb, "frozen:1")
	if sb.Cgroup().Frozen() {
		t.Fatal("a running sandbox is frozen after a pack-diff")
	}
	if err := sb.Cgroup().Freeze(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(sb.Upper(), "b"), []byte("b\n"), 0o644); err != nil { // a change to pack
		t.Fatal(err)
	}
	f.mustPack(sb, "frozen:2")
	if !sb.Cgroup().Frozen() {
		t.Error("a frozen sandbox was thawed by a pack-diff")
	}
	if err := sb.Cgroup().Thaw(); err != nil {
		t.Fatal(err)
	}
}
