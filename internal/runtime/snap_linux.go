package runtime

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/snap"
)

// PackOptions says what PackDiff makes.
type PackOptions struct {
	Store  *store.Store
	Ref    layer.Ref   // the snapshot's tag, NAME:STEP; must be new
	Limits snap.Limits // bounds on what the sandbox wrote
	// Memory: a memory snapshot too, the sandbox's guest whole (a
	// microVM's; another backend's is ErrNotImplemented).
	Memory bool
}

// Packed is a snapshot PackDiff made.
type Packed struct {
	Layer  *layer.Info
	Packed *snap.Packed
	Frozen time.Duration // how long the sandbox was frozen
	// Paused is how long a memory snapshot's guest was paused.
	Paused time.Duration
}

// PackDiff freezes the sandbox, packs what it wrote into a snapshot
// layer tagged o.Ref and thaws it. The first snapshot holds everything
// the sandbox wrote over its layers; later ones only what changed since
// the previous, which is their parent. The sandbox runs on unchanged.
// A worker killed mid-pack leaves no tag (the store publishes the layer
// whole or not at all) and a frozen sandbox, which Load thaws.
func (sb *Sandbox) PackDiff(ctx context.Context, o PackOptions) (*Packed, error) {
	if err := sb.wakeGuest(ctx); err != nil {
		return nil, err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	sb.noteDeath()
	if sb.Status != Running || sb.g == nil {
		return nil, fmt.Errorf("sandbox %s is %s: pack-diff snapshots a running sandbox (dsec start %s): %w", sb.Name, sb.Status, sb.Name, errdefs.ErrFailedPrecondition)
	}
	if ds, ok := sb.d.(driver.DiskSnapshotter); ok {
		return sb.packDisk(ctx, ds, o)
	}
	if _, err := layer.Resolve(ctx, o.Store, o.Ref.String()); err == nil {
		return nil, fmt.Errorf("tag %s already exists: give the snapshot another NAME:STEP: %w", o.Ref, errdefs.ErrAlreadyExists)
	}
	indexPath := filepath.Join(sb.dir, "snap.index")
	lowers, prev := sb.packParent(ctx, o, indexPath)
	if _, ok := sb.d.(driver.MemorySnapshotter); o.Memory && !ok {
		return nil, fmt.Errorf("the %s backend keeps no memory in a snapshot: pack-diff --memory needs a microVM (dsec run --backend microvm); without --memory the snapshot holds the files: %w",
			sb.backendName(), errdefs.ErrNotImplemented)
	}
	upper, release, err := sb.holdUpper(ctx)
	if err != nil {
		return nil, err
	}
	var mem *layer.Memory
	var paused time.Duration
	if o.Memory {
		// Its blobs are held until the layer that names them is tagged.
		unlock, err := o.Store.Writer()
		if err != nil {
			release()
			return nil, err
		}
		defer unlock()
		if mem, paused, err = snapshotMemory(ctx, sb, o.Store); err != nil {
			release()
			return nil, fmt.Errorf("pack-diff %s: its memory: %w", sb.Name, err)
		}
	}
	// A batch sandbox the worker froze under memory pressure stays so.
	wasFrozen := sb.g.Frozen()
	if err := sb.g.Freeze(); err != nil {
		release()
		return nil, fmt.Errorf("freeze sandbox %s: %w", sb.Name, err)
	}
	frozen := time.Now()
	var packed *snap.Packed
	info, err := layer.Build(ctx, o.Store, layer.BuildOptions{
		Kind: layer.KindSnapshot, Ref: o.Ref, SourceKind: "upper",
		Snapshot: &layer.Lineage{Lowers: lowers, Sandbox: sb.Name, Incremental: prev != nil, Env: sb.Env, Workdir: sb.Workdir, User: sb.User, Memory: mem},
		Walk: func(ctx context.Context, w *erofs.Writer) error {
			var err error
			packed, err = snap.Pack(ctx, w, upper, prev, o.Limits)
			if err == nil && prev != nil && packed.Entries == 0 {
				// Its image would be its parent's own (an empty diff
				// over an empty diff): a node never its own ancestor.
				return fmt.Errorf("nothing changed in sandbox %s since snapshot %s, which holds this state already: branch or restore from it: %w",
					sb.Name, sb.Top.Ref, errdefs.ErrFailedPrecondition)
			}
			return err
		},
	})
	if err == nil && slices.ContainsFunc(lowers, func(l layer.Lower) bool { return l.Digest == info.Digest }) {
		// The same bytes as a layer it stands on: stacked on itself it
		// would be its own ancestor. Untagged before anything sees it.
		layer.Remove(ctx, o.Store, o.Ref.String())
		err = fmt.Errorf("the diff of sandbox %s is the very image of a layer it stands on: nothing to snapshot that this lineage does not hold: %w",
			sb.Name, errdefs.ErrFailedPrecondition)
	}
	if packed != nil {
		packed.Close()
	}
	var terr error
	if !wasFrozen {
		terr = sb.g.Thaw()
	}
	terr = errors.Join(terr, release())
	held := time.Since(frozen)
	if err != nil {
		return nil, fmt.Errorf("pack-diff %s: %w", sb.Name, err)
	}
	if terr != nil {
		return nil, fmt.Errorf("thaw sandbox %s after packing %s: %w", sb.Name, o.Ref, terr)
	}
	// The index is written before the state names its snapshot, and
	// names that snapshot itself, so a crash between the two leaves a
	// state whose next pack is a whole one, never a wrong increment.
	snap.WriteIndex(indexPath, info.Digest.String(), packed.Index)
	sb.Top = &layer.Lower{Ref: o.Ref.String(), Digest: info.Digest}
	if err := sb.save(); err != nil {
		return nil, err
	}
	return &Packed{Layer: info, Packed: packed, Frozen: held, Paused: paused}, nil
}

// packParent is what a pack stands on: the sandbox's layers, or for an
// incremental pack its last snapshot (with what that stands on) and that
// snapshot's index, read from indexPath (prev nil: a whole pack).
func (sb *Sandbox) packParent(ctx context.Context, o PackOptions, indexPath string) (lowers []layer.Lower, prev snap.Index) {
	lowers = make([]layer.Lower, 0, len(sb.Layers)+1)
	for i, ref := range sb.Layers {
		lowers = append(lowers, layer.Lower{Ref: ref, Digest: digest.Digest(sb.Digests[i])})
	}
	if sb.Top != nil && !o.Memory {
		// Incremental only over a parent that is still there as it was.
		// (A memory snapshot's diff is whole: its disk image dwarfs it,
		// and its memory changed even where its files did not.)
		if top, err := layer.Resolve(ctx, o.Store, sb.Top.Ref); err == nil && top.Digest == sb.Top.Digest && top.Snapshot != nil {
			if prev, _ = snap.ReadIndex(indexPath, top.Digest.String()); prev != nil {
				lowers = append([]layer.Lower{*sb.Top}, top.Snapshot.Lowers...)
			}
		}
	}
	return lowers, prev
}

// holdUpper is what the sandbox wrote, as the host reads it: its upper,
// or (a backend whose guest holds it) a consistent view of it until
// release.
func (sb *Sandbox) holdUpper(ctx context.Context) (upper string, release func() error, err error) {
	upper, release = sb.Upper(), func() error { return nil }
	if h, ok := sb.d.(driver.UpperHolder); ok {
		if sb.Paused {
			return "", nil, fmt.Errorf("sandbox %s is paused, and its guest holds its files: resume it, then snapshot it: %w", sb.Name, errdefs.ErrFailedPrecondition)
		}
		if upper, release, err = h.HoldUpper(ctx, sb.handle()); err != nil {
			return "", nil, fmt.Errorf("pack-diff %s: %w", sb.Name, err)
		}
	}
	return upper, release, nil
}

// SnapUsers reads what every sandbox of root stands on, for lineage,
// from the state files alone (it does not adopt or change any sandbox),
// and what the creates under way hold by their leases (User.Lease).
func SnapUsers(root string) ([]snap.User, error) {
	names, err := List(root)
	if err != nil {
		return nil, err
	}
	var out []snap.User
	for _, n := range names {
		b, err := os.ReadFile(filepath.Join(sandboxDir(root, IDOf(root, n)), "state.json"))
		if err != nil {
			continue // being created or removed
		}
		var st State
		if json.Unmarshal(b, &st) != nil {
			continue
		}
		u := snap.User{Name: st.Name, From: st.From, Digests: st.Digests}
		if len(st.Layers) == 1 {
			u.Base = st.Layers[0]
			if r, err := layer.ParseRef(u.Base); err == nil { // as a snapshot's tag is
				u.Base = r.String()
			}
		}
		out = append(out, u)
	}
	// Creates under way: what they resolved is in use before their
	// state names it (store leases).
	dir := filepath.Join(root, "store")
	if _, err := os.Stat(filepath.Join(dir, "leases")); err != nil {
		return out, nil // none was ever taken
	}
	s, err := store.Open(dir)
	if err != nil {
		return nil, err
	}
	leased, err := s.Leased()
	if err != nil {
		return nil, err
	}
	byLease := map[string][]string{}
	for d, names := range leased {
		for _, n := range names {
			byLease[n] = append(byLease[n], d.String())
		}
	}
	for _, n := range slices.Sorted(maps.Keys(byLease)) {
		out = append(out, snap.User{Name: "being made (lease " + n + ")", Digests: byLease[n], Lease: true})
	}
	return out, nil
}
