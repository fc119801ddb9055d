package runtime

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/layer/store"
)

// TestLeased: what a create resolves is leased under the store's writer
// lock, so a collection that starts meanwhile waits, then keeps it,
// untagged; once the create's lease is released, it collects it.
func TestLeased(t *testing.T) {
	ctx := context.Background()
	s, err := store.Open(filepath.Join(t.TempDir(), "store"))
	if err != nil {
		t.Fatal(err)
	}
	blob, err := s.WriteBlob("application/octet-stream", []byte("a layer nothing tags"))
	if err != nil {
		t.Fatal(err)
	}
	lease, err := createLease(s)
	if err != nil {
		t.Fatal(err)
	}
	resolving, gcDone := make(chan struct{}), make(chan error, 1)
	go func() {
		<-resolving
		_, err := s.GC(ctx, store.Marks{})
		gcDone <- err
	}()
	err = leased(s, lease, func() ([]string, error) {
		close(resolving)
		select {
		case err := <-gcDone:
			t.Errorf("a collection ran while a create resolved: %v", err)
		case <-time.After(300 * time.Millisecond):
		}
		return []string{blob.Digest.String(), ""}, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := <-gcDone; err != nil {
		t.Fatal(err)
	}
	if !s.Exists(blob.Digest) {
		t.Fatal("a collection took what a create under way resolved")
	}
	if l, err := s.Leased(); err != nil || len(l[blob.Digest]) != 1 {
		t.Fatalf("leased: %v %v", l, err)
	}
	lease.Release()
	if ents, _ := os.ReadDir(filepath.Join(s.Dir(), "leases")); len(ents) != 0 {
		t.Errorf("a released lease left %v", ents)
	}
	if _, err := s.GC(ctx, store.Marks{}); err != nil {
		t.Fatal(err)
	}
	if s.Exists(digest.Digest(blob.Digest)) {
		t.Error("a collection kept what no tag or lease holds")
	}
	// Without a store (library use): resolve alone.
	if err := leased(nil, nil, func() ([]string, error) { return []string{"x"}, nil }); err != nil {
		t.Error(err)
	}
}
