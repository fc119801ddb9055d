package image

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// Usage is what a store holds, by what holds it: each image, and each
// tagged layer that is no image's.
type Usage struct {
	Entries []UsageEntry `json:"entries"`
	// Logical is every entry's bytes, each counted whole: a layer two
	// images share counts in both.
	Logical int64 `json:"logical_bytes"`
	// Stored is the bytes of the blobs the tags reach, each once.
	Stored int64 `json:"stored_bytes"`
	// Untagged is the bytes of the store's other blobs: layers sandboxes
	// and snapshots stand on after their tags went, and what dsec layer
	// gc frees.
	Untagged int64 `json:"untagged_bytes"`
	// Packed is what the layers the store keeps packed into shared
	// chunks hold and take (dsec layer dedup); Stored counts what they
	// take.
	Packed store.PackedStats `json:"packed"`
	// Leftovers is the bytes interrupted builds and pulls left in the
	// store's ingest area (what dsec layer gc removes, but for a pull
	// that holds its own now).
	Leftovers int64 `json:"leftover_bytes"`
}

// UsageEntry is one image, or one layer that is no image's.
type UsageEntry struct {
	Name   string `json:"name"`
	Kind   string `json:"kind"` // image, vm-image, or the layer's kind
	Layers int    `json:"layers"`
	// Logical is the bytes of its blobs (layer.Blobs: its layers'
	// images, window tables, configs and manifests, its record, a
	// snapshot's memory), each once.
	Logical int64 `json:"logical_bytes"`
	// Own is the bytes of those no other entry holds: what its removal
	// and a gc free, unless a sandbox or snapshot stands on them (of a
	// packed layer, its head: its chunks may be others' too).
	Own int64 `json:"own_bytes"`
}

// Du measures s's usage. Blobs count what their files take on disk
// (a VM image's sparse disk, what its partitions hold).
func Du(ctx context.Context, s *store.Store) (*Usage, error) {
	entries, sets, err := holdings(ctx, s)
	if err != nil {
		return nil, err
	}
	u := Usage{Entries: entries}
	holders := map[digest.Digest]int{}
	for _, set := range sets {
		for d := range set {
			holders[d]++
		}
	}
	size := map[digest.Digest]int64{}  // logical
	taken := map[digest.Digest]int64{} // on disk: a packed layer's head
	dir := filepath.Join(s.Dir(), "blobs", "sha256")
	ents, err := os.ReadDir(dir)
	if err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	for _, e := range ents {
		fi, err := e.Info()
		d := digest.NewDigestFromEncoded(digest.SHA256, e.Name())
		if err != nil || !fi.Mode().IsRegular() || d.Validate() != nil {
			continue // gone meanwhile, or no blob
		}
		size[d] = store.Allocated(fi)
		stored := size[d]
		taken[d] = stored
		if s.Packed(d) {
			// Its head: the layer's metadata. Its data is in the chunk
			// blobs, counted below; its logical size is its image's.
			size[d] = fi.Size()
		}
		if holders[d] == 0 {
			u.Untagged += stored
		} else {
			u.Stored += stored
		}
	}
	if u.Packed, err = s.PackStats(); err != nil {
		return nil, err
	}
	u.Stored += u.Packed.Stored + u.Packed.Whole
	ingests, _ := os.ReadDir(filepath.Join(s.Dir(), "ingest"))
	for _, e := range ingests {
		if fi, err := e.Info(); err == nil && fi.Mode().IsRegular() {
			u.Leftovers += store.Allocated(fi)
		}
	}
	for i, set := range sets {
		for d := range set {
			u.Entries[i].Logical += size[d]
			if holders[d] == 1 {
				u.Entries[i].Own += taken[d]
			}
		}
		u.Logical += u.Entries[i].Logical
	}
	return &u, nil
}

// holdings lists what holds blobs in s: images, the layers no image
// holds, and VM images; each with the set of blobs it holds.
func holdings(ctx context.Context, s *store.Store) ([]UsageEntry, []map[digest.Digest]bool, error) {
	imgs, err := List(ctx, s)
	if err != nil {
		return nil, nil, err
	}
	layers, err := layer.List(ctx, s)
	if err != nil {
		return nil, nil, err
	}
	var (
		entries []UsageEntry
		sets    []map[digest.Digest]bool
		inImgs  = map[string]bool{}
	)
	for _, img := range imgs {
		set, err := layer.Blobs(s, img.ID)
		if err != nil {
			return nil, nil, fmt.Errorf("image %s: %w", img.Reference, err)
		}
		for _, l := range img.Layers {
			inImgs[l.Ref] = true
		}
		entries = append(entries, UsageEntry{Name: img.Reference, Kind: string(layer.KindImage), Layers: len(img.Layers)})
		sets = append(sets, set)
	}
	for _, l := range layers {
		if inImgs[l.Ref] {
			continue
		}
		set, err := layer.Blobs(s, l.Manifest)
		if err != nil {
			return nil, nil, fmt.Errorf("layer %s: %w", l.Ref, err)
		}
		entries = append(entries, UsageEntry{Name: l.Ref, Kind: string(l.Kind), Layers: 1})
		sets = append(sets, set)
	}
	tags, err := s.Tags(ctx) // the other records tagged beside them: VM images
	if err != nil {
		return nil, nil, err
	}
	for _, t := range tags {
		if t.Annotations[layer.AnnotationKind] != string(layer.KindVMImage) {
			continue
		}
		set, err := layer.Blobs(s, t.Digest)
		if err != nil {
			return nil, nil, fmt.Errorf("VM image %s: %w", t.Annotations[store.RefAnnotation], err)
		}
		entries = append(entries, UsageEntry{Name: t.Annotations[store.RefAnnotation], Kind: string(layer.KindVMImage)})
		sets = append(sets, set)
	}
	return entries, sets, nil
}
