package vm

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/mount"
)

// stack is trees (topmost first) as one tree: the one tree itself, or an
// overlay of them mounted in a directory under dir until unstack.
// mke2fs then reads what overlayfs shows: a file of an upper tree hides
// a lower's, and whiteouts and opaque directories hold as in a
// container's root. The overlay has an upper of its own (beside its
// mount, removed with it), which only hideWhiteouts writes; where the
// store's file system takes none, the overlay is read-only.
func stack(trees []string, dir string) (tree string, unstack func(), err error) {
	for _, t := range trees {
		if st, err := os.Stat(t); errors.Is(err, fs.ErrNotExist) {
			return "", nil, fmt.Errorf("no directory %s: give the root of a tree to boot: %w", t, errdefs.ErrNotFound)
		} else if err != nil || !st.IsDir() {
			return "", nil, fmt.Errorf("%s is not a directory: give the root of a tree to boot: %w", t, errdefs.ErrInvalidArgument)
		}
	}
	if len(trees) == 1 {
		return trees[0], func() {}, nil
	}
	top, err := os.MkdirTemp(dir, "tree.")
	if err != nil {
		return "", nil, err
	}
	mnt, upper, work := filepath.Join(top, "m"), filepath.Join(top, "u"), filepath.Join(top, "w")
	for _, d := range []string{mnt, upper, work} {
		if err := os.Mkdir(d, 0o700); err != nil {
			os.RemoveAll(top)
			return "", nil, err
		}
	}
	unstack = func() {
		if mount.Unmount(mnt) == nil {
			os.RemoveAll(top)
		}
	}
	if err := mount.Overlay(trees, upper, work).Mount(mnt); err != nil {
		// A store where no upper can be (NFS, say): read-only, where a
		// whiteout over nothing is left for mke2fs to refuse.
		ro := mount.Overlay(trees, "", "")
		ro.Options = append(ro.Options, "ro")
		if err := ro.Mount(mnt); err != nil {
			os.RemoveAll(top)
			return "", nil, fmt.Errorf("stack %d trees: %w", len(trees), err)
		}
		return mnt, unstack, nil
	}
	if err := hideWhiteouts(mnt); err != nil {
		unstack()
		return "", nil, fmt.Errorf("stack %d trees: %w", len(trees), err)
	}
	return mnt, unstack, nil
}

// hideWhiteouts makes the overlay at root list no whiteout. Overlayfs
// lists a directory that only one tree holds as that tree does, so a
// whiteout there (of nothing below it: a lone layer's, say) is a name
// that no lookup then finds, and mke2fs fails on it. Such a directory
// is copied up (a file made in it and removed), after which it is
// listed merged, without its whiteouts; its times are kept.
func hideWhiteouts(root string) error {
	return filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.Type()&fs.ModeCharDevice == 0 {
			return err
		}
		if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		parent := filepath.Dir(p)
		st, err := os.Lstat(parent)
		if err != nil {
			return err
		}
		f, err := os.CreateTemp(parent, ".dsec-merge.")
		if err != nil {
			return err
		}
		f.Close()
		if err := os.Remove(f.Name()); err != nil {
			return err
		}
		return os.Chtimes(parent, st.ModTime(), st.ModTime())
	})
}
