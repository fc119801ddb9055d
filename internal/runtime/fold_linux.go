package runtime

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/lower"
)

// FoldedPrefix starts the tags of folded layers: folded/HEX:1, HEX the
// first 32 hex digits of the sha256 of the folded layers' digests.
const FoldedPrefix = "folded/"

// folding makes one fold at a time in a process: two creates on one
// deep image build its fold once, the second finding it stored.
var folding sync.Mutex

// foldDeep fits a stack deeper than its backend takes (driver.LayerBound:
// a microVM's guest has a device per layer) to the bound: the deepest
// layers, all but bound-1 of the stack, become one base layer made from
// their merged view, stored once under a tag their digests name
// (FoldedPrefix) and found there by every later create. Only the layers
// of images, bases, workspaces and toolkits fold: a snapshot's files are
// its owner's, and a fold is anyone's layer. digests, when the stack
// came from a snapshot, follow the layers.
func foldDeep(ctx context.Context, root string, o *options, d driver.Driver, digests []string) ([]string, error) {
	b, ok := d.(driver.LayerBound)
	if !ok || len(o.Layers) <= b.MaxLayers() {
		return digests, nil
	}
	keep := b.MaxLayers() - 1
	deep := o.Layers[keep:]
	wants := make([]string, len(deep)) // the digests a snapshot's stack pins ("": none)
	if len(digests) > keep {
		copy(wants, digests[keep:])
	}
	src := o.Host.Source()
	sum := sha256.New()
	for i, ref := range deep {
		f, err := lower.Resolve(ctx, root, src, ref, wants[i])
		if err != nil {
			return nil, err
		}
		if f.Kind == layer.KindSnapshot {
			return nil, fmt.Errorf("%d layers: a %s sandbox takes %d at most, and the deepest to fold include snapshot %s: fold the snapshot chain with dsec snap squash: %w",
				len(o.Layers), d.Name(), b.MaxLayers(), ref, errdefs.ErrOutOfRange)
		}
		fmt.Fprintln(sum, f.Digest)
	}
	tag := FoldedPrefix + hex.EncodeToString(sum.Sum(nil))[:32] + ":1"
	info, err := fold(ctx, o.Host, tag, deep, wants)
	if err != nil {
		return nil, fmt.Errorf("fold the deepest %d of %d layers into one (a %s sandbox takes %d): %w", len(deep), len(o.Layers), d.Name(), b.MaxLayers(), err)
	}
	o.Layers = append(o.Layers[:keep:keep], tag)
	if digests != nil {
		digests = append(digests[:keep:keep], info.Digest.String())
	}
	return digests, nil
}

// fold returns the layer tag, building it from the merged view of deep
// (topmost first, each the image wants names, if any) if the store
// lacks it.
func fold(ctx context.Context, h *Host, tag string, deep, wants []string) (*layer.Info, error) {
	folding.Lock()
	defer folding.Unlock()
	if info, err := layer.Resolve(ctx, h.Store, tag); err == nil {
		return info, nil
	}
	user := "fold-" + strings.TrimPrefix(strings.TrimSuffix(tag, ":1"), FoldedPrefix)
	ms := h.Lowers()
	defer ms.Release(user)
	var dirs []string
	for i, ref := range deep {
		dir, _, err := ms.Acquire(ctx, h.Source(), ref, user, wants[i])
		if err != nil {
			return nil, err
		}
		dirs = append(dirs, dir)
	}
	merged, err := os.MkdirTemp(h.Root, "fold-")
	if err != nil {
		return nil, err
	}
	defer os.Remove(merged)
	if err := mount.Overlay(dirs, "", "").Mount(merged); err != nil {
		return nil, err
	}
	defer mount.Unmount(merged)
	ref, err := layer.ParseRef(tag)
	if err != nil {
		return nil, err
	}
	return layer.Build(ctx, h.Store, layer.BuildOptions{Source: merged, Kind: layer.KindBase, Ref: ref, SourceKind: "fold"})
}
