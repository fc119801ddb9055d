package sdk_test

import (
	"context"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/lazy"
	lremote "github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/runtime/driver/vms"
	"github.com/dsec-project/dsec/internal/runtime/microvm/microvmtest"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/vm"
	"github.com/dsec-project/dsec/sdk"
)

// BenchmarkFullVMRemote: a full VM's memory snapshot, published to a
// dir: remote by the worker that took it, continued on a worker whose
// store holds none of it: create to first exec of a branch there, its
// disks read lazily from the remote (the bytes fetched, next to the
// disk chain's), next to the same on a worker that pulls the snapshot
// whole first (dsec vm image pull). Each round's workers are new.
// Rounds: b.N (make bench: BENCH_VM_N).
func BenchmarkFullVMRemote(b *testing.B) {
	agent, err := microvmtest.Agent()
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	shared := b.TempDir()
	worker := func(publish bool) (string, *sdk.Client) {
		root := b.TempDir()
		runtimetest.Layers(b, root)
		w := runtimetest.StartWorkerWith(b, root, runtimetest.Config{VM: vms.Settings{Agent: agent}, RemoteURL: "dir://" + shared, PublishSnapshots: publish})
		b.Cleanup(func() { w.Kill(); runtimetest.Clean(root) })
		c, err := sdk.New(sdk.Options{Root: root})
		if err != nil {
			b.Fatal(err)
		}
		return root, c
	}
	root, c := worker(true)
	ref := runtimetest.VMImage(b, root)
	src, err := c.Create(ctx, api.SandboxSpec{Backend: vms.VM, Layers: []string{ref}, Memory: 1 << 30})
	if err != nil {
		b.Fatal(err)
	}
	execB(b, src, "true")
	time.Sleep(10 * time.Second) // (the guest settles)
	sn, err := src.PackDiff(ctx, api.PackRequest{Tag: "bench-rvm:1", Memory: true})
	if err != nil {
		b.Fatal(err)
	}
	src.Remove(ctx, true)
	target, err := lremote.Open("dir://"+shared, lremote.Options{})
	if err != nil {
		b.Fatal(err)
	}
	r, _ := layer.ParseRef(sn.Name)
	var lazily, whole []time.Duration
	var fetched, chain int64
	for b.Loop() {
		root, c := worker(false)
		t0 := time.Now()
		br, err := c.Branch(ctx, api.BranchRequest{Snapshot: sn.Name, N: 1})
		if err != nil {
			b.Fatal(err)
		}
		execB(b, br[0], "true")
		lazily = append(lazily, time.Since(t0))
		img, err := vm.Lookup(ctx, storeOf(b, root), sn.Name)
		if err != nil {
			b.Fatal(err)
		}
		fetched, chain = 0, 0
		for _, d := range img.Chain {
			if st, err := lazy.ReadStats(root, d.Digest); err == nil {
				fetched += st.BytesFetched
			}
			chain += d.Size
		}
		br[0].Remove(ctx, true)

		root, c = worker(false)
		t0 = time.Now()
		if _, err := vm.Copy(ctx, target, lremote.Local(storeOf(b, root)), r, false, nil); err != nil {
			b.Fatal(err)
		}
		br, err = c.Branch(ctx, api.BranchRequest{Snapshot: sn.Name, N: 1})
		if err != nil {
			b.Fatal(err)
		}
		execB(b, br[0], "true")
		whole = append(whole, time.Since(t0))
		br[0].Remove(ctx, true)
	}
	b.ReportMetric(p50ms(lazily), "lazy-p50-ms")
	b.ReportMetric(p50ms(whole), "whole-p50-ms")
	b.ReportMetric(float64(fetched)/(1<<20), "fetched-MiB")
	b.ReportMetric(float64(chain)/(1<<20), "chain-MiB")
}
