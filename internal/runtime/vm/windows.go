package vm

import (
	"context"
	"fmt"
	"os"
	"strconv"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// Window tables: each disk of a VM image's chain has a table of the
// sha256 of its windows (layer.Windows), a blob listed in the image's
// manifest after its disk and saved guest, so that a worker that boots
// the image from a remote reads its disks lazily, as it mounts a layer:
// only the windows the guest reads are fetched, each checked against
// its table before QEMU sees it. The table names its disk and window
// size in annotations; the manifest's digest, the image's ID, holds
// them all.
const (
	MediaTypeWindows = "application/vnd.dsec.vm.disk.windows.v1"
	// AnnotationWindowsOf is the disk a table is of (its digest), and
	// AnnotationWindowSize its window's size in bytes.
	AnnotationWindowsOf  = "dev.dsec.vm.windows.of"
	AnnotationWindowSize = "dev.dsec.vm.windows.size"
)

// Windows is the window table of the disk d (one of img's chain): ok is
// false when the image has none for it (an older dsec's).
func (img *Image) Windows(d ocispec.Descriptor) (layer.Windows, bool) {
	return windowsOf(img.Tables, d)
}

func windowsOf(tables []ocispec.Descriptor, d ocispec.Descriptor) (layer.Windows, bool) {
	for _, t := range tables {
		if t.Annotations[AnnotationWindowsOf] != d.Digest.String() {
			continue
		}
		size, err := strconv.ParseInt(t.Annotations[AnnotationWindowSize], 10, 64)
		if err != nil || layer.CheckWindowSize(size) != nil || d.Size <= 0 {
			return layer.Windows{}, false
		}
		return layer.Windows{Size: size, Count: int((d.Size + size - 1) / size), Digest: t.Digest}, true
	}
	return layer.Windows{}, false
}

// Lazy says whether img's disks can all be read lazily from a remote:
// each has its window table.
func (img *Image) Lazy() bool {
	for _, d := range img.Chain {
		if _, ok := img.Windows(d); !ok {
			return false
		}
	}
	return true
}

// tables are the window tables of disks, blobs of s: those known
// already (a snapshot's chain below its diff, whose image has them),
// and the others made from the disks s holds (a disk it does not hold
// is served lazily, and its table is known).
func tables(ctx context.Context, s *store.Store, disks, known []ocispec.Descriptor) ([]ocispec.Descriptor, error) {
	var out []ocispec.Descriptor
	for _, d := range disks {
		if i := indexOf(known, d); i >= 0 {
			out = append(out, known[i])
			continue
		}
		f, err := os.Open(s.BlobPath(d.Digest))
		if err != nil {
			continue // (held by no table: boots where it is pulled whole)
		}
		table, err := layer.WindowTable(f, d.Size, layer.WindowSize)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("the window table of disk %s: %w", d.Digest, err)
		}
		t, err := s.WriteBlob(MediaTypeWindows, table)
		if err != nil {
			return nil, err
		}
		t.Annotations = map[string]string{AnnotationWindowsOf: d.Digest.String(), AnnotationWindowSize: strconv.FormatInt(layer.WindowSize, 10)}
		out = append(out, t)
	}
	return out, nil
}

func indexOf(tables []ocispec.Descriptor, d ocispec.Descriptor) int {
	for i, t := range tables {
		if t.Annotations[AnnotationWindowsOf] == d.Digest.String() {
			return i
		}
	}
	return -1
}

// checkTables refuses a manifest's window tables that are not its
// disks': one at most per disk of its chain, of the size its windows
// make.
func checkTables(disks, tables []ocispec.Descriptor) error {
	seen := map[string]bool{}
	for _, t := range tables {
		of := t.Annotations[AnnotationWindowsOf]
		i := -1
		for j, d := range disks {
			if d.Digest.String() == of {
				i = j
			}
		}
		if i < 0 || seen[of] || digest.Digest(of).Validate() != nil {
			return fmt.Errorf("it holds a window table of %q, no disk of its chain (or a second): %w", of, errdefs.ErrInvalidArgument)
		}
		seen[of] = true
		w, ok := windowsOf(tables, disks[i])
		if !ok || t.Size != int64(w.Count)*32 {
			return fmt.Errorf("its window table of disk %s does not fit the disk (%d bytes, window %q): %w", of, t.Size, t.Annotations[AnnotationWindowSize], errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// Lender is the VM image of the store whose chain lists disk d with its
// window table, to read d lazily from a remote: the one of fewest disks
// (the image d came with, most likely, whose repository on a registry
// holds it; a snapshot over it made here may not be pushed). ok is
// false when no image lists d with a table.
func Lender(ctx context.Context, s *store.Store, d digest.Digest) (img *Image, disk ocispec.Descriptor, w layer.Windows, ok bool) {
	all, err := List(ctx, s)
	if err != nil {
		return nil, disk, w, false
	}
	for _, a := range all {
		for _, c := range a.Chain {
			if c.Digest != d {
				continue
			}
			if cw, has := a.Windows(c); has && (img == nil || len(a.Chain) < len(img.Chain)) {
				img, disk, w = a, c, cw
			}
		}
	}
	return img, disk, w, img != nil
}

// CheckDisk refuses the disk at path unless it is a qcow2 image that
// reads nothing but itself (no backing or data file: a host's file),
// as a pull checks a disk it copies: a disk read lazily is checked so
// where it is served, before QEMU opens it.
func CheckDisk(ctx context.Context, path string) error {
	_, err := probe(ctx, path, "qcow2")
	return err
}
