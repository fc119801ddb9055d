package layer

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash"
	"io"
	"runtime"
	"strings"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer/erofs"
)

const maxJSON = 4 << 20 // manifests, indexes and configs larger than this are rejected

type member struct{ off, size int64 }

// indexTar lists the regular files of an uncompressed tar held in ra.
// It reads only headers, seeking over the data.
func indexTar(ra io.ReaderAt, size int64) (map[string]member, error) {
	sr := io.NewSectionReader(ra, 0, size)
	tr := tar.NewReader(sr)
	out := map[string]member{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%w: read tar: %v (truncated or corrupt archive?)", ErrBadSource, err)
		}
		if h.Typeflag != tar.TypeReg && h.Typeflag != tar.TypeRegA {
			continue
		}
		off, _ := sr.Seek(0, io.SeekCurrent)
		name, err := cleanName(h.Name)
		if err != nil {
			return nil, err
		}
		out[name] = member{off: off, size: h.Size}
	}
}

// isImageArchive reports whether the members look like `docker save`
// output or an OCI image layout.
func isImageArchive(m map[string]member) bool {
	_, docker := m["manifest.json"]
	_, layout := m["oci-layout"]
	_, index := m["index.json"]
	return docker || (layout && index)
}

type imageArchive struct {
	ra      io.ReaderAt
	members map[string]member
}

func (a *imageArchive) open(name string) (*io.SectionReader, error) {
	m, ok := a.members[name]
	if !ok {
		return nil, fmt.Errorf("%w: image archive has no %s", ErrBadSource, name)
	}
	return io.NewSectionReader(a.ra, m.off, m.size), nil
}

func (a *imageArchive) readJSON(name string, v any) error {
	r, err := a.open(name)
	if err != nil {
		return err
	}
	if r.Size() > maxJSON {
		return fmt.Errorf("%w: %s is %d bytes, more than a manifest may be", ErrBadSource, name, r.Size())
	}
	b, err := io.ReadAll(r)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%w: parse %s: %v", ErrBadSource, name, err)
	}
	return nil
}

// archiveLayer is one layer blob and the digest its bytes must have
// (compressed for OCI layouts, uncompressed diff ID for docker archives).
type archiveLayer struct {
	name       string
	digest     string
	compressed bool // digest covers the stored bytes, not the tar
}

func blobPath(d string) (string, error) {
	alg, hexd, ok := strings.Cut(d, ":")
	if !ok || alg != "sha256" || len(hexd) != 64 {
		return "", fmt.Errorf("%w: unsupported digest %q", ErrBadSource, d)
	}
	if _, err := hex.DecodeString(hexd); err != nil {
		return "", fmt.Errorf("%w: bad digest %q", ErrBadSource, d)
	}
	return "blobs/sha256/" + hexd, nil
}

// layers returns the archive's layers, bottom first.
func (a *imageArchive) layers() ([]archiveLayer, error) {
	if _, ok := a.members["index.json"]; ok {
		if _, ok := a.members["oci-layout"]; ok {
			return a.ociLayers()
		}
	}
	var manifest []struct {
		Config   string
		RepoTags []string
		Layers   []string
	}
	if err := a.readJSON("manifest.json", &manifest); err != nil {
		return nil, err
	}
	if len(manifest) != 1 {
		return nil, fmt.Errorf("%w: archive holds %d images; save exactly one image per archive", ErrBadSource, len(manifest))
	}
	var cfg struct {
		RootFS struct {
			DiffIDs []string `json:"diff_ids"`
		} `json:"rootfs"`
	}
	if err := a.readJSON(strings.TrimPrefix(manifest[0].Config, "./"), &cfg); err != nil {
		return nil, err
	}
	if len(cfg.RootFS.DiffIDs) != len(manifest[0].Layers) {
		return nil, fmt.Errorf("%w: image config lists %d diff IDs for %d layers", ErrBadSource, len(cfg.RootFS.DiffIDs), len(manifest[0].Layers))
	}
	out := make([]archiveLayer, len(manifest[0].Layers))
	for i, l := range manifest[0].Layers {
		name, err := cleanName(l)
		if err != nil {
			return nil, err
		}
		out[i] = archiveLayer{name: name, digest: cfg.RootFS.DiffIDs[i]}
	}
	return out, nil
}

func (a *imageArchive) ociLayers() ([]archiveLayer, error) {
	var idx ocispec.Index
	if err := a.readJSON("index.json", &idx); err != nil {
		return nil, err
	}
	for depth := 0; ; depth++ {
		if depth > 4 {
			return nil, fmt.Errorf("%w: image indexes nest too deep", ErrBadSource)
		}
		desc, err := pickManifest(idx.Manifests)
		if err != nil {
			return nil, err
		}
		name, err := blobPath(string(desc.Digest))
		if err != nil {
			return nil, err
		}
		switch desc.MediaType {
		case ocispec.MediaTypeImageIndex, "application/vnd.docker.distribution.manifest.list.v2+json":
			idx = ocispec.Index{}
			if err := a.readJSON(name, &idx); err != nil {
				return nil, err
			}
			continue
		}
		var m ocispec.Manifest
		if err := a.readJSON(name, &m); err != nil {
			return nil, err
		}
		out := make([]archiveLayer, len(m.Layers))
		for i, l := range m.Layers {
			p, err := blobPath(string(l.Digest))
			if err != nil {
				return nil, err
			}
			out[i] = archiveLayer{name: p, digest: string(l.Digest), compressed: true}
		}
		return out, nil
	}
}

