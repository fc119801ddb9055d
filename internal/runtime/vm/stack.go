package vm

import (
	"errors"
	"fmt"
	"io/fs"
	"os"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/mount"
)

// stack is trees (topmost first) as one tree: the one tree itself, or a
// read-only overlay of them mounted in a directory under dir until
// unstack. mke2fs then reads what overlayfs shows: a file of an upper
// tree hides a lower's, and whiteouts and opaque directories hold as in
// a container's root.
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
	mnt, err := os.MkdirTemp(dir, "tree.")
	if err != nil {
		return "", nil, err
	}
	ov := mount.Overlay(trees, "", "")
	ov.Options = append(ov.Options, "ro")
	if err := ov.Mount(mnt); err != nil {
		os.Remove(mnt)
		return "", nil, fmt.Errorf("stack %d trees: %w", len(trees), err)
	}
	return mnt, func() {
		mount.Unmount(mnt)
		os.Remove(mnt)
	}, nil
}
