package image

import (
	"context"
	"encoding/json"
	"fmt"
	"io"

	"github.com/containerd/errdefs"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// Push copies the image ref from s to dst: its layers (as dsec layer
// push copies a layer: what dst lacks, tag last), then its record, under
// the image's store tag. Hosts whose worker has dst as its remote then
// make sandboxes on the image without its registry, mounting its layers
// lazily from dst.
func Push(ctx context.Context, s *store.Store, dst remote.Target, ref Reference, force bool, p remote.Progress) (*Image, []*remote.Result, error) {
	img, err := Lookup(ctx, s, ref)
	if err != nil {
		return nil, nil, err
	}
	src := remote.Local(s)
	var out []*remote.Result
	for _, l := range img.Layers { // bottom up: a record never names what dst lacks
		r, err := layer.ParseRef(l.Ref)
		if err != nil {
			return nil, nil, err
		}
		res, err := remote.Copy(ctx, src, dst, r, false, p)
		if err != nil {
			return nil, nil, fmt.Errorf("image %s: %w", ref, err)
		}
		out = append(out, res)
	}
	tag, _ := ref.StoreTag()
	d, err := s.Resolve(ctx, img.Tag)
	if err != nil {
		return nil, nil, err
	}
	mb, err := s.ReadBlob(d.Digest, maxJSON)
	if err != nil {
		return nil, nil, err
	}
	var man ocispec.Manifest
	if err := json.Unmarshal(mb, &man); err != nil {
		return nil, nil, fmt.Errorf("image %s: %w", ref, err)
	}
	d.MediaType, d.Annotations = ocispec.MediaTypeImageManifest, map[string]string{layer.AnnotationKind: string(layer.KindImage)}
	blobs := []ocispec.Descriptor{man.Config, d}
	if _, registry := dst.(*remote.OCI); registry {
		if blobs, err = forRegistry(s, man, d); err != nil {
			return nil, nil, fmt.Errorf("image %s: %w", ref, err)
		}
		d = blobs[len(blobs)-1]
	}
	res, err := remote.CopyBlobs(ctx, src, dst, tag, blobs, p)
	if err != nil {
		return nil, nil, err
	}
	to, err := dst.Repo(ctx, tag)
	if err != nil {
		return nil, nil, err
	}
	if err := to.Tag(ctx, d, force); err != nil {
		return nil, nil, fmt.Errorf("tag %s in %s: %w", tag, dst, err)
	}
	return img, append(out, res), nil
}

// forRegistry is the record's manifest as a registry takes it, and the
// blobs to copy for it, the manifest last. A registry takes a manifest
// only if every blob it names is in its repository, and the manifests of
// an image's layers are in repositories of their own (REPO/NAME, as
// dsec layer push puts them): this one names none of them (the record
// does, and they are tagged beside it) and has the empty blob as its
// one layer, as OCI 1.1 has artifacts do.
func forRegistry(s *store.Store, man ocispec.Manifest, d ocispec.Descriptor) ([]ocispec.Descriptor, error) {
	empty, err := s.WriteBlob(ocispec.MediaTypeEmptyJSON, ocispec.DescriptorEmptyJSON.Data)
	if err != nil {
		return nil, err
	}
	man.Layers = []ocispec.Descriptor{ocispec.DescriptorEmptyJSON}
	mb, err := json.Marshal(man)
	if err != nil {
		return nil, err
	}
	nd, err := s.WriteBlob(ocispec.MediaTypeImageManifest, mb)
	if err != nil {
		return nil, err
	}
	nd.Annotations = d.Annotations
	return []ocispec.Descriptor{man.Config, empty, nd}, nil
}

// Fetch copies the record of the image ref from src, a shared remote,
// into s, without its layers: a sandbox mounts them lazily from src.
func Fetch(ctx context.Context, src remote.Target, s *store.Store, ref Reference) (*Image, error) {
	tag, err := ref.StoreTag()
	if err != nil {
		return nil, err
	}
	from, err := src.Repo(ctx, tag)
	if err != nil {
		return nil, err
	}
	d, err := from.Resolve(ctx)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return nil, fmt.Errorf("no image %s in %s: %w", ref, src, errdefs.ErrNotFound)
		}
		return nil, err
	}
	if d.Size > maxJSON {
		return nil, fmt.Errorf("image %s in %s: a manifest of %d bytes: %w", ref, src, d.Size, errdefs.ErrDataLoss)
	}
	rc, err := from.Fetch(ctx, d)
	if err != nil {
		return nil, err
	}
	mb, err := io.ReadAll(io.LimitReader(rc, maxJSON+1))
	rc.Close()
	if err != nil {
		return nil, err
	}
	var man ocispec.Manifest
	if json.Unmarshal(mb, &man) != nil || man.Config.MediaType != MediaTypeRecord {
		return nil, fmt.Errorf("%s in %s is not an image dsec pushed: %w", tag, src, errdefs.ErrNotFound)
	}
	if have, err := s.Resolve(ctx, tag.String()); err == nil && have.Annotations[layer.AnnotationKind] != string(layer.KindImage) {
		return nil, fmt.Errorf("%s: the store's tag %s names a layer, not an image: %w", ref, tag, errdefs.ErrAlreadyExists)
	}
	release, err := s.Writer()
	if err != nil {
		return nil, err
	}
	defer release()
	d.MediaType = ocispec.MediaTypeImageManifest
	// CopyBlobs checks each blob against its digest as it lands. A record
	// pushed to a registry names the empty blob as its layer.
	blobs := []ocispec.Descriptor{man.Config}
	for _, l := range man.Layers {
		if l.MediaType == ocispec.MediaTypeEmptyJSON && l.Digest == ocispec.DescriptorEmptyJSON.Digest {
			blobs = append(blobs, l)
		}
	}
	if _, err := remote.CopyBlobs(ctx, src, remote.Local(s), tag, append(blobs, d), nil); err != nil {
		return nil, err
	}
	d.ArtifactType = ArtifactType
	d.Annotations = map[string]string{layer.AnnotationKind: string(layer.KindImage)}
	if err := s.Tag(ctx, tag.String(), d, true); err != nil {
		return nil, err
	}
	d.Annotations[store.RefAnnotation] = tag.String()
	return load(s, d)
}