func pickManifest(ds []ocispec.Descriptor) (ocispec.Descriptor, error) {
	if len(ds) == 1 {
		return ds[0], nil
	}
	var match []ocispec.Descriptor
	for _, d := range ds {
		if d.Platform != nil && d.Platform.OS == "linux" && d.Platform.Architecture == runtime.GOARCH {
			match = append(match, d)
		}
	}
	if len(match) != 1 {
		return ocispec.Descriptor{}, fmt.Errorf("%w: index lists %d manifests and %d for linux/%s; save one platform", ErrBadSource, len(ds), len(match), runtime.GOARCH)
	}
	return match[0], nil
}

// hashReader checks the sha256 of everything read through it.
type hashReader struct {
	r io.Reader
	h hash.Hash
}

func (h *hashReader) Read(p []byte) (int, error) {
	n, err := h.r.Read(p)
	h.h.Write(p[:n])
	return n, err
}

func (h *hashReader) check(r io.Reader, want, name string) error {
	if _, err := io.Copy(io.Discard, r); err != nil {
		return fmt.Errorf("%w: read %s: %v", ErrBadSource, name, err)
	}
	if got := "sha256:" + hex.EncodeToString(h.h.Sum(nil)); got != want {
		return fmt.Errorf("%w: layer %s has digest %s, the manifest says %s (corrupt archive)", ErrBadSource, name, got, want)
	}
	return nil
}

// openLayer returns the plain tar stream of a layer and a function that
// drains it and verifies its digest.
func (a *imageArchive) openLayer(l archiveLayer) (io.Reader, func() error, func(), error) {
	sr, err := a.open(l.name)
	if err != nil {
		return nil, nil, nil, err
	}
	var src io.Reader = sr
	outer := &hashReader{r: sr, h: sha256.New()}
	if l.compressed {
		src = outer
	}
	plain, done, err := decompress(src)
	if err != nil {
		return nil, nil, nil, err
	}
	inner := &hashReader{r: plain, h: sha256.New()}
	verify := func() error {
		if l.compressed {
			if _, err := io.Copy(io.Discard, inner); err != nil {
				return fmt.Errorf("%w: read %s: %v", ErrBadSource, l.name, err)
			}
			return outer.check(src, l.digest, l.name)
		}
		return inner.check(inner, l.digest, l.name)
	}
	return inner, verify, done, nil
}

// addImageArchive flattens an image archive: layers are read from the
// top down, so a file that an upper layer replaces or deletes is never
// copied into the image.
func addImageArchive(ctx context.Context, w *erofs.Writer, ar *imageArchive, p Progress) error {
	layers, err := ar.layers()
	if err != nil {
		return err
	}
	if err := w.Mkdir("", erofs.Attr{Mode: 0o755}); err != nil {
		return err
	}
	t := newTarAdder(w, p)
	t.flatten = true
	for i := len(layers) - 1; i >= 0; i-- {
		t.layer = i
		t.pending = map[string][]string{}
		r, verify, done, err := ar.openLayer(layers[i])
		if err != nil {
			return err
		}
		err = t.addLayer(ctx, r, func() error { return ar.relink(t, layers[i]) })
		if err == nil {
			err = verify()
		}
		done()
		if err != nil {
			return err
		}
	}
	return nil
}

func (t *tarAdder) addLayer(ctx context.Context, r io.Reader, relink func() error) error {
	tr := tar.NewReader(r)
	for n := 0; ; n++ {
		if n%256 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return fmt.Errorf("%w: read tar: %v (truncated or corrupt archive?)", ErrBadSource, err)
		}
		if err := t.add(h, tr); err != nil {
			return err
		}
	}
	if len(t.pending) > 0 && relink != nil {
		if err := relink(); err != nil {
			return err
		}
	}
	return t.finishLayer()
}

// relink reads a layer a second time for the targets of hard links whose
// original path an upper layer replaced: the first link becomes a copy
// of the target and the others link to it.
func (a *imageArchive) relink(t *tarAdder, l archiveLayer) error {
	r, _, done, err := a.openLayer(l)
	if err != nil {
		return err
	}
	defer done()
	tr := tar.NewReader(r)
	for len(t.pending) > 0 {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return fmt.Errorf("%w: read tar: %v", ErrBadSource, err)
		}
		name, err := cleanName(h.Name)
		if err != nil {
			return err
		}
		links, ok := t.pending[name]
		if !ok || (h.Typeflag != tar.TypeReg && h.Typeflag != tar.TypeRegA) {
			continue
		}
		delete(t.pending, name)
		attr, err := entryAttr(h)
		if err != nil {
			return err
		}
		if err := t.w.Create(links[0], attr, h.Size, tr); err != nil {
			return err
		}
		for _, l := range links[1:] {
			if err := t.w.Link(l, links[0]); err != nil {
				return err
			}
		}
	}
	for target := range t.pending {
		return fmt.Errorf("%w: hard link to %q, which is not a regular file of the same layer", ErrBadSource, target)
	}
	return nil
}
