package layer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/store"
)

const maxManifest = 4 << 20

// ParseManifest parses a layer manifest and checks it is a dsec layer.
func ParseManifest(b []byte) (*ocispec.Manifest, error) {
	var man ocispec.Manifest
	if err := json.Unmarshal(b, &man); err != nil {
		return nil, fmt.Errorf("manifest: %v: %w", err, errdefs.ErrDataLoss)
	}
	if len(man.Layers) != 1 || man.Layers[0].MediaType != MediaTypeLayer || man.Config.MediaType != MediaTypeConfig {
		return nil, fmt.Errorf("manifest is not a dsec layer: %w", errdefs.ErrInvalidArgument)
	}
	return &man, nil
}

// Bounds on what a config may say, whoever served it.
const (
	MaxLayerSize   = 1 << 40 // bytes of one image
	minWindow      = erofs.BlockSize
	maxWindow      = 64 << 20
	maxLowers      = 4096 // layers under a snapshot
	maxLineageEnvs = 4096
)

// ParseConfig parses the config of a layer whose image is size bytes
// (its manifest says), as untrusted input: every region it names must
// lie inside the image, in whole blocks, and its window table must
// cover the image in windows of a sane power-of-two size, so that a
// corrupt or hostile config fails the layer's mount with one line and
// never crashes or wedges the host's fetcher (issue 29, item 9).
func ParseConfig(b []byte, size int64) (*Config, error) {
	var cfg Config
	if err := json.Unmarshal(b, &cfg); err != nil {
		return nil, fmt.Errorf("config: %v: %w", err, errdefs.ErrDataLoss)
	}
	bad := func(format string, a ...any) (*Config, error) {
		return nil, fmt.Errorf("config: "+format+": the layer is corrupt or was not written by dsec: %w", append(a, errdefs.ErrDataLoss)...)
	}
	if size < 2*erofs.BlockSize || size > MaxLayerSize || size%erofs.BlockSize != 0 {
		return bad("an image of %d bytes (want whole %d-byte blocks, at most %d bytes)", size, erofs.BlockSize, int64(MaxLayerSize))
	}
	if cfg.BlockSize != erofs.BlockSize {
		return bad("block size %d, want %d", cfg.BlockSize, erofs.BlockSize)
	}
	inImage := func(r erofs.Region) bool {
		return r.Offset >= 0 && r.Size >= 0 && r.Offset <= size && r.Size <= size-r.Offset
	}
	m := cfg.Metadata
	if !inImage(m) || m.Offset < erofs.BlockSize || m.Offset%erofs.BlockSize != 0 || m.Size == 0 {
		return bad("metadata region %+v is not inside the %d-byte image", m, size)
	}
	if d := cfg.Data; !inImage(d) || d.Size > 0 && (d.Offset < erofs.BlockSize || d.Offset+d.Size > m.Offset) {
		return bad("data region %+v is not between block 0 and the metadata", d)
	}
	w := cfg.Windows
	if w.Size < minWindow || w.Size > maxWindow || w.Size&(w.Size-1) != 0 {
		return bad("window size %d (want a power of two from %d to %d)", w.Size, minWindow, maxWindow)
	}
	if int64(w.Count) != (size+w.Size-1)/w.Size {
		return bad("%d windows of %d bytes for a %d-byte image", w.Count, w.Size, size)
	}
	if cfg.Windows.Digest.Validate() != nil {
		return nil, fmt.Errorf("config names no window table: %w", errdefs.ErrDataLoss)
	}
	if (cfg.Kind == KindSnapshot) != (cfg.Snapshot != nil) {
		return nil, fmt.Errorf("config of kind %q with lineage %v: only snapshots have one: %w", cfg.Kind, cfg.Snapshot != nil, errdefs.ErrDataLoss)
	}
	if h := cfg.Hot; h != nil && (h.Offset != erofs.BlockSize || h.Size < 0 || h.Size > cfg.Metadata.Offset-h.Offset) {
		return nil, fmt.Errorf("config: hot region %+v is not inside the data region: %w", *h, errdefs.ErrDataLoss)
	}
	if l := cfg.Snapshot; l != nil {
		if len(l.Lowers) == 0 {
			return nil, fmt.Errorf("snapshot config names no layers under it: %w", errdefs.ErrDataLoss)
		}
		if len(l.Lowers) > maxLowers || len(l.Env) > maxLineageEnvs {
			return bad("a lineage of %d layers and %d variables (at most %d and %d)", len(l.Lowers), len(l.Env), maxLowers, maxLineageEnvs)
		}
		for _, lo := range l.Lowers {
			if _, err := ParseRef(lo.Ref); err != nil || lo.Digest.Validate() != nil {
				return nil, fmt.Errorf("snapshot config: bad lower %q@%q: %w", lo.Ref, lo.Digest, errdefs.ErrDataLoss)
			}
		}
		if l.Memory != nil {
			if err := l.Memory.check(l); err != nil {
				return nil, err
			}
		}
	}
	return &cfg, nil
}

