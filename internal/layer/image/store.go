package image

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/containerd/errdefs"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// Lookup finds the image ref names in s, imported before.
func Lookup(ctx context.Context, s *store.Store, ref Reference) (*Image, error) {
	tag, err := ref.StoreTag()
	if err != nil {
		return nil, err
	}
	d, err := s.Resolve(ctx, tag.String())
	if err != nil || d.Annotations[layer.AnnotationKind] != string(layer.KindImage) {
		if img := byManifest(ctx, s, ref); img != nil {
			return img, nil
		}
		return nil, fmt.Errorf("no image %s in the store: import it with dsec image pull %s: %w", ref, ref, errdefs.ErrNotFound)
	}
	return load(s, d)
}

// byManifest is the image of ref's repository, pulled under a tag, whose
// manifest ref's digest names (REPO@sha256:... of REPO:TAG), if any.
func byManifest(ctx context.Context, s *store.Store, ref Reference) *Image {
	if ref.Digest == "" {
		return nil
	}
	all, _ := List(ctx, s)
	for _, img := range all {
		if r, err := ParseReference(img.Reference); err == nil && img.Manifest == ref.Digest &&
			r.Registry == ref.Registry && r.Repository == ref.Repository {
			return img
		}
	}
	return nil
}

// LookupID finds the image whose ID (its record's manifest in the store,
// as dsec image ls and --json show it) id names: sha256:HEX, or a unique
// prefix of at least 12 hex digits.
func LookupID(ctx context.Context, s *store.Store, id string) (*Image, error) {
	hexd := strings.TrimPrefix(id, "sha256:")
	all, err := List(ctx, s)
	if err != nil {
		return nil, err
	}
	var found []*Image
	for _, img := range all {
		if strings.HasPrefix(img.ID.Encoded(), hexd) {
			found = append(found, img)
		}
	}
	switch {
	case len(found) == 1:
		return found[0], nil
	case len(found) > 1:
		return nil, fmt.Errorf("%s names %d images: give more of the digest: %w", id, len(found), errdefs.ErrInvalidArgument)
	}
	return nil, fmt.Errorf("no image with ID %s in the store (dsec image ls lists them): %w", id, errdefs.ErrNotFound)
}

// load reads an image's record from its tagged manifest.
func load(s *store.Store, d ocispec.Descriptor) (*Image, error) {
	tag := d.Annotations[store.RefAnnotation]
	mb, err := s.ReadBlob(d.Digest, maxJSON)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", tag, err)
	}
	var man ocispec.Manifest
	if err := json.Unmarshal(mb, &man); err != nil || man.Config.MediaType != MediaTypeRecord {
		return nil, fmt.Errorf("image %s: its manifest %s is no image record: %w", tag, d.Digest, errdefs.ErrDataLoss)
	}
	rb, err := s.ReadBlob(man.Config.Digest, maxJSON)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", tag, err)
	}
	img := &Image{Tag: tag, ID: d.Digest}
	if err := json.Unmarshal(rb, &img.Record); err != nil || len(img.Layers) == 0 {
		return nil, fmt.Errorf("image %s: its record %s does not parse: %w", tag, man.Config.Digest, errdefs.ErrDataLoss)
	}
	return img, nil
}

// List returns the images in s, in tag order.
func List(ctx context.Context, s *store.Store) ([]*Image, error) {
	return layer.LoadTagged(ctx, s, layer.KindImage, load)
}

// Remove untags the image ref, and those of its layers no other image
// has; their blobs go at the next gc, unless a sandbox or a snapshot
// stands on them.
func Remove(ctx context.Context, s *store.Store, ref Reference) (*Image, error) {
	img, err := Lookup(ctx, s, ref)
	if err != nil {
		return nil, err
	}
	if _, err := s.Untag(ctx, img.Tag); err != nil {
		return nil, err
	}
	return img, untagUnshared(ctx, s, img)
}

// untagUnshared untags the layers of img, no longer tagged, that no
// image in s has.
func untagUnshared(ctx context.Context, s *store.Store, img *Image) error {
	rest, err := List(ctx, s)
	if err != nil {
		return err
	}
	shared := map[string]bool{}
	for _, o := range rest {
		for _, l := range o.Layers {
			shared[l.Ref] = true
		}
	}
	for _, l := range img.Layers {
		if !shared[l.Ref] {
			if _, err := s.Untag(ctx, l.Ref); err != nil && !errdefs.IsNotFound(err) {
				return err
			}
		}
	}
	return nil
}
