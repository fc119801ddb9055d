package remote

import (
	"context"
	"fmt"
	"io"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// Dir is a store on a local or shared POSIX path: the local store itself,
// or a dir: remote.
type Dir struct {
	s     *store.Store
	name  string
	emu   Emulation
	local bool // the root's own store (Local)
}

func openDir(path string) (*Dir, error) {
	s, err := store.Open(path)
	if err != nil {
		return nil, err
	}
	return &Dir{s: s, name: "dir://" + path, emu: EmulationFromEnv()}, nil
}

// Local wraps the local store as a Target.
func Local(s *store.Store) *Dir { return &Dir{s: s, name: "local store", local: true} }

func (d *Dir) String() string { return d.name }

// Store is the store d holds its layers in.
func (d *Dir) Store() *store.Store { return d.s }

// Repo returns the store: every layer name shares it.
func (d *Dir) Repo(ctx context.Context, ref layer.Ref) (Repo, error) {
	return dirRepo{d.s, ref, d.emu, d.local}, nil
}

type dirRepo struct {
	s     *store.Store
	ref   layer.Ref
	emu   Emulation
	local bool
}

func (r dirRepo) Resolve(ctx context.Context) (ocispec.Descriptor, error) {
	return r.s.Resolve(ctx, r.ref.String())
}

// FindImage finds the manifest of the layer whose image is image,
// tagged or not: a snapshot's lower whose tag was removed or moved.
func (r dirRepo) FindImage(ctx context.Context, image digest.Digest) (ocispec.Descriptor, error) {
	i, err := layer.ResolveImage(ctx, r.s, r.ref.String(), image)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	f, err := r.s.Open(i.Manifest)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	return ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: i.Manifest, Size: fi.Size()}, nil
}

func (r dirRepo) Exists(ctx context.Context, d ocispec.Descriptor) (bool, error) {
	return r.s.Exists(d.Digest), nil
}

func (r dirRepo) Fetch(ctx context.Context, d ocispec.Descriptor) (io.ReadCloser, error) {
	return r.FetchFrom(ctx, d, 0)
}

// FetchFrom reads the blob from byte off on.
func (r dirRepo) FetchFrom(ctx context.Context, d ocispec.Descriptor, off int64) (io.ReadCloser, error) {
	f, err := r.s.Open(d.Digest)
	if err != nil {
		return nil, err
	}
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		f.Close()
		return nil, err
	}
	return ctxReader{ctx, r.emu.Reader(f)}, nil
}

// ctxReader stops reading once ctx is done, as a network read would.
type ctxReader struct {
	ctx context.Context
	io.ReadCloser
}

func (r ctxReader) Read(b []byte) (int, error) {
	if err := r.ctx.Err(); err != nil {
		return 0, err
	}
	return r.ReadCloser.Read(b)
}

// Push writes the blob through an ingest that is hashed and checked
// before it becomes visible. It holds the store's writer lock until the
// layer is tagged, so gc never takes a blob a copy is still adding.
func (r dirRepo) Push(ctx context.Context, d ocispec.Descriptor, rd io.Reader) error {
	in, err := r.s.NewIngest()
	if err != nil {
		return err
	}
	return r.finish(in, d, rd)
}

// resume returns the ingest of d, holding the bytes
// an interrupted copy wrote (Size), for finish to complete.
func (r dirRepo) resume(d ocispec.Descriptor) (*store.Ingest, error) {
	in, err := r.s.ResumeIngest(d.Digest)
	if err == nil && in.Size() > d.Size {
		in.Discard()
		in, err = r.s.ResumeIngest(d.Digest)
	}
	return in, err
}

// finish appends rd to in, then checks and publishes blob d. A failed
// read keeps a resumable ingest's bytes; wrong bytes drop them.
func (r dirRepo) finish(in *store.Ingest, d ocispec.Descriptor, rd io.Reader) error {
	if _, err := io.Copy(in, rd); err != nil {
		in.Abort()
		return err
	}
	if in.Size() != d.Size {
		in.Discard()
		return fmt.Errorf("blob %s: got %d bytes, want %d", d.Digest, in.Size(), d.Size)
	}
	if _, err := in.Commit(d.Digest); err != nil {
		return err
	}
	if d.MediaType == layer.MediaTypeLayer && (r.local && r.s.Dedup() || !r.local && r.s.DedupMarked()) {
		// A store that packs its layers packs one pulled into it, or
		// pushed to it: hosts that read a dir: remote lazily fetch its
		// chunks once each (lazy.MountPacked). A shared remote's store
		// packs only if told to (dsec layer dedup --remote), not by
		// DSEC_STORE_DEDUP in the pushing process. One that cannot be
		// packed stays whole, as good.
		r.s.Pack(context.Background(), d.Digest)
	}
	return nil
}

func (r dirRepo) Tag(ctx context.Context, d ocispec.Descriptor, force bool) error {
	return r.s.Tag(ctx, r.ref.String(), d, force)
}