// TagAnnotations are the annotations of a layer's entry in a store index.
func TagAnnotations(kind Kind, layer digest.Digest) map[string]string {
	return map[string]string{AnnotationKind: string(kind), annotationLayer: layer.String()}
}

// load reads and verifies a tagged layer's manifest and config.
func load(s *store.Store, m ocispec.Descriptor) (*Info, error) {
	ref := m.Annotations[store.RefAnnotation]
	mb, err := s.ReadBlob(m.Digest, maxManifest)
	if err != nil {
		return nil, fmt.Errorf("layer %s: %w", ref, err)
	}
	man, err := ParseManifest(mb)
	if err != nil {
		return nil, fmt.Errorf("layer %s: %w", ref, err)
	}
	cb, err := s.ReadBlob(man.Config.Digest, maxManifest)
	if err != nil {
		return nil, fmt.Errorf("layer %s: %w", ref, err)
	}
	cfg, err := ParseConfig(cb, man.Layers[0].Size)
	if err != nil {
		return nil, fmt.Errorf("layer %s: %w", ref, err)
	}
	return info(ref, m, man.Layers[0], *cfg), nil
}

// List returns every tagged layer in tag order.
func List(ctx context.Context, s *store.Store) ([]*Info, error) {
	tags, err := s.Tags(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]*Info, 0, len(tags))
	for _, t := range tags {
		if k := t.Annotations[AnnotationKind]; k == string(KindImage) || k == string(KindVMImage) {
			continue
		}
		i, err := load(s, t)
		if err != nil {
			return nil, err
		}
		out = append(out, i)
	}
	return out, nil
}

