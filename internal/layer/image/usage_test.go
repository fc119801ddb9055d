package image

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// TestDu: two tags of one tree share its EROFS image, stored once and
// counted in both; what each holds alone is its manifest and config; a
// tag removed leaves its blobs untagged.
func TestDu(t *testing.T) {
	ctx := context.Background()
	s, err := store.Open(filepath.Join(t.TempDir(), "store"))
	if err != nil {
		t.Fatal(err)
	}
	tree := t.TempDir()
	if err := os.WriteFile(filepath.Join(tree, "data"), make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	var infos []*layer.Info
	for _, b := range []struct {
		ref  string
		kind layer.Kind
	}{{"a:1", layer.KindBase}, {"b:1", layer.KindWorkspace}} {
		ref, _ := layer.ParseRef(b.ref)
		info, err := layer.Build(ctx, s, layer.BuildOptions{Source: tree, Kind: b.kind, Ref: ref})
		if err != nil {
			t.Fatal(err)
		}
		infos = append(infos, info)
	}
	if infos[0].Digest != infos[1].Digest {
		t.Fatal("one tree gave two images")
	}
	u, err := Du(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	if len(u.Entries) != 2 || u.Entries[0].Name != "a:1" || u.Entries[1].Kind != "workspace" {
		t.Fatalf("entries %+v", u.Entries)
	}
	img := infos[0].Size
	for _, e := range u.Entries {
		if e.Layers != 1 || e.Logical < img || e.Own <= 0 || e.Own >= img {
			t.Errorf("%s: logical %d, own %d: want at least the image's %d, and its own its manifest and config", e.Name, e.Logical, e.Own, img)
		}
	}
	if u.Logical != u.Entries[0].Logical+u.Entries[1].Logical || u.Stored >= u.Logical || u.Stored < img || u.Untagged != 0 {
		t.Fatalf("logical %d, stored %d, untagged %d", u.Logical, u.Stored, u.Untagged)
	}
	if _, err := s.Untag(ctx, "b:1"); err != nil {
		t.Fatal(err)
	}
	after, err := Du(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	if len(after.Entries) != 1 || after.Stored != after.Logical || after.Untagged != u.Entries[1].Own || after.Stored+after.Untagged != u.Stored || after.Leftovers != 0 {
		t.Fatalf("after b:1 went: %+v", after)
	}
	// What an interrupted build or pull left in the ingest area counts,
	// sparse as it takes.
	if err := os.WriteFile(filepath.Join(s.Dir(), "ingest", "blob.123"), make([]byte, 8192), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(s.Dir(), "ingest", "partial-x"))
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(1 << 30) // a hole
	f.Close()
	left, err := Du(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	if left.Leftovers != 8192 {
		t.Fatalf("leftovers %d, want the 8192 bytes written (the hole takes none)", left.Leftovers)
	}
}
