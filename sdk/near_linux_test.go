package sdk_test

import (
	"context"
	"crypto/rand"
	"os"
	"path/filepath"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/layer"
	lremote "github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// TestGatewayPlacesNearLayers: among workers whose admission takes a
// create, the gateway places it on one that holds its layers: before
// one with more memory left that would fetch 40 MiB from the shared
// remote, or that finds a layer nowhere; a create whose layers every
// worker holds goes by memory left, as before. A tenant's estimate is
// the admin's to ask: a worker refuses it from a tenant's token.
func TestGatewayPlacesNearLayers(t *testing.T) {
	ctx := context.Background()
	shared := "dir://" + filepath.Join(t.TempDir(), "shared")
	a, b := startFleetWorkerWith(t, runtimetest.Config{RemoteURL: shared}), startFleetWorkerWith(t, runtimetest.Config{RemoteURL: shared})
	// a holds big:1 (40 MiB that do not compress), which b would fetch
	// from the shared remote, and solo:1, which b finds nowhere.
	local, err := store.Open(filepath.Join(a.w.Root, "store"))
	if err != nil {
		t.Fatal(err)
	}
	for tag, size := range map[string]int{"big:1": 40 << 20, "solo:1": 1 << 10} {
		src := t.TempDir()
		os.MkdirAll(filepath.Join(src, "data"), 0o755)
		b := make([]byte, size)
		rand.Read(b)
		if err := os.WriteFile(filepath.Join(src, "data", tag[:len(tag)-2]), b, 0o644); err != nil {
			t.Fatal(err)
		}
		ref, _ := layer.ParseRef(tag)
		if _, err := layer.Build(ctx, local, layer.BuildOptions{Source: src, Kind: layer.KindWorkspace, Ref: ref}); err != nil {
			t.Fatal(err)
		}
	}
	remote, err := lremote.Open(shared, lremote.Options{})
	if err != nil {
		t.Fatal(err)
	}
	big, _ := layer.ParseRef("big:1")
	if _, err := lremote.Copy(ctx, lremote.Local(local), remote, big, false, nil); err != nil {
		t.Fatal(err)
	}
	gwRoot := t.TempDir()
	addr, _ := startGateway(t, gwRoot, []*fleetWorker{a, b})
	admin := gatewayClient(t, gwRoot, addr, auth.Spec{Scope: auth.Admin})
	tenant := gatewayClient(t, gwRoot, addr, auth.Spec{Scope: auth.Sandboxes})

	// a has less memory left: two sandboxes of 256 MiB made there.
	direct, err := sdk.New(sdk.Options{Host: a.url, Token: a.admin, TLSCA: a.ca})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := direct.Create(ctx, api.SandboxSpec{Layers: []string{"ws:1", "bb:1"}, Memory: 256 << 20}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "the gateway to see a's sandboxes", func() bool {
		ns, err := admin.Nodes(ctx)
		for _, n := range ns {
			if err == nil && n.URL == a.url && n.Sandboxes == 2 {
				return true
			}
		}
		return false
	})
	for _, tc := range []struct {
		c      *sdk.Client
		layers []string
		want   string
	}{
		{admin, []string{"big:1", "bb:1"}, a.url},  // b would fetch 40 MiB
		{tenant, []string{"big:1", "bb:1"}, a.url}, // (the tenant may name the admin's layers)
		{admin, []string{"solo:1", "bb:1"}, a.url}, // b finds solo:1 nowhere
		{admin, []string{"ws:1", "bb:1"}, b.url},   // both hold them: b has more room
	} {
		sb, err := tc.c.Create(ctx, api.SandboxSpec{Layers: tc.layers, Memory: 64 << 20})
		if err != nil {
			t.Fatalf("create on %v: %v", tc.layers, err)
		}
		if sb.Info.Node != tc.want {
			t.Errorf("a create on %v went to %s, want %s", tc.layers, sb.Info.Node, tc.want)
		}
		if err := sb.Remove(ctx, true); err != nil {
			t.Fatal(err)
		}
	}
	// A worker answers estimates to admins only.
	tok, _, err := auth.Open(b.w.Root).Create(auth.Sandboxes, 0)
	if err != nil {
		t.Fatal(err)
	}
	bt, err := sdk.New(sdk.Options{Host: b.url, Token: tok, TLSCA: b.ca})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bt.Estimate(ctx, api.EstimateRequest{Layers: []string{"solo:1"}}); !errdefs.IsPermissionDenied(err) {
		t.Errorf("a tenant's estimate: %v, want permission denied", err)
	}
	bd, err := sdk.New(sdk.Options{Host: b.url, Token: b.admin, TLSCA: b.ca})
	if err != nil {
		t.Fatal(err)
	}
	if e, err := bd.Estimate(ctx, api.EstimateRequest{Layers: []string{"big:1", "solo:1", "bb:1"}}); err != nil || e.Missing != 1 || e.FetchBytes < 40<<20 {
		t.Errorf("b's estimate of big:1, solo:1 and bb:1: %+v %v, want solo:1 missing and 40 MiB to fetch", e, err)
	}
}