// LoadTagged loads, with load, what every tag of kind in s names, in
// tag order: the records of images and VM images kept beside layers.
func LoadTagged[T any](ctx context.Context, s *store.Store, kind Kind, load func(*store.Store, ocispec.Descriptor) (T, error)) ([]T, error) {
	tags, err := s.Tags(ctx)
	if err != nil {
		return nil, err
	}
	var out []T
	for _, t := range tags {
		if t.Annotations[AnnotationKind] != string(kind) {
			continue
		}
		v, err := load(s, t)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}

// Resolve finds a layer by NAME[:VERSION] or by its digest (sha256:HEX,
// or a unique prefix of at least 12 hex digits).
func Resolve(ctx context.Context, s *store.Store, ref string) (*Info, error) {
	if IsDigest(ref) {
		return ResolveDigest(ctx, s, ref, nil)
	}
	r, err := ParseRef(ref)
	if err != nil {
		return nil, err
	}
	d, err := s.Resolve(ctx, r.String())
	if err != nil {
		return nil, fmt.Errorf("no layer %s in the store (dsec layer ls lists them): %w", r, errdefs.ErrNotFound)
	}
	switch d.Annotations[AnnotationKind] {
	case string(KindImage):
		return nil, fmt.Errorf("%s is an image, a stack of layers: name it as an image (dsec run --image, dsec image inspect): %w", r, errdefs.ErrInvalidArgument)
	case string(KindVMImage):
		return nil, fmt.Errorf("%s is a VM image, a bootable disk: dsec vm image inspect shows it: %w", r, errdefs.ErrInvalidArgument)
	}
	return load(s, d)
}

// IsDigest says whether ref names a layer by its digest (sha256:HEX,
// or 12 to 64 hex digits), as Resolve reads it, rather than by a tag.
func IsDigest(ref string) bool {
	_, ok := strings.CutPrefix(ref, "sha256:")
	return ok || isHexPrefix(ref)
}

func isHexPrefix(s string) bool {
	if len(s) < 12 || len(s) > 64 {
		return false
	}
	for _, c := range s {
		if !strings.ContainsRune("0123456789abcdef", c) {
			return false
		}
	}
	return true
}

// ResolveDigest finds the one tagged layer, among those keep keeps
// (nil: all), whose digest ref names (sha256:HEX, or a unique prefix of
// at least 12 hex digits).
func ResolveDigest(ctx context.Context, s *store.Store, ref string, keep func(*Info) bool) (*Info, error) {
	hexd := strings.TrimPrefix(ref, "sha256:")
	if len(hexd) < 12 || !isHexPrefix(hexd) {
		return nil, fmt.Errorf("bad digest %q: give sha256: and at least 12 hex digits: %w", ref, errdefs.ErrInvalidArgument)
	}
	all, err := List(ctx, s)
	if err != nil {
		return nil, err
	}
	var found *Info
	for _, i := range all {
		if strings.HasPrefix(i.Digest.Encoded(), hexd) && (keep == nil || keep(i)) {
			if found != nil && found.Digest != i.Digest {
				return nil, fmt.Errorf("digest prefix %s is ambiguous: give more digits: %w", ref, errdefs.ErrInvalidArgument)
			}
			if found == nil {
				found = i
			}
		}
	}
	if found == nil {
		return nil, fmt.Errorf("no tagged layer has digest %s: %w", ref, errdefs.ErrNotFound)
	}
	return found, nil
}

// ResolveImage finds the layer ref names if its image is image, else
// the layer whose image is image, tagged or not (a snapshot's or a
// sandbox's lower whose tag was removed or moved: GC keeps it for
// them). Its Ref is ref either way.
func ResolveImage(ctx context.Context, s *store.Store, ref string, image digest.Digest) (*Info, error) {
	i, err := Resolve(ctx, s, ref)
	if err == nil && i.Digest == image || image == "" || err != nil && !errdefs.IsNotFound(err) {
		return i, err
	}
	blobs, err := s.SmallBlobs(64 << 10)
	if err != nil {
		return nil, err
	}
	for _, d := range blobs {
		b, err := s.ReadBlob(d.Digest, 64<<10)
		if err != nil {
			continue
		}
		if man, err := ParseManifest(b); err == nil && man.Layers[0].Digest == image {
			d.MediaType = ocispec.MediaTypeImageManifest
			d.Annotations = map[string]string{store.RefAnnotation: ref}
			return load(s, d)
		}
	}
	if i != nil {
		return nil, fmt.Errorf("layer %s is now %s, and the %s stood on is gone from the store (gc freed it): %w", ref, i.Digest, image, errdefs.ErrNotFound)
	}
	return nil, fmt.Errorf("no layer %s (%s) in the store: %w", ref, image, errdefs.ErrNotFound)
}

// resolveTag resolves a NAME[:VERSION] tag (no digest).
func resolveTag(ctx context.Context, s *store.Store, ref string) (Ref, *Info, error) {
	r, err := ParseRef(ref)
	if err != nil {
		return r, nil, err
	}
	i, err := Resolve(ctx, s, r.String())
	return r, i, err
}

// Remove untags a layer by NAME[:VERSION]. Its blobs go at the next GC.
func Remove(ctx context.Context, s *store.Store, ref string) (*Info, error) {
	r, i, err := resolveTag(ctx, s, ref)
	if err != nil {
		return nil, err
	}
	if _, err := s.Untag(ctx, r.String()); err != nil {
		return nil, err
	}
	return i, nil
}

// StoodOn names what stands on the layer tagged ref: the snapshots whose
// lineage holds its image, and those of users (what a user is, "sandbox
// NAME" or "image REF" -> the layer digests it stands on) that stand on
// it; nothing when another tag names the same image, which then keeps
// it.
func StoodOn(ctx context.Context, s *store.Store, ref string, users map[string][]string) ([]string, error) {
	_, i, err := resolveTag(ctx, s, ref)
	if err != nil {
		return nil, err
	}
	all, err := List(ctx, s)
	if err != nil {
		return nil, err
	}
	var on []string
	for _, o := range all {
		if o.Ref == i.Ref {
			continue
		}
		if o.Digest == i.Digest {
			return nil, nil // another tag keeps the image
		}
		if o.Snapshot != nil && slices.ContainsFunc(o.Snapshot.Lowers, func(l Lower) bool { return l.Digest == i.Digest }) {
			on = append(on, "snapshot "+o.Ref)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(users)) {
		if slices.Contains(users[name], i.Digest.String()) {
			on = append(on, name)
		}
	}
	return on, nil
}

// GC removes the blobs nothing needs and leftovers of killed builds. It
// keeps what every tag reaches, the layers every kept snapshot stands
// on (its lineage), the images keep returns, asked once the store is
// held (the layers sandboxes run on, read from their states: a state a
// writer saves before it lets go of the store is seen), and of the
// store's live leases (creates under way), and the
// manifest, config and window table of every kept image: a layer whose
// tag was removed with --force still resolves by its digest
// (ResolveImage) for what stands on it.
func GC(ctx context.Context, s *store.Store, keep func() ([]digest.Digest, error)) (store.GCResult, error) {
	roots := func() ([]ocispec.Descriptor, error) {
		if keep == nil {
			return nil, nil
		}
		ds, err := keep()
		out := make([]ocispec.Descriptor, len(ds))
		for i, d := range ds {
			out[i] = ocispec.Descriptor{MediaType: MediaTypeLayer, Digest: d}
		}
		return out, err
	}
	return s.GC(ctx, store.Marks{Refs: refs, LiveRoots: roots, Owner: manifestOwner, LeasedAs: MediaTypeLayer})
}

// manifestOwner: a layer's manifest is kept while its image is.
func manifestOwner(b []byte) (digest.Digest, string, bool) {
	man, err := ParseManifest(b)
	if err != nil {
		return "", "", false
	}
	return man.Layers[0].Digest, ocispec.MediaTypeImageManifest, true
}

// Blobs is every blob the manifest d reaches as gc marks them (its
// config, its EROFS images and window tables, the manifests of an image's
// layers, a snapshot's memory), but not a snapshot's lowers: layers of
// their own. A blob gone meanwhile is left out.
func Blobs(s *store.Store, d digest.Digest) (map[digest.Digest]bool, error) {
	out := map[digest.Digest]bool{}
	queue := []ocispec.Descriptor{{MediaType: ocispec.MediaTypeImageManifest, Digest: d}}
	for len(queue) > 0 {
		x := queue[0]
		queue = queue[1:]
		if out[x.Digest] {
			continue
		}
		out[x.Digest] = true
		if x.MediaType != ocispec.MediaTypeImageManifest && x.MediaType != MediaTypeConfig {
			continue
		}
		b, err := s.ReadBlob(x.Digest, 4<<20)
		if errors.Is(err, errdefs.ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		more, err := refs(x, b)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", x.Digest, err)
		}
		for _, m := range more {
			if x.MediaType != MediaTypeConfig || m.MediaType != MediaTypeLayer { // a config's layers are a snapshot's lowers
				queue = append(queue, m)
			}
		}
	}
	return out, nil
}

// refs lists what a manifest or layer config points at.
func refs(d ocispec.Descriptor, b []byte) ([]ocispec.Descriptor, error) {
	switch d.MediaType {
	case ocispec.MediaTypeImageManifest:
		var m ocispec.Manifest
		if err := json.Unmarshal(b, &m); err != nil {
			return nil, err
		}
		return append([]ocispec.Descriptor{m.Config}, m.Layers...), nil
	case MediaTypeConfig:
		var c Config
		if err := json.Unmarshal(b, &c); err != nil {
			return nil, err
		}
		var out []ocispec.Descriptor
		if c.Windows.Digest != "" {
			out = append(out, ocispec.Descriptor{MediaType: MediaTypeWindows, Digest: c.Windows.Digest})
		}
		if c.Snapshot != nil {
			for _, l := range c.Snapshot.Lowers {
				out = append(out, ocispec.Descriptor{MediaType: MediaTypeLayer, Digest: l.Digest})
			}
			if m := c.Snapshot.Memory; m != nil {
				out = append(out, m.Blobs()...)
			}
		}
		return out, nil
	}
	return nil, nil
}
