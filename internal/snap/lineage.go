package snap

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime/vm"
)

// Node is a snapshot in the lineage DAG.
type Node struct {
	api.SnapshotNode
	lowers []layer.Lower
	vm     bool // a full VM's disk snapshot (a VM image), not a layer
}

// User is a sandbox, as far as lineage cares: what it stands on.
type User struct {
	Name string
	From string // the snapshot it was started on
	// Base is the one layer it was made of, if one: a full VM's disk,
	// whose snapshot it is a branch of when Base names one.
	Base    string
	Digests []string // of its layers
	// Lease: a create under way, whose lease holds what it resolved
	// (store leases); in use, not yet a sandbox to list.
	Lease bool
}

// Tree lists the store's snapshots, oldest first, with what stands on
// each.
func Tree(ctx context.Context, s *store.Store, users []User) ([]*Node, error) {
	all, err := layer.List(ctx, s)
	if err != nil {
		return nil, err
	}
	var nodes []*Node
	for _, i := range all {
		if i.Snapshot == nil {
			continue
		}
		n := &Node{SnapshotNode: api.SnapshotNode{Name: i.Ref, Digest: i.Digest.String(), Size: i.Size,
			Parent: i.Snapshot.Parent().Ref, Sandbox: i.Snapshot.Sandbox, Incremental: i.Snapshot.Incremental,
			Created: i.Created, Children: []string{}, Branches: []string{}, Sandboxes: []string{}}, lowers: i.Snapshot.Lowers}
		for _, lo := range i.Snapshot.Lowers {
			n.Layers = append(n.Layers, lo.Ref)
		}
		if m := i.Snapshot.Memory; m != nil {
			for _, b := range m.Blobs() {
				n.MemoryBytes += b.Size
			}
		}
		nodes = append(nodes, n)
	}
	vms, err := vmSnapshots(ctx, s)
	if err != nil {
		return nil, err
	}
	nodes = append(nodes, vms...)
	for _, n := range nodes {
		for _, m := range nodes {
			// A snapshot with its parent's very image (an older dsec
			// packed an empty diff over an empty one) is no child of
			// it, nor of itself: the lineage stays a DAG whatever the
			// store holds.
			// A full VM's flattened disk stands on nothing: its parent
			// is the snapshot it was taken over.
			if m.Digest != n.Digest && (len(m.lowers) > 0 && m.lowers[0].Digest.String() == n.Digest || len(m.lowers) == 0 && m.Parent == n.Name) {
				n.Children = append(n.Children, m.Name)
				// A VM's diff over a snapshot (a flattened one too)
				// holds what changed since.
				m.Incremental = m.Incremental || m.vm && len(m.lowers) > 0
			}
		}
		for _, u := range users {
			if slices.Contains(u.Digests, n.Digest) {
				n.Sandboxes = append(n.Sandboxes, u.Name)
				if u.From == n.Name || n.vm && u.Base == n.Name {
					n.Branches = append(n.Branches, u.Name)
				}
			}
		}
	}
	// Oldest first; within a second (configs keep whole seconds), a
	// parent before what stands on it.
	slices.SortStableFunc(nodes, func(a, b *Node) int {
		if c := a.Created.Compare(b.Created); c != 0 {
			return c
		}
		return cmp.Compare(len(a.lowers), len(b.lowers))
	})
	return nodes, nil
}

// Remove untags the snapshot ref. Without force it refuses while a
// snapshot or a sandbox stands on it; forced, those can no longer start.
// Its blobs go at the next dsec layer gc.
func Remove(ctx context.Context, s *store.Store, ref string, users []User, force bool) (*Node, error) {
	nodes, err := Tree(ctx, s, users)
	if err != nil {
		return nil, err
	}
	r, err := layer.ParseRef(ref)
	if err != nil {
		return nil, err
	}
	var n *Node
	for _, c := range nodes {
		if c.Name == r.String() {
			n = c
		}
	}
	if n == nil {
		if _, err := layer.Resolve(ctx, s, r.String()); err == nil {
			return nil, fmt.Errorf("%s is a layer, not a snapshot: remove it with dsec layer rm: %w", r, errdefs.ErrInvalidArgument)
		}
		return nil, fmt.Errorf("no snapshot %s (dsec snap ls lists them): %w", r, errdefs.ErrNotFound)
	}
	var on []string
	for _, c := range nodes {
		if c.Digest == n.Digest { // itself, or its very image under another tag
			continue
		}
		for _, lo := range c.lowers {
			if lo.Digest.String() == n.Digest {
				on = append(on, "snapshot "+c.Name)
			}
		}
	}
	for _, sb := range n.Sandboxes {
		on = append(on, "sandbox "+sb)
	}
	if len(on) > 0 && !force {
		return nil, fmt.Errorf("snapshot %s is still stood on by %s: remove those first, or --force (the tag goes; gc keeps the snapshot, untagged, while they stand on it): %w",
			r, strings.Join(on, ", "), errdefs.ErrFailedPrecondition)
	}
	if n.vm {
		if _, err := s.Untag(ctx, r.String()); err != nil {
			return nil, err
		}
		return n, nil
	}
	if _, err := layer.Remove(ctx, s, r.String()); err != nil {
		return nil, err
	}
	return n, nil
}

// vmSnapshots are the store's snapshots of full VMs' disks: VM images
// whose last image is a sandbox's block diff over the rest (package
// vm), each standing on the image or snapshot it was taken over, or
// whose one image is a sandbox's whole disk (a flattened chain), which
// stands on nothing.
func vmSnapshots(ctx context.Context, s *store.Store) ([]*Node, error) {
	imgs, err := vm.List(ctx, s)
	if err != nil {
		return nil, err
	}
	var out []*Node
	for _, img := range imgs {
		if img.Sandbox == "" {
			continue
		}
		n := &Node{SnapshotNode: api.SnapshotNode{Name: img.Tag, Digest: img.Blob.Digest.String(), Size: img.Blob.Size,
			Parent: img.Parent, Layers: []string{}, Sandbox: img.Sandbox, Incremental: len(img.Chain) > 2,
			Created: img.Created, Children: []string{}, Branches: []string{}, Sandboxes: []string{}}, vm: true}
		if len(img.Chain) > 1 { // (else its disk, flattened, stands on nothing)
			n.Layers = []string{img.Parent}
			n.lowers = []layer.Lower{{Ref: img.Parent, Digest: img.Chain[len(img.Chain)-2].Digest}}
		}
		out = append(out, n)
		if img.State != nil {
			out[len(out)-1].MemoryBytes = img.State.Size
		}
	}
	return out, nil
}
