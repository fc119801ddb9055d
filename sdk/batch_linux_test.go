package sdk_test

import (
	"context"
	"slices"
	"sync"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/sdk"
)

// batchOf runs a batch and returns its items by index.
func batchOf(t *testing.T, c *sdk.Client, spec api.SandboxSpec, n int) ([]api.BatchItem, error) {
	t.Helper()
	items := make([]api.BatchItem, n)
	var mu sync.Mutex
	seen := map[int]bool{}
	err := c.Batch(context.Background(), spec, n, func(it api.BatchItem) {
		mu.Lock()
		defer mu.Unlock()
		if it.Index < 0 || it.Index >= n || seen[it.Index] {
			t.Errorf("a batch's item %d, of %d (seen: %v)", it.Index, n, seen[it.Index])
			return
		}
		seen[it.Index] = true
		items[it.Index] = it
	})
	return items, err
}

// TestBatch: a batch makes its sandboxes at once, each answered as it
// is made, named NAME-I; one whose name is taken fails alone; a batch
// no create would take (no sandboxes, too many, a name too long for its
// last) is refused whole.
func TestBatch(t *testing.T) {
	_, c := setup(t)
	ctx := context.Background()
	if _, err := c.Create(ctx, api.SandboxSpec{Name: "r-3", Layers: []string{"ws:1", "bb:1"}}); err != nil {
		t.Fatal(err)
	}
	items, err := batchOf(t, c, api.SandboxSpec{Name: "r", Layers: []string{"ws:1", "bb:1"}, Memory: 64 << 20}, 8)
	if err != nil {
		t.Fatal(err)
	}
	for i, it := range items {
		switch {
		case i == 3:
			if it.Error == nil || it.Error.Class != api.ClassExists {
				t.Errorf("item 3 (r-3 taken): %+v", it)
			}
		case it.Error != nil || it.Sandbox == nil || it.Sandbox.Name != api.BatchName("r", i) || it.Sandbox.Status != api.StatusRunning:
			t.Errorf("item %d: %+v %+v", i, it, it.Error)
		}
	}
	var out []string
	for _, it := range items {
		if it.Sandbox != nil {
			res, err := c.Sandbox(it.Sandbox.Name).Exec(ctx, sdk.ExecOptions{Args: []string{"true"}})
			if err != nil || res.ExitCode != 0 {
				t.Errorf("exec in %s: %+v %v", it.Sandbox.Name, res, err)
			}
			out = append(out, it.Sandbox.Name)
		}
	}
	if len(out) != 7 {
		t.Errorf("made %v", out)
	}
	// Unnamed: the worker names each.
	items, err = batchOf(t, c, api.SandboxSpec{Layers: []string{"ws:1", "bb:1"}, Memory: 64 << 20}, 3)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, it := range items {
		if it.Sandbox == nil {
			t.Fatalf("an unnamed batch's item: %+v", it.Error)
		}
		names = append(names, it.Sandbox.Name)
	}
	slices.Sort(names)
	if len(slices.Compact(names)) != 3 {
		t.Errorf("names of an unnamed batch: %v", names)
	}
	for _, n := range []int{0, api.MaxBatch + 1} {
		if _, err := batchOf(t, c, api.SandboxSpec{Layers: []string{"ws:1", "bb:1"}}, n); !errdefs.IsInvalidArgument(err) {
			t.Errorf("a batch of %d: %v", n, err)
		}
	}
	long := "x0123456789012345678901234567890123456789012345678901234567890"
	if _, err := batchOf(t, c, api.SandboxSpec{Name: long, Layers: []string{"ws:1", "bb:1"}}, 2); !errdefs.IsInvalidArgument(err) {
		t.Errorf("a batch whose last name is too long: %v", err)
	}
}
