package sdk_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
)

// TestForkGroups: a fork is one pack-diff and K sandboxes on it, a
// group whose members report their state and last exec; keeping one
// removes the others and leaves it held by the lease; a lease's expiry
// (after a worker's restart too) removes what it holds and untags its
// snapshots; a renewal keeps it; removing a group removes its members
// and its snapshot, but not a snapshot something else stands on; a
// group whose members are all gone by other means goes too.
func TestForkGroups(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	runtimetest.Layers(t, root)
	w, c := setupAt(t, root, runtimetest.Config{})
	src := create(t, c, api.SandboxSpec{Name: "root"})
	run(t, src, "s1", "echo 7 > /work/state")

	g, err := src.Fork(ctx, api.ForkRequest{N: 3, TTL: 3})
	if err != nil {
		t.Fatal(err)
	}
	if len(g.Members) != 3 || g.Snapshot != "fork-root:1" || g.Lease == "" || g.Sandbox != "root" {
		t.Fatalf("the group: %+v", g)
	}
	for _, m := range g.Members {
		if out, _ := run(t, c.Sandbox(m.Name), "look", "cat /work/state"); out != "7\n" || m.Status != api.StatusRunning {
			t.Errorf("member %s: %q, %s", m.Name, out, m.Status)
		}
	}
	got, err := c.Group(ctx, g.ID)
	if err != nil || got.Members[1].LastExec != "look" || got.Members[1].Execs != 1 {
		t.Fatalf("the group's members after a step: %+v %v", got, err)
	}
	// Renewed: it outlives its first ttl.
	if _, err := c.RenewLease(ctx, g.Lease, 3); err != nil {
		t.Fatal(err)
	}
	rel, err := c.KeepMember(ctx, g.ID, g.Members[1].Name)
	if err != nil || len(rel.Sandboxes) != 2 || !slices.Contains(rel.Kept, g.Members[1].Name) {
		t.Fatalf("keep member 2: %+v %v", rel, err)
	}
	if _, err := c.Group(ctx, g.ID); !errdefs.IsNotFound(err) {
		t.Errorf("the group after keep: %v", err)
	}
	ls, err := c.Leases(ctx)
	if err != nil || len(ls) != 1 || !slices.Equal(ls[0].Kept, []string{g.Members[1].Name}) || !slices.Equal(ls[0].Holds, []string{"fork-root:1"}) {
		t.Fatalf("the lease after keep: %+v %v", ls, err)
	}
	// The kept member forks the next step, under the same lease.
	kept := c.Sandbox(g.Members[1].Name)
	run(t, kept, "s2", "echo 8 > /work/state")
	g2, err := kept.Fork(ctx, api.ForkRequest{N: 2, Lease: g.Lease, NamePrefix: "step2"})
	if err != nil || g2.Members[0].Name != "step2-1" {
		t.Fatalf("a fork of the kept member under the lease: %+v %v", g2, err)
	}

	// The worker restarts; the lease expires all the same.
	w.Stop(t, true)
	runtimetest.StartWorkerWith(t, root, runtimetest.Config{})
	gone := func(what string) {
		t.Helper()
		for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			sbs, _ := c.List(ctx)
			snaps, _ := c.Snapshots(ctx)
			ls, _ := c.Leases(ctx)
			if len(sbs) == 1 && sbs[0].Name == "root" && len(snaps) == 0 && len(ls) == 0 {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: left %d sandboxes, snapshots %+v, leases %+v", what, len(sbs), snaps, ls)
			}
		}
	}
	gone("the lease expired across a restart")

	// No lease: held until removed; a snapshot a hand-made branch stands
	// on stays.
	g3, err := src.Fork(ctx, api.ForkRequest{N: 2})
	if err != nil || g3.Lease != "" {
		t.Fatalf("a fork without a lease: %+v %v", g3, err)
	}
	hand, err := c.Branch(ctx, api.BranchRequest{Snapshot: g3.Snapshot, N: 1, NamePrefix: "hand"})
	if err != nil {
		t.Fatal(err)
	}
	rel, err = c.RemoveGroup(ctx, g3.ID)
	if err != nil || len(rel.Sandboxes) != 2 || len(rel.Snapshots) != 0 || !slices.Contains(rel.Kept, g3.Snapshot) {
		t.Fatalf("remove a group whose snapshot a branch stands on: %+v %v", rel, err)
	}
	if _, err := c.Snapshot(ctx, g3.Snapshot); err != nil {
		t.Errorf("the snapshot a branch stands on: %v", err)
	}
	hand[0].Remove(ctx, true)
	c.RemoveSnapshot(ctx, g3.Snapshot, false)

	// Members removed by hand: the group goes, and its snapshot.
	g4, err := src.Fork(ctx, api.ForkRequest{N: 1, Tag: "mine:1"})
	if err != nil || g4.Snapshot != "mine:1" {
		t.Fatalf("a fork with a tag: %+v %v", g4, err)
	}
	c.Sandbox(g4.Members[0].Name).Remove(ctx, true)
	gone("a group whose members were removed by hand")

	// A sandbox made since under a member's name is none of the group's:
	// the group's end leaves it.
	g5, err := src.Fork(ctx, api.ForkRequest{N: 2, NamePrefix: "agent"})
	if err != nil {
		t.Fatal(err)
	}
	c.Sandbox("agent-1").Remove(ctx, true)
	other := create(t, c, api.SandboxSpec{Name: "agent-1"})
	if got, err := c.Group(ctx, g5.ID); err != nil || got.Members[0].Status != "gone" {
		t.Errorf("a member removed, its name taken since: %+v %v", got, err)
	}
	if rel, err := c.RemoveGroup(ctx, g5.ID); err != nil || !slices.Equal(rel.Sandboxes, []string{"agent-2"}) {
		t.Errorf("remove the group: %+v %v, want agent-2 alone removed", rel, err)
	}
	if _, err := other.Inspect(ctx); err != nil {
		t.Errorf("the sandbox made since under a member's name: %v", err)
	}
	other.Remove(ctx, true)

	// Bad input.
	for _, req := range []api.ForkRequest{{N: 0}, {N: 2000}, {N: 1, TTL: -1}, {N: 1, Lease: "x", TTL: 5}, {N: 1, Tag: "no-step"}} {
		if _, err := src.Fork(ctx, req); !errdefs.IsInvalidArgument(err) {
			t.Errorf("fork %+v: %v, want invalid argument", req, err)
		}
	}
	if _, err := src.Fork(ctx, api.ForkRequest{N: 1, Lease: "lease-nosuch"}); !errdefs.IsNotFound(err) {
		t.Errorf("fork under no lease: %v", err)
	}
	if _, err := c.CreateLease(ctx, 0); !errdefs.IsInvalidArgument(err) {
		t.Errorf("a lease of 0 s: %v", err)
	}
}
