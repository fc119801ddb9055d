package remote

import (
	"context"
	"fmt"
	"io"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// Dir is a store on a local or shared POSIX path: the local store itself,
// or a dir: remote.
type Dir struct {
	s    *store.Store
	name string
	emu  Emulation
}

func openDir(path string) (*Dir, error) {
	s, err := store.Open(path)
	if err != nil {
		return nil, err
	}
	return &Dir{s: s, name: "dir://" + path, emu: EmulationFromEnv()}, nil
}

// Local wraps the local store as a Target.
func Local(s *store.Store) *Dir { return &Dir{s: s, name: "local store"} }

func (d *Dir) String() string { return d.name }

// Repo returns the store: every layer name shares it.
func (d *Dir) Repo(ctx context.Context, ref layer.Ref) (Repo, error) {
	return dirRepo{d.s, ref, d.emu}, nil
}

type dirRepo struct {
	s   *store.Store
	ref layer.Ref
	emu Emulation
}

func (r dirRepo) Resolve(ctx context.Context) (ocispec.Descriptor, error) {
	return r.s.Resolve(ctx, r.ref.String())
}

func (r dirRepo) Exists(ctx context.Context, d ocispec.Descriptor) (bool, error) {
	return r.s.Exists(d.Digest), nil
}

func (r dirRepo) Fetch(ctx context.Context, d ocispec.Descriptor) (io.ReadCloser, error) {
	f, err := r.s.Open(d.Digest)
	if err != nil {
		return nil, err
	}
	return r.emu.Reader(f), nil
}

// Push writes the blob through an ingest that is hashed and checked
// before it becomes visible. It holds the store's writer lock until the
// layer is tagged, so gc never takes a blob a copy is still adding.
func (r dirRepo) Push(ctx context.Context, d ocispec.Descriptor, rd io.Reader) error {
	in, err := r.s.NewIngest()
	if err != nil {
		return err
	}
	n, err := io.Copy(in, rd)
	if err != nil {
		in.Abort()
		return err
	}
	if n != d.Size {
		in.Abort()
		return fmt.Errorf("blob %s: got %d bytes, want %d", d.Digest, n, d.Size)
	}
	_, err = in.Commit(d.Digest)
	return err
}

func (r dirRepo) Tag(ctx context.Context, d ocispec.Descriptor, force bool) error {
	return r.s.Tag(ctx, r.ref.String(), d, force)
}
