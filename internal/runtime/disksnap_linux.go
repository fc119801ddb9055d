package runtime

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/vm"
	"github.com/dsec-project/dsec/internal/snap"
)

// Disk snapshots: a full VM's disk is a chain of qcow2 images, and a
// snapshot of it ends the chain's top, writable, where the guest is now
// (driver.DiskSnapshotter): that top, what the guest wrote since its
// start or its last snapshot, becomes a blob of the store, and the
// snapshot a VM image whose disk is the sandbox's chain with it on top.
// The sandbox runs on over a new top; a branch boots the snapshot as it
// would any VM image.

// packDisk snapshots sb's disk into a VM image tagged o.Ref, the chain
// the sandbox's from then on.
func (sb *Sandbox) packDisk(ctx context.Context, ds driver.DiskSnapshotter, o PackOptions) (*Packed, error) {
	if err := sb.canPackDisk(ctx, o); err != nil {
		return nil, err
	}
	unlock, err := o.Store.Writer() // a collection waits until the state or a tag names the blob
	if err != nil {
		return nil, err
	}
	defer unlock()
	in, err := o.Store.NewIngest()
	if err != nil {
		return nil, err
	}
	defer in.Abort()
	depth := cmp.Or(sb.DiskTop, len(sb.Digests))
	req := driver.DiskSnap{Upper: sb.Upper(), Depth: depth, Chain: len(sb.Digests), Max: o.Limits.MaxBytes, Diff: in.File,
		Images: func() ([]string, func(), error) { return sb.chainFiles(ctx) }}
	var saved *store.Ingest
	if o.Memory {
		if saved, err = o.Store.NewIngest(); err != nil {
			return nil, err
		}
		defer saved.Abort()
		req.State = saved.File
	}
	took, err := ds.SnapshotDisk(ctx, sb.handle(), req)
	if err != nil {
		return nil, fmt.Errorf("pack-diff %s: %w", sb.Name, err)
	}
	blob, err := in.Commit("")
	if err != nil {
		return nil, fmt.Errorf("pack-diff %s: store its disk's diff: %w", sb.Name, err)
	}
	blob.MediaType = vm.MediaTypeDisk
	var state *ocispec.Descriptor
	if saved != nil {
		d, err := saved.Commit("")
		if err != nil {
			return nil, fmt.Errorf("pack-diff %s: store its saved guest: %w", sb.Name, err)
		}
		d.MediaType = vm.MediaTypeState
		state = &d
	}
	parent := sb.Layers[0]
	if sb.Top != nil {
		parent = sb.Top.Ref
	}
	chain, rec, tables := diskChain(ctx, o.Store, sb.Digests, parent)
	if took.Flat { // the diff is the whole disk: it stands alone
		chain = nil
	}
	rec.Created, rec.Sandbox, rec.Parent = time.Now().UTC(), sb.Name, parent
	rec.Source = "sandbox " + sb.Name
	rec.Memory = nil
	if state != nil {
		rec.Memory = &vm.Memory{Machine: *sb.Machine, Nonce: took.Memory.Nonce, Policy: sb.Policy}
	}
	chain = append(chain, blob)
	img, err := vm.Snapshot(ctx, o.Store, o.Ref, chain, state, tables, rec)
	// The sandbox stands on the diff from now on, tagged or not (a tag
	// taken meanwhile): its state holds it, and the number of its disk's
	// new top where a flatten made that other than its chain's length.
	digests, top, diskTop := sb.Digests, sb.Top, sb.DiskTop
	sb.Digests = append([]string{blob.Digest.String()}, sb.Digests...)
	if took.Flat {
		sb.Digests = []string{blob.Digest.String()}
	}
	if sb.DiskTop = depth + 1; sb.DiskTop == len(sb.Digests) {
		sb.DiskTop = 0
	}
	if img != nil {
		sb.Top = &layer.Lower{Ref: o.Ref.String(), Digest: blob.Digest}
	}
	if serr := sb.save(); serr != nil {
		sb.Digests, sb.Top, sb.DiskTop = digests, top, diskTop
		if img != nil {
			o.Store.Untag(ctx, o.Ref.String())
		}
		return nil, serr
	}
	took.Commit() // (a leftover is removed at its next start)
	if err != nil {
		return nil, fmt.Errorf("pack-diff %s: %w", sb.Name, err)
	}
	info := &layer.Info{Ref: img.Tag, Kind: layer.KindVMImage, Digest: blob.Digest, Size: blob.Size, Manifest: img.ID,
		Created: rec.Created, Source: rec.Source, Snapshot: &layer.Lineage{Sandbox: sb.Name,
			Incremental: len(chain) > 2 || len(chain) == 2 && top != nil}} // (over a snapshot: a flattened one is the chain's base)
	if len(chain) > 1 { // (a flattened one stands on nothing)
		info.Snapshot.Lowers = []layer.Lower{{Ref: parent, Digest: chain[len(chain)-2].Digest}}
	}
	out := &Packed{Layer: info, Packed: &snap.Packed{Bytes: blob.Size}, Frozen: took.Frozen}
	if state != nil {
		info.Snapshot.Memory = &layer.Memory{Machine: *sb.Machine, State: *state, Nonce: took.Memory.Nonce}
		out.Paused = took.Frozen
	}
	return out, nil
}

