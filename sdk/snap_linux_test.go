package sdk_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime/backend/backendtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

func TestSnapshotAndBranch(t *testing.T) {
	_, c := setup(t)
	ctx := context.Background()
	sb := create(t, c, api.SandboxSpec{Name: "step"})
	run(t, sb, "1", "echo k > /work/at-k; rm /etc/answer")
	snap, err := sb.PackDiff(ctx, api.PackRequest{Tag: "traj:3"})
	if err != nil {
		t.Fatal(err)
	}
	if snap.Name != "traj:3" || snap.Parent != "ws:1" || snap.Sandbox != "step" || snap.Incremental || snap.Whiteouts != 1 ||
		len(snap.Layers) != 2 || snap.FrozenSeconds <= 0 {
		t.Fatalf("snapshot %+v", snap)
	}
	// The sandbox runs on and keeps its files.
	if out, _ := run(t, sb, "2", "cat /work/at-k; echo after > /work/later"); out != "k\n" {
		t.Fatalf("after pack-diff: %q", out)
	}
	brs, err := c.Branch(ctx, api.BranchRequest{Snapshot: "traj:3", N: 4, NamePrefix: "br", Spec: api.SandboxSpec{Env: []string{"B=1"}}})
	if err != nil {
		t.Fatal(err)
	}
	for i, b := range brs {
		if b.Name != fmt.Sprintf("br-%d", i+1) {
			t.Fatalf("branch %d is %s", i, b.Name)
		}
		out, _ := run(t, b, "1", "cat /work/at-k; ls /work; test -e /etc/answer || echo gone; echo $B")
		if out != "k\nat-k\nhello\ngone\n1\n" {
			t.Fatalf("branch %s: %q", b.Name, out)
		}
		if d, _ := b.Inspect(ctx); d.Snapshot != "traj:3" || d.Layers[0] != "traj:3" {
			t.Fatalf("branch %+v", d)
		}
	}
	// Restore is a branch of one.
	one, err := c.Create(ctx, api.SandboxSpec{Name: "restored", Snapshot: "traj:3"})
	if err != nil {
		t.Fatal(err)
	}
	if out, _ := run(t, one, "1", "cat /work/at-k"); out != "k\n" {
		t.Fatalf("restored: %q", out)
	}
	// All or nothing: br2-3 exists, so no br2-* is kept.
	create(t, c, api.SandboxSpec{Name: "br2-3"})
	_, err = c.Branch(ctx, api.BranchRequest{Snapshot: "traj:3", N: 4, NamePrefix: "br2"})
	if !errdefs.IsAlreadyExists(err) {
		t.Fatalf("branch over an existing name: %v", err)
	}
	list, _ := c.List(ctx)
	for _, d := range list {
		if strings.HasPrefix(d.Name, "br2-") && d.Name != "br2-3" {
			t.Fatalf("a failed branch kept %s", d.Name)
		}
	}
	// Default names never collide: a second branch takes the next
	// indices (issue 29, item 3).
	var got []string
	for range 2 {
		brs, err := c.Branch(ctx, api.BranchRequest{Snapshot: "traj:3", N: 2})
		if err != nil {
			t.Fatalf("a branch with default names: %v", err)
		}
		for _, b := range brs {
			got = append(got, b.Name)
		}
	}
	if strings.Join(got, " ") != "traj-3-1 traj-3-2 traj-3-3 traj-3-4" {
		t.Fatalf("default branch names: %v", got)
	}
	for _, n := range got {
		if err := c.Sandbox(n).Remove(ctx, true); err != nil {
			t.Fatal(err)
		}
	}
	for _, c2 := range []struct {
		req  api.BranchRequest
		want func(error) bool
	}{
		{api.BranchRequest{Snapshot: "nope:1", N: 1}, errdefs.IsNotFound},
		{api.BranchRequest{Snapshot: "bb:1", N: 1}, errdefs.IsInvalidArgument},
		{api.BranchRequest{Snapshot: "traj:3", N: 0}, errdefs.IsInvalidArgument},
	} {
		if _, err := c.Branch(ctx, c2.req); !c2.want(err) {
			t.Errorf("branch %+v: %v", c2.req, err)
		}
	}
	if _, err := sb.PackDiff(ctx, api.PackRequest{Tag: "traj:3"}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("existing tag: %v", err)
	}
	if _, err := c.Sandbox("nope").PackDiff(ctx, api.PackRequest{Tag: "x:1"}); !errdefs.IsNotFound(err) {
		t.Fatalf("unknown sandbox: %v", err)
	}

	// Lineage, squash and removal.
	if _, err := sb.PackDiff(ctx, api.PackRequest{Tag: "traj/sub:4"}); err != nil {
		t.Fatal(err)
	}
	nodes, err := c.Snapshots(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(nodes) != 2 || nodes[0].Name != "traj:3" || nodes[1].Name != "traj/sub:4" || nodes[1].Parent != "traj:3" ||
		!nodes[1].Incremental || strings.Join(nodes[0].Children, ",") != "traj/sub:4" ||
		strings.Join(nodes[0].Branches, ",") != "br-1,br-2,br-3,br-4,restored" {
		t.Fatalf("lineage %+v", nodes)
	}
	sq, err := c.Squash(ctx, "traj/sub:4", "flat:4")
	if err != nil {
		t.Fatal(err)
	}
	if sq.Folded != 2 || sq.Parent != "ws:1" || len(sq.Layers) != 2 {
		t.Fatalf("squash %+v", sq)
	}
	flat, err := c.Create(ctx, api.SandboxSpec{Name: "flat", Snapshot: "flat:4"})
	if err != nil {
		t.Fatal(err)
	}
	if out, _ := run(t, flat, "1", "cat /work/at-k /work/later; test -e /etc/answer || echo gone"); out != "k\nafter\ngone\n" {
		t.Fatalf("sandbox on the squashed snapshot: %q", out)
	}
	if err := c.RemoveSnapshot(ctx, "traj:3", false); !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "snapshot traj/sub:4") {
		t.Fatalf("rm of a snapshot stood on: %v", err)
	}
	if err := c.RemoveSnapshot(ctx, "nope:1", false); !errdefs.IsNotFound(err) {
		t.Fatalf("rm of no snapshot: %v", err)
	}
	if _, err := c.Squash(ctx, "traj:3", "x:1"); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("squash of a chain of one: %v", err)
	}
	if err := flat.Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
	if err := c.RemoveSnapshot(ctx, "flat:4", false); err != nil {
		t.Fatal(err)
	}
	if err := c.RemoveSnapshot(ctx, "traj/sub:4", false); err != nil {
		t.Fatal(err)
	}
	if nodes, _ := c.Snapshots(ctx); len(nodes) != 1 || len(nodes[0].Children) != 0 {
		t.Fatalf("after rm: %+v", nodes)
	}
}

