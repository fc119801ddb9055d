package remote

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"

	"github.com/containerd/errdefs"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer"
)

// CopyArtifact copies the artifact tagged ref from src to dst: an OCI
// manifest of artifactType (a VM image's, say), its config and its
// layers, blobs dst holds already skipped, each checked against its
// digest as it arrives (an interrupted copy resumes, as Copy's), then
// the tag, last, with annotations (what the local store records of
// it). A tag in dst that names other content is replaced only with
// force; a manifest of another type is refused.
func CopyArtifact(ctx context.Context, src, dst Target, ref layer.Ref, artifactType string, annotations map[string]string, force bool, p Progress) (*Result, error) {
	if p == nil {
		p = noProgress{}
	}
	if d, ok := dst.(*Dir); ok { // gc waits until the blobs are tagged
		release, err := d.s.Writer()
		if err != nil {
			return nil, err
		}
		defer release()
	}
	from, to, err := repos(ctx, src, dst, ref)
	if err != nil {
		return nil, err
	}
	mdesc, err := from.Resolve(ctx)
	if errdefs.IsNotFound(err) {
		return nil, fmt.Errorf("%s not found in %s: check its name and version there: %w", ref, src, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("%s in %s: %w", ref, src, err)
	}
	mdesc.MediaType = ocispec.MediaTypeImageManifest
	mb, err := fetchSmall(ctx, from, mdesc)
	if err != nil {
		return nil, fmt.Errorf("%s in %s: %w", ref, src, err)
	}
	var man ocispec.Manifest
	if err := json.Unmarshal(mb, &man); err != nil || man.ArtifactType != artifactType || len(man.Layers) == 0 {
		return nil, fmt.Errorf("%s in %s is no %s: %w", ref, src, artifactType, errdefs.ErrInvalidArgument)
	}
	if cur, err := to.Resolve(ctx); err == nil && cur.Digest != mdesc.Digest && !force {
		return nil, fmt.Errorf("tag %s in %s names other content (%s); pass --force to replace it: %w", ref, dst, cur.Digest, errdefs.ErrAlreadyExists)
	} else if err != nil && !errdefs.IsNotFound(err) {
		return nil, fmt.Errorf("%s: %w", dst, err)
	}
	top := man.Layers[len(man.Layers)-1].Digest
	res := &Result{Ref: ref.String(), Digest: top, Manifest: mdesc.Digest, From: src.String(), To: dst.String()}
	blobs := append(append([]ocispec.Descriptor{}, man.Layers...), man.Config, mdesc)
	if err := copyBlobs(ctx, from, to, blobs, p, res); err != nil {
		return nil, fmt.Errorf("copy from %s to %s: %w", src, dst, err)
	}
	mdesc.ArtifactType = artifactType
	mdesc.Annotations = maps.Clone(annotations)
	if err := to.Tag(ctx, mdesc, force); err != nil {
		return nil, fmt.Errorf("tag %s in %s: %w", ref, dst, err)
	}
	return res, nil
}
