package vm

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/image"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/mount"
)

// A build's source is a tree on the host (a path that exists, or one
// written as a path: ./x, ../x, /x), or a stack of the store's
// layers: a layer (a snapshot with every layer it stands on, as a
// sandbox stacks them) or an image imported from a registry (its
// layers). Each layer's EROFS image is mounted read-only while the build
// reads it, and the stack is one tree through overlayfs, whiteouts and
// opaque directories as in a container's root.

// sources are the trees srcs name, topmost first: a directory as it is,
// else the mounts of the layers a store's name stands for (release
// unmounts them). what names each source for the image's record.
func sources(ctx context.Context, s *store.Store, srcs []string, dir string) (trees []string, what []string, release func(), err error) {
	var mnts []string
	release = func() {
		for _, m := range mnts {
			mount.Unmount(m)
			os.Remove(m)
		}
	}
	defer func() {
		if err != nil {
			release()
		}
	}()
	for _, src := range srcs {
		if _, serr := os.Stat(src); serr == nil || !errors.Is(serr, fs.ErrNotExist) || isPath(src) {
			abs, _ := filepath.Abs(src)
			trees, what = append(trees, abs), append(what, abs)
			continue
		}
		images, kind, err := layerStack(ctx, s, src)
		if err != nil {
			return nil, nil, release, err
		}
		for _, img := range images {
			m, err := os.MkdirTemp(dir, "layer.")
			if err != nil {
				return nil, nil, release, err
			}
			if err := mount.EROFS(img).Mount(m); err != nil {
				os.Remove(m)
				return nil, nil, release, fmt.Errorf("%s %s: mount its layer %s: %w", kind, src, filepath.Base(img), err)
			}
			mnts, trees = append(mnts, m), append(trees, m)
		}
		what = append(what, kind+" "+src)
	}
	if len(trees) == 1 && len(mnts) == 1 {
		// One layer alone is stacked too, over an empty tree: its
		// whiteouts are then no files.
		e, err := os.MkdirTemp(dir, "layer.")
		if err != nil {
			return nil, nil, release, err
		}
		mnts, trees = append(mnts, e), append(trees, e)
	}
	return trees, what, release, nil
}

// layerStack is the EROFS images, topmost first, that the store's
// name src stands for: a layer, with the layers a snapshot stands on,
// or an image's layers. Each must be in the store (a lazily mounted
// layer's image is pulled first).
func layerStack(ctx context.Context, s *store.Store, src string) (images []string, kind string, err error) {
	var digests []digest.Digest
	info, lerr := layer.Resolve(ctx, s, src)
	switch {
	case lerr == nil:
		kind, digests = string(info.Kind)+" layer", []digest.Digest{info.Digest}
		if info.Snapshot != nil {
			kind = "snapshot"
			for _, lo := range info.Snapshot.Lowers {
				digests = append(digests, lo.Digest)
			}
		}
	default: // an image's name, in any of its forms (a layer's name refuses most)
		var img *image.Image
		ref, err := image.ParseReference(src)
		if err == nil {
			img, err = image.Lookup(ctx, s, ref)
		}
		if err != nil {
			if !errdefs.IsNotFound(lerr) && !errdefs.IsInvalidArgument(lerr) {
				return nil, "", fmt.Errorf("%s is no directory, and as a layer: %w", src, lerr)
			}
			return nil, "", fmt.Errorf("%s is no directory, nor a layer or an image of the store (dsec layer ls, dsec image ls): give a tree to boot, or build, pull or import it first: %w",
				src, errdefs.ErrNotFound)
		}
		kind = "image"
		for i := len(img.Layers) - 1; i >= 0; i-- {
			digests = append(digests, img.Layers[i].Digest)
		}
	}
	for _, d := range digests {
		p, err := s.Whole(d) // the whole image, whether the store packs the layer or not
		if err != nil && !errdefs.IsNotFound(err) {
			return nil, "", err
		}
		if _, err := os.Stat(p); err != nil {
			return nil, "", fmt.Errorf("%s %s: its layer %s is not in this store (a layer a worker mounts lazily from its remote): pull it into the store first (dsec layer pull, or dsec image pull for an image): %w", kind, src, d, errdefs.ErrNotFound)
		}
		images = append(images, p)
	}
	return images, kind, nil
}

// isPath says whether src is written as a path (./x, ../x, /x): never
// a name of the store's.
func isPath(src string) bool {
	return filepath.IsAbs(src) || src == "." || src == ".." || strings.HasPrefix(src, "./") || strings.HasPrefix(src, "../")
}
