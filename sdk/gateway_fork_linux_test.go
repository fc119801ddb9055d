package sdk_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/sdk"
)

// TestGatewayForks: fork groups and leases through a gateway of two
// workers: a lease made through it is on both; a fork runs on its
// sandbox's worker, its members' names the fleet's and reachable at
// once; a lease made on one worker alone is made on the other when a
// fork there names it; groups and leases list once, are kept, renewed
// and ended through the gateway; another tenant sees none of it.
func TestGatewayForks(t *testing.T) {
	ctx := context.Background()
	ws := []*fleetWorker{startFleetWorker(t), startFleetWorker(t)}
	gwRoot := t.TempDir()
	addr, _ := startGateway(t, gwRoot, ws)
	alice := gatewayClient(t, gwRoot, addr, auth.Spec{Scope: auth.Sandboxes})
	bob := gatewayClient(t, gwRoot, addr, auth.Spec{Scope: auth.Sandboxes})
	direct := make([]*sdk.Client, len(ws))
	for i, w := range ws {
		c, err := sdk.New(sdk.Options{Host: w.url, Token: w.admin, TLSCA: w.ca})
		if err != nil {
			t.Fatal(err)
		}
		direct[i] = c
	}

	// One sandbox on each worker.
	var srcs []*sdk.Sandbox
	for len(srcs) < 2 {
		sb, err := alice.Create(ctx, api.SandboxSpec{Layers: []string{"ws:1", "bb:1"}, Memory: 64 << 20})
		if err != nil {
			t.Fatal(err)
		}
		if len(srcs) == 1 && sb.Info.Node == srcs[0].Info.Node {
			sb.Remove(ctx, true)
			continue
		}
		run(t, sb, "w", "echo state > /work/state")
		srcs = append(srcs, sb)
	}

	lease, err := alice.CreateLease(ctx, 600)
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range direct {
		if ls, err := c.Leases(ctx); err != nil || !slices.ContainsFunc(ls, func(l api.Lease) bool { return l.ID == lease.ID }) {
			t.Errorf("worker %d lacks the lease made through the gateway: %+v %v", i, ls, err)
		}
	}
	var groups []*api.Group
	for _, sb := range srcs {
		g, err := sb.Fork(ctx, api.ForkRequest{N: 2, Lease: lease.ID})
		if err != nil {
			t.Fatalf("fork %s through the gateway: %v", sb.Name, err)
		}
		for _, m := range g.Members {
			if !strings.HasPrefix(m.Name, "fork-"+sb.Name+"-") {
				t.Errorf("member %s of a fork of %s", m.Name, sb.Name)
			}
			if out, _ := run(t, alice.Sandbox(m.Name), "look", "cat /work/state"); out != "state\n" {
				t.Errorf("member %s: %q", m.Name, out)
			}
		}
		groups = append(groups, g)
	}
	gs, err := alice.Groups(ctx)
	if err != nil || len(gs) != 2 {
		t.Fatalf("the groups through the gateway: %+v %v", gs, err)
	}
	if got, err := alice.Group(ctx, groups[1].ID); err != nil || got.Members[0].LastExec != "look" {
		t.Errorf("a group through the gateway: %+v %v", got, err)
	}
	if _, err := bob.Group(ctx, groups[0].ID); !errdefs.IsNotFound(err) {
		t.Errorf("bob asks for alice's group: %v", err)
	}
	if ls, err := bob.Leases(ctx); err != nil || len(ls) != 0 {
		t.Errorf("bob's leases: %+v %v", ls, err)
	}
	if _, err := bob.RemoveLease(ctx, lease.ID); !errdefs.IsNotFound(err) {
		t.Errorf("bob ends alice's lease: %v", err)
	}
	rel, err := alice.KeepMember(ctx, groups[0].ID, groups[0].Members[0].Name)
	if err != nil || len(rel.Sandboxes) != 1 {
		t.Fatalf("keep through the gateway: %+v %v", rel, err)
	}
	ls, err := alice.Leases(ctx)
	if err != nil || len(ls) != 1 || len(ls[0].Groups) != 1 || len(ls[0].Kept) != 1 {
		t.Fatalf("the lease through the gateway, merged: %+v %v", ls, err)
	}
	if _, err := alice.RenewLease(ctx, lease.ID, 900); err != nil {
		t.Fatal(err)
	}

	// A lease on one worker alone: a fork on the other naming it makes
	// it there.
	solo, err := direct[0].CreateLease(ctx, 600)
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(ws, func(w *fleetWorker) bool { return w.url == srcs[1].Info.Node })
	if i == 0 {
		solo, err = direct[1].CreateLease(ctx, 600)
		if err != nil {
			t.Fatal(err)
		}
	}
	admin := gatewayClient(t, gwRoot, addr, auth.Spec{Scope: auth.Admin})
	if _, err := admin.Sandbox(srcs[1].Name).Fork(ctx, api.ForkRequest{N: 1, Lease: solo.ID}); err != nil {
		t.Fatalf("a fork naming a lease its worker lacked: %v", err)
	}
	if _, err := admin.RemoveLease(ctx, solo.ID); err != nil {
		t.Fatal(err)
	}

	rel, err = alice.RemoveLease(ctx, lease.ID)
	if err != nil || len(rel.Sandboxes) != 3 || len(rel.Snapshots) != 2 {
		t.Fatalf("end the lease through the gateway: %+v %v", rel, err)
	}
	sbs, err := alice.List(ctx)
	if err != nil || len(sbs) != 2 {
		t.Errorf("after the lease: %d sandboxes (%v), want the two forked", len(sbs), err)
	}
	if snaps, err := alice.Snapshots(ctx); err != nil || len(snaps) != 0 {
		t.Errorf("after the lease: snapshots %+v %v", snaps, err)
	}
}