// A process renaming files as fast as it can while the sandbox is
// packed: every snapshot holds exactly one of the two names.
func TestPackDuringRenameRace(t *testing.T) {
	_, c := setup(t)
	ctx := context.Background()
	sb := create(t, c, api.SandboxSpec{Name: "racer"})
	run(t, sb, "1", "echo payload > /work/a")
	if _, err := sb.Exec(ctx, sdk.ExecOptions{ID: "race", Detach: true,
		Args: []string{"sh", "-c", "touch /racing; while :; do mv /work/a /work/b; mv /work/b /work/a; done"}}); err != nil {
		t.Fatal(err)
	}
	backendtest.WaitFile(t, sb, "/racing")
	for i := 1; i <= 5; i++ {
		tag := fmt.Sprintf("race:%d", i)
		if _, err := sb.PackDiff(ctx, api.PackRequest{Tag: tag}); err != nil {
			t.Fatalf("pack %d: %v", i, err)
		}
		b, err := c.Create(ctx, api.SandboxSpec{Name: fmt.Sprint("check-", i), Snapshot: tag})
		if err != nil {
			t.Fatal(err)
		}
		if out, _ := run(t, b, "1", "cat /work/a /work/b 2>/dev/null; ls /work"); out != "payload\na\nhello\n" && out != "payload\nb\nhello\n" {
			t.Fatalf("snapshot %d: %q", i, out)
		}
		b.Remove(ctx, true)
	}
}

// kill -9 of the worker while it packs: no tag, and the next worker
// thaws the sandbox.
func TestWorkerKilledMidPack(t *testing.T) {
	w, c := setup(t)
	ctx := context.Background()
	sb := create(t, c, api.SandboxSpec{Name: "packed"})
	run(t, sb, "1", "dd if=/dev/urandom of=/work/big bs=1M count=256 2>/dev/null")
	d, _ := sb.Inspect(ctx)
	freeze := filepath.Join(d.Cgroup, "cgroup.freeze")
	go sb.PackDiff(ctx, api.PackRequest{Tag: "killed:1"})
	deadline := time.Now().Add(20 * time.Second)
	for {
		if b, _ := os.ReadFile(freeze); strings.TrimSpace(string(b)) == "1" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the sandbox was never frozen")
		}
		time.Sleep(time.Millisecond)
	}
	w.Kill()
	runtimetest.StartWorker(t, w.Root)
	if b, _ := os.ReadFile(freeze); strings.TrimSpace(string(b)) != "0" {
		t.Fatal("the new worker left the sandbox frozen")
	}
	if out, res := run(t, sb, "2", "echo alive"); out != "alive\n" || res.ExitCode != 0 {
		t.Fatalf("after recovery: %q", out)
	}
	s, err := store.Open(filepath.Join(w.Root, "store"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := layer.Resolve(ctx, s, "killed:1"); !errdefs.IsNotFound(err) {
		t.Fatalf("a killed pack left its tag: %v", err)
	}
	// And packing again works.
	if _, err := sb.PackDiff(ctx, api.PackRequest{Tag: "killed:1"}); err != nil {
		t.Fatal(err)
	}
}
