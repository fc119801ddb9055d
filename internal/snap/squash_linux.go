package snap

import (
	"context"
	"fmt"
	"os"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/mount"
)

// Squash folds the chain of snapshots that ends in ref (ref, its parent
// snapshot, and so on down to the first layer that is no snapshot) into
// one snapshot layer tagged to, standing on the same layers the chain
// stands on. Stacked, it gives the view the chain gives. The chain is
// left as it is (dsec snap rm removes it).
func Squash(ctx context.Context, s *store.Store, ref string, to layer.Ref, tmp string) (_ *layer.Info, tally Squashed, err error) {
	top, err := layer.Resolve(ctx, s, ref)
	if err != nil {
		return nil, tally, err
	}
	if top.Snapshot == nil {
		return nil, tally, fmt.Errorf("%s is a %s layer, not a snapshot: %w", ref, top.Kind, errdefs.ErrInvalidArgument)
	}
	chain, lowers, err := snapshotChain(ctx, s, ref, top)
	if err != nil {
		return nil, tally, err
	}
	if len(chain) < 2 {
		return nil, tally, fmt.Errorf("%s stands on no other snapshot: there is no chain to squash: %w", ref, errdefs.ErrInvalidArgument)
	}
	// Mount each diff, bottom first, where Merge reads it.
	var mnts []string
	defer func() {
		for _, m := range mnts {
			mount.Unmount(m)
			os.Remove(m)
		}
	}()
	for i := len(chain) - 1; i >= 0; i-- {
		m, err := os.MkdirTemp(tmp, "squash-")
		if err != nil {
			return nil, tally, err
		}
		if err := s.MountLayer(chain[i].Digest, m); err != nil {
			os.Remove(m)
			return nil, tally, err
		}
		mnts = append(mnts, m)
	}
	// The merged view of the layers under the chain, to look up what a
	// whiteout hides.
	var lowerMnts []string
	for _, lo := range lowers {
		i, err := layer.Resolve(ctx, s, lo.Digest.String())
		if err != nil {
			return nil, tally, fmt.Errorf("snapshot chain of %s stands on %s (%s), which is not in the store: %w", ref, lo.Ref, lo.Digest, err)
		}
		m, err := os.MkdirTemp(tmp, "squash-lower-")
		if err != nil {
			return nil, tally, err
		}
		if err := s.MountLayer(i.Digest, m); err != nil {
			os.Remove(m)
			return nil, tally, err
		}
		lowerMnts = append(lowerMnts, m)
	}
	defer func() {
		for _, m := range lowerMnts {
			mount.Unmount(m)
			os.Remove(m)
		}
	}()
	base := lowerMnts[0]
	if len(lowerMnts) > 1 {
		if base, err = os.MkdirTemp(tmp, "squash-base-"); err != nil {
			return nil, tally, err
		}
		defer os.Remove(base)
		if err := mount.Overlay(lowerMnts, "", "").Mount(base); err != nil {
			return nil, tally, err
		}
		defer mount.Unmount(base)
	}
	var packs []*Packed
	defer func() {
		for _, p := range packs {
			p.Close()
		}
	}()
	info, err := layer.Build(ctx, s, layer.BuildOptions{
		Kind: layer.KindSnapshot, Ref: to, SourceKind: "squash",
		Snapshot: &layer.Lineage{Lowers: lowers, Sandbox: top.Snapshot.Sandbox, Env: top.Snapshot.Env, Workdir: top.Snapshot.Workdir, User: top.Snapshot.User},
		Walk: func(ctx context.Context, w *erofs.Writer) error {
			for _, m := range mnts {
				p, err := Merge(ctx, w, m, base)
				if err != nil {
					return err
				}
				packs = append(packs, p)
			}
			tally.Entries, tally.Whiteouts, tally.Bytes = w.Tally()
			return nil
		},
	})
	if err != nil {
		return nil, tally, err
	}
	tally.Folded = len(chain)
	return info, tally, nil
}

// snapshotChain is the chain of snapshots that ends in top (ref's): top,
// its parent snapshot and so on, and the layers under the chain.
func snapshotChain(ctx context.Context, s *store.Store, ref string, top *layer.Info) ([]*layer.Info, []layer.Lower, error) {
	chain := []*layer.Info{top}
	lowers := top.Snapshot.Lowers
	for len(lowers) > 0 {
		i, err := layer.Resolve(ctx, s, lowers[0].Ref)
		if err != nil || i.Digest != lowers[0].Digest {
			if i, err = layer.Resolve(ctx, s, lowers[0].Digest.String()); err != nil {
				return nil, nil, fmt.Errorf("snapshot chain of %s: layer %s (%s) is not in the store: %w", ref, lowers[0].Ref, lowers[0].Digest, errdefs.ErrNotFound)
			}
		}
		if i.Snapshot == nil {
			break
		}
		chain = append(chain, i)
		lowers = lowers[1:]
	}
	return chain, lowers, nil
}

// Squashed is what a squash folded and what the new snapshot holds:
// its paths (whiteouts included), the whiteouts among them and its
// bytes of file data.
type Squashed struct {
	Folded, Entries, Whiteouts int
	Bytes                      int64
}