// canPackDisk says why the sandbox's disk cannot be packed now, if it cannot.
func (sb *Sandbox) canPackDisk(ctx context.Context, o PackOptions) error {
	switch {
	case o.Memory && sb.Machine == nil:
		return fmt.Errorf("sandbox %s was started by an older dsec, which recorded no machine: stop and start it, then snapshot it: %w", sb.Name, errdefs.ErrFailedPrecondition)
	case sb.Paused:
		return fmt.Errorf("sandbox %s is paused, and its guest holds its disk: resume it, then snapshot it: %w", sb.Name, errdefs.ErrFailedPrecondition)
	case sb.g.Frozen():
		return fmt.Errorf("the worker holds sandbox %s frozen (the host is short of memory): snapshot it once it runs again: %w", sb.Name, errdefs.ErrFailedPrecondition)
	}
	if _, err := o.Store.Resolve(ctx, o.Ref.String()); err == nil {
		return fmt.Errorf("tag %s already exists: give the snapshot another NAME:STEP: %w", o.Ref, errdefs.ErrAlreadyExists)
	}
	return nil
}

// chainFiles are the files of sb's disk's chain, topmost first (a disk
// the store lacks served lazily), and what lets go of them.
func (sb *Sandbox) chainFiles(ctx context.Context) ([]string, func(), error) {
	b, ok := sb.d.(driver.BaseResolver)
	if !ok {
		return nil, nil, fmt.Errorf("sandbox %s boots no base of its own: %w", sb.Name, errdefs.ErrNotImplemented)
	}
	base, err := b.ResolveBase(ctx, sb.host.baseSource(), sb.Layers[0], sb.Digests)
	if err != nil {
		return nil, nil, err
	}
	release := base.Release
	if release == nil {
		release = func() {}
	}
	return base.Files, release, nil
}

// diskChain is the chain of blobs digests (topmost first) names, base
// first, the record of the VM image parent, the image or snapshot the
// chain is (its disk's shape; a chain that no image records any more
// gets a record of its own, its agent a running sandbox's), and the
// window tables of its disks that image has (a disk read lazily from
// the remote is in no blob of the store: its size is the image's).
func diskChain(ctx context.Context, s *store.Store, digests []string, parent string) ([]ocispec.Descriptor, vm.Record, []ocispec.Descriptor) {
	chain := make([]ocispec.Descriptor, len(digests))
	var tables []ocispec.Descriptor
	for i, d := range digests {
		dg := digest.Digest(d)
		desc := ocispec.Descriptor{MediaType: vm.MediaTypeDisk, Digest: dg}
		if st, err := os.Stat(s.BlobPath(dg)); err == nil {
			desc.Size = st.Size()
		} else if lender, disk, _, ok := vm.Lender(ctx, s, dg); ok { // read lazily: as an image lists it
			desc = disk
			for _, t := range lender.Tables {
				if t.Annotations[vm.AnnotationWindowsOf] == dg.String() {
					tables = append(tables, t)
				}
			}
		}
		chain[len(chain)-1-i] = desc
	}
	same := func(img *vm.Image) bool {
		return img != nil && slices.Equal(img.Digests(), digests)
	}
	if img, err := vm.Lookup(ctx, s, parent); err == nil && same(img) {
		return slices.Clone(img.Chain), img.Record, img.Tables
	}
	if all, err := vm.List(ctx, s); err == nil {
		if i := slices.IndexFunc(all, same); i >= 0 {
			return slices.Clone(all[i].Chain), all[i].Record, all[i].Tables
		}
	}
	return chain, vm.Record{Disk: vm.Disk{Agent: vm.AgentSystemd}}, tables
}
