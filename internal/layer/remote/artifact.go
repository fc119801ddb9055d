package remote

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer"
)

// Artifact says what CopyArtifact copies: manifests of Type, tagged
// with Annotations (what the local store records of them). Check, if
// set, is asked before anything is copied whether the manifest and its
// config (read whole, at most 4 MiB) are one; Verify, after the blobs
// are in dst and before the tag is, whether they are (a disk's header,
// say).
type Artifact struct {
	Type        string
	Annotations map[string]string
	Check       func(man ocispec.Manifest, config []byte) error
	Verify      func(ctx context.Context, dst Target, man ocispec.Manifest) error
	// Leave, if set, names the layers a copy leaves in its source (to be
	// read lazily from there): the rest, the config and the manifest
	// are copied, and the tag made.
	Leave func(man ocispec.Manifest, l ocispec.Descriptor) bool
	// Top, if set, is the layer a copy's result names (Result.Digest);
	// else its last.
	Top func(man ocispec.Manifest) digest.Digest
}

// CopyArtifact copies the artifact tagged ref from src to dst: an OCI
// manifest of a's type (a VM image's, say), its config and its layers,
// blobs dst holds already skipped, each checked against its digest as
// it arrives (an interrupted copy resumes, as Copy's), then the tag,
// last. A tag in dst that names other content is replaced only with
// force; a manifest of another type, or one a's checks refuse, is not
// tagged.
func CopyArtifact(ctx context.Context, src, dst Target, ref layer.Ref, a Artifact, force bool, p Progress) (*Result, error) {
	artifactType := a.Type
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
	mdesc, man, _, err := describe(ctx, from, src, ref, a)
	if err != nil {
		return nil, err
	}
	if cur, err := to.Resolve(ctx); err == nil && cur.Digest != mdesc.Digest && !force {
		return nil, fmt.Errorf("tag %s in %s names other content (%s); pass --force to replace it: %w", ref, dst, cur.Digest, errdefs.ErrAlreadyExists)
	} else if err != nil && !errdefs.IsNotFound(err) {
		return nil, fmt.Errorf("%s: %w", dst, err)
	}
	top := man.Layers[len(man.Layers)-1].Digest
	if a.Top != nil {
		top = a.Top(man)
	}
	res := &Result{Ref: ref.String(), Digest: top, Manifest: mdesc.Digest, From: src.String(), To: dst.String()}
	var blobs []ocispec.Descriptor
	for _, l := range man.Layers {
		if a.Leave == nil || !a.Leave(man, l) {
			blobs = append(blobs, l)
		}
	}
	blobs = append(blobs, man.Config, mdesc)
	if err := copyBlobs(ctx, from, to, blobs, p, res); err != nil {
		return nil, fmt.Errorf("copy from %s to %s: %w", src, dst, err)
	}
	if a.Verify != nil {
		if err := a.Verify(ctx, dst, man); err != nil {
			return nil, fmt.Errorf("%s from %s: %w", ref, src, err)
		}
	}
	mdesc.ArtifactType = artifactType
	mdesc.Annotations = maps.Clone(a.Annotations)
	if err := to.Tag(ctx, mdesc, force); err != nil {
		return nil, fmt.Errorf("tag %s in %s: %w", ref, dst, err)
	}
	return res, nil
}

// DescribeArtifact reads the artifact tagged ref in t: its manifest's
// descriptor, the manifest, and its config (read whole, at most 4 MiB),
// each checked against its digest and by a's Check; no layer is read.
func DescribeArtifact(ctx context.Context, t Target, ref layer.Ref, a Artifact) (ocispec.Descriptor, ocispec.Manifest, []byte, error) {
	r, err := t.Repo(ctx, ref)
	if err != nil {
		return ocispec.Descriptor{}, ocispec.Manifest{}, nil, err
	}
	return describe(ctx, r, t, ref, a)
}

func describe(ctx context.Context, from Repo, src Target, ref layer.Ref, a Artifact) (mdesc ocispec.Descriptor, man ocispec.Manifest, config []byte, err error) {
	mdesc, err = from.Resolve(ctx)
	if errdefs.IsNotFound(err) {
		return mdesc, man, nil, fmt.Errorf("%s not found in %s: check its name and version there: %w", ref, src, errdefs.ErrNotFound)
	}
	if err != nil {
		return mdesc, man, nil, fmt.Errorf("%s in %s: %w", ref, src, err)
	}
	mdesc.MediaType = ocispec.MediaTypeImageManifest
	mb, err := fetchSmall(ctx, from, mdesc)
	if err != nil {
		return mdesc, man, nil, fmt.Errorf("%s in %s: %w", ref, src, err)
	}
	if err := json.Unmarshal(mb, &man); err != nil || man.ArtifactType != a.Type || len(man.Layers) == 0 {
		return mdesc, man, nil, fmt.Errorf("%s in %s is no %s: %w", ref, src, a.Type, errdefs.ErrInvalidArgument)
	}
	if config, err = fetchSmall(ctx, from, man.Config); err == nil && a.Check != nil {
		err = a.Check(man, config)
	}
	if err != nil {
		return mdesc, man, nil, fmt.Errorf("%s in %s: %w", ref, src, err)
	}
	return mdesc, man, config, nil
}
