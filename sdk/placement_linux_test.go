package sdk_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// TestGatewayFleetConfig: stored policies and FnCall pools through a
// gateway are the fleet's: a policy stored is on every worker, listed
// once, named by a tenant's create on any worker, removed from all; a
// pool's size is split over the workers (a cordoned one keeps none),
// listed as the fleet's, called through the gateway, removed from all.
func TestGatewayFleetConfig(t *testing.T) {
	ctx := context.Background()
	ws := []*fleetWorker{startFleetWorker(t), startFleetWorker(t), startFleetWorker(t)}
	gwRoot := t.TempDir()
	addr, _ := startGateway(t, gwRoot, ws)
	admin := gatewayClient(t, gwRoot, addr, auth.Spec{Scope: auth.Admin})
	tenant := gatewayClient(t, gwRoot, addr, auth.Spec{Scope: auth.Sandboxes, Policies: []string{"quiet"}})
	direct := make([]*sdk.Client, len(ws))
	for i, w := range ws {
		c, err := sdk.New(sdk.Options{Host: w.url, Token: w.admin, TLSCA: w.ca})
		if err != nil {
			t.Fatal(err)
		}
		direct[i] = c
	}
	quiet := &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy", Network: &api.NetworkPolicy{Mode: api.NetworkLoopback}}
	if err := tenant.SavePolicy(ctx, "quiet", quiet); !errdefs.IsPermissionDenied(err) {
		t.Errorf("a tenant stores a policy through the gateway: %v", err)
	}
	if err := admin.SavePolicy(ctx, "quiet", quiet); err != nil {
		t.Fatal(err)
	}
	if err := admin.SavePolicy(ctx, "other", quiet); err != nil {
		t.Fatal(err)
	}
	for i, c := range direct {
		if _, err := c.Policy(ctx, "quiet"); err != nil {
			t.Errorf("worker %d lacks the policy: %v", i, err)
		}
	}
	ps, err := tenant.Policies(ctx)
	if err != nil || len(ps) != 1 || ps[0].Metadata == nil || ps[0].Metadata.Name != "quiet" {
		t.Errorf("the tenant's policies through the gateway: %+v, %v", ps, err)
	}
	if ps, err := admin.Policies(ctx); err != nil || len(ps) != 2 {
		t.Errorf("the admin's policies through the gateway: %d, %v", len(ps), err)
	}
	if _, err := tenant.Policy(ctx, "other"); !errdefs.IsNotFound(err) {
		t.Errorf("a policy the tenant may not name: %v", err)
	}
	for i := range 3 { // (on whichever worker each lands)
		sb, err := tenant.Create(ctx, api.SandboxSpec{Layers: []string{"ws:1", "bb:1"}, PolicyName: "quiet", Memory: 64 << 20})
		if err != nil {
			t.Fatalf("create %d under the stored policy: %v", i, err)
		}
		sb.Remove(ctx, true)
	}
	for _, name := range []string{"quiet", "other"} {
		if err := admin.RemovePolicy(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	if err := admin.RemovePolicy(ctx, "quiet"); !errdefs.IsNotFound(err) {
		t.Errorf("removing it again: %v", err)
	}
	for i, c := range direct {
		if _, err := c.Policy(ctx, "quiet"); !errdefs.IsNotFound(err) {
			t.Errorf("worker %d keeps the policy: %v", i, err)
		}
	}

	// A pool of 5 over three workers, one cordoned: 3 and 2.
	if err := admin.Cordon(ctx, ws[2].url, true); err != nil {
		t.Fatal(err)
	}
	spec := &api.SandboxSpec{Layers: []string{"ws:1", "bb:1"}, Memory: 64 << 20}
	p, err := admin.ResizePool(ctx, "fn", api.PoolSpec{Size: 5, Spec: spec})
	if err != nil || p.Size != 5 {
		t.Fatalf("the pool through the gateway: %+v, %v", p, err)
	}
	var sizes []int
	for _, c := range direct {
		pools, err := c.Pools(ctx)
		if err != nil || len(pools) != 1 {
			t.Fatalf("a worker's pools: %+v, %v", pools, err)
		}
		sizes = append(sizes, pools[0].Size)
	}
	if !slices.Equal(sizes, []int{3, 2, 0}) {
		t.Errorf("the pool's shares: %v, want [3 2 0]", sizes)
	}
	if pools, err := admin.Pools(ctx); err != nil || len(pools) != 1 || pools[0].Size != 5 {
		t.Errorf("the fleet's pools: %+v, %v", pools, err)
	}
	res, err := tenant.Call(ctx, sdk.CallOptions{Pool: "fn", ExecOptions: sdk.ExecOptions{Args: []string{"true"}}})
	if err != nil || res.ExitCode != 0 {
		t.Errorf("a call on the pool through the gateway: %+v, %v", res, err)
	}
	if err := admin.RemovePool(ctx, "fn"); err != nil {
		t.Fatal(err)
	}
	for i, c := range direct {
		if pools, err := c.Pools(ctx); err != nil || len(pools) != 0 {
			t.Errorf("worker %d keeps the pool: %+v, %v", i, pools, err)
		}
	}
}

// TestGatewayPlacesByAdmission: a create goes to a worker whose
// admission takes it now, before one with more memory left that would
// queue it: worker A admits one CPU of requests in all, B fifty; three
// creates of one CPU each are all made at once, one on A.
func TestGatewayPlacesByAdmission(t *testing.T) {
	ctx := context.Background()
	small := startFleetWorkerWith(t, runtimetest.Config{Admission: worker.Admission{CPUOvercommit: 0.5, QueueTimeout: 500 * time.Millisecond}})
	big := startFleetWorkerWith(t, runtimetest.Config{Admission: worker.Admission{QueueTimeout: 500 * time.Millisecond}})
	gwRoot := t.TempDir()
	addr, _ := startGateway(t, gwRoot, []*fleetWorker{small, big})
	c := gatewayClient(t, gwRoot, addr, auth.Spec{Scope: auth.Admin})
	nodes, err := c.Nodes(ctx)
	if err != nil || len(nodes) != 2 {
		t.Fatalf("nodes: %+v, %v", nodes, err)
	}
	on := map[string]int{}
	for i := range 3 {
		sb, err := c.Create(ctx, api.SandboxSpec{Name: fmt.Sprintf("cpu-%d", i), Layers: []string{"ws:1", "bb:1"}, CPURequest: 1, Memory: 64 << 20})
		if err != nil {
			t.Fatalf("create %d: %v", i, err)
		}
		on[sb.Info.Node]++
		defer sb.Remove(ctx, true)
	}
	if on[small.url] != 1 || on[big.url] != 2 {
		t.Errorf("placed %v: want 1 on the worker that admits one CPU, 2 on the other", on)
	}
}
