package vms

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/vmm"
	"github.com/dsec-project/dsec/internal/runtime/vm"
)

// A full VM's disk is a chain of qcow2 images: its image's (a built
// disk, then a block diff per snapshot, in the store, read-only) under a
// top of its own in the sandbox's upper, which takes what the guest
// writes. No image of the chain names its backing file (a diff's bytes
// are the same on every host, and a branch's top is over whatever store
// it runs from): Machine stacks them itself. The top of a chain of depth
// images is topFile(upper, depth); a snapshot stacks topFile(upper,
// depth+1) over it while the guest runs, and the state then names the
// ended top's blob, its chain one longer.

// topFile is the top of a chain of depth images in upper.
func topFile(upper string, depth int) string {
	if depth <= 1 {
		return filepath.Join(upper, "disk.qcow2")
	}
	return filepath.Join(upper, fmt.Sprintf("disk.%d.qcow2", depth))
}

// top is the sandbox's top over chain (topmost first), made empty on
// its first start, kept after. A top over it that a snapshot stacked
// and the sandbox's state never came to name (its worker was killed
// in between) is merged into it: what the guest wrote since is kept,
// and the chain is the state's. last is the number of the top the disk
// was on when it last ran, where that is not the chain's length (0
// otherwise): a chain a snapshot flattened is shorter than that, and
// its top is renumbered.
func top(ctx context.Context, upper string, chain []string, last int) (string, error) {
	path := topFile(upper, len(chain))
	if last > len(chain) {
		was := topFile(upper, last)
		if _, err := os.Stat(was); err != nil {
			if _, err := os.Stat(path); err != nil { // (else renumbered by a start that went no further)
				return "", fmt.Errorf("the VM's disk: its top (%s) is gone, and what the guest wrote with it: %w", was, errdefs.ErrDataLoss)
			}
		} else {
			if _, err := os.Stat(topFile(upper, last+1)); err == nil {
				if err := merge(ctx, topFile(upper, last+1), was); err != nil {
					return "", fmt.Errorf("the VM's disk: a snapshot left a top its state does not name, which does not merge: %w", err)
				}
			}
			if err := os.Rename(was, path); err != nil {
				return "", err
			}
		}
		// Tops under it are ended ones, which blobs hold.
		for k := len(chain) + 1; k < last; k++ {
			if err := os.Remove(topFile(upper, k)); err != nil && !errors.Is(err, os.ErrNotExist) {
				return "", err
			}
		}
	}
	next := topFile(upper, len(chain)+1)
	for k := 1; k < len(chain); k++ { // ended tops the chain's blobs hold now
		if err := os.Remove(topFile(upper, k)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return "", err
		}
	}
	_, err := os.Stat(path)
	switch {
	case err == nil:
		if _, err := os.Stat(next); err == nil {
			if err := merge(ctx, next, path); err != nil {
				return "", fmt.Errorf("the VM's disk: a snapshot left a top its state does not name, which does not merge: %w", err)
			}
		}
		return path, nil
	case !errors.Is(err, os.ErrNotExist):
		return "", err
	}
	size, err := virtualSize(ctx, chain[0])
	if err != nil {
		return "", err
	}
	if err := create(ctx, path, size); err != nil {
		return "", err
	}
	return path, nil
}

// create makes an empty qcow2 image of size bytes at path, naming no
// backing file.
func create(ctx context.Context, path string, size int64) error {
	os.Remove(path + ".tmp")
	out, err := exec.CommandContext(ctx, "qemu-img", "create", "-q", "-f", "qcow2", path+".tmp", fmt.Sprint(size)).CombinedOutput()
	if err != nil {
		os.Remove(path + ".tmp")
		return fmt.Errorf("the VM's disk: qemu-img: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return os.Rename(path+".tmp", path)
}

// virtualSize is the size of the disk the qcow2 image path holds.
func virtualSize(ctx context.Context, path string) (int64, error) {
	out, err := exec.CommandContext(ctx, "qemu-img", "info", "-U", "--output=json", "-f", "qcow2", path).Output()
	if err != nil {
		return 0, fmt.Errorf("the VM's disk %s: qemu-img info: %w", path, err)
	}
	var info struct {
		Size int64 `json:"virtual-size"`
	}
	if err := json.Unmarshal(out, &info); err != nil || info.Size <= 0 {
		return 0, fmt.Errorf("the VM's disk %s: qemu-img info says no size: %s", path, out)
	}
	return info.Size, nil
}

// merge writes what the top image over holds into under, the image it
// was stacked on, and removes over.
func merge(ctx context.Context, over, under string) error {
	if out, err := exec.CommandContext(ctx, "qemu-img", "commit", "-q", chainSpec(over, under)).CombinedOutput(); err != nil {
		return fmt.Errorf("qemu-img commit: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return os.Remove(over)
}

// SnapshotDisk ends the top of the running VM's disk (a chain of
// d.Depth images, node TopNode(d.Depth)): a new top is stacked over it,
// its root file system frozen by its agent meanwhile (with d.State, the
// guest stopped too, and its device state and RAM saved to d.State as
// they were then), and the ended top is copied to d.Diff. A top over
// d.Max bytes is refused before anything is done. Commit removes the
// ended top's file (QEMU reads it on until it ends: the blob d.Diff
// became holds the same bytes, and is in the chain of its next start).
// Whatever fails once the new top may be stacked leaves it there: the
// next snapshot is refused until a stop and a start merge it (no write
// of the guest is lost).
func (d *Driver) SnapshotDisk(ctx context.Context, h driver.Handle, o driver.DiskSnap) (out driver.DiskSnapped, err error) {
	v, ok := h.Instance.(*vmm.VM)
	if !ok || v == nil {
		return out, fmt.Errorf("sandbox %s's VM is not running: %w", h.Name, errdefs.ErrFailedPrecondition)
	}
	cur, next := topFile(o.Upper, o.Depth), topFile(o.Upper, o.Depth+1)
	if _, err := os.Stat(next); err == nil {
		v.ThawFS(ctx) // (that snapshot may have left the guest frozen)
		return out, fmt.Errorf("a snapshot of sandbox %s did not end (its worker stopped, or its guest did not thaw): stop and start the sandbox (its start keeps all its guest wrote), then snapshot it: %w",
			h.Name, errdefs.ErrFailedPrecondition)
	}
	over := func() error {
		st, err := os.Stat(cur)
		if err != nil {
			return err
		}
		if o.Max > 0 && st.Size() > o.Max {
			return fmt.Errorf("sandbox %s's disk changed by %d bytes since its start or last snapshot, over the bound of %d (--max-bytes, snap.max_bytes): %w",
				h.Name, st.Size(), o.Max, errdefs.ErrOutOfRange)
		}
		return nil
	}
	if err := over(); err != nil {
		return out, err
	}
	// A chain as long as it may be is flattened: the diff is the whole
	// disk, the ended top and every image under it, read-only once the
	// new top is stacked (the bound is on what the guest changed).
	out.Flat = o.Chain >= d.maxChain()
	size, err := virtualSize(ctx, cur)
	if err != nil {
		return out, err
	}
	if err := create(ctx, next, size); err != nil {
		return out, err
	}
	t0 := time.Now()
	if o.State != nil {
		out.Memory, err = v.SnapshotFull(ctx, o.State, TopNode(o.Depth), TopNode(o.Depth+1), next)
		if out.Memory != nil {
			out.Frozen = time.Duration(out.Memory.PausedNS)
		}
		var refused *vmm.NotStacked
		if errors.As(err, &refused) { // QEMU never opened next
			os.Remove(next)
		}
		// (The bound was checked before the guest flushed what it held
		// back: by then the new top is stacked, and the diff is taken.)
		if err != nil {
			return out, err
		}
	} else if out.Frozen, err = d.stack(ctx, v, o, t0, over); err != nil {
		return out, err
	}
	if out.Flat {
		if err := flatten(ctx, cur, o); err != nil {
			return out, fmt.Errorf("flatten sandbox %s's disk (a chain of %d images): %w", h.Name, o.Chain, err)
		}
		out.Commit = func() error { return os.Remove(cur) }
		return out, nil
	}
	f, err := os.Open(cur)
	if err != nil {
		return out, err
	}
	defer f.Close()
	if _, err := io.Copy(o.Diff, f); err != nil {
		return out, fmt.Errorf("copy the disk's diff: %w", err)
	}
	// No image of a chain names its backing file (a top an older dsec
	// made over its image does): the diff's header says none.
	if b, err := exec.CommandContext(ctx, "qemu-img", "rebase", "-q", "-u", "-b", "", "-f", "qcow2", o.Diff.Name()).CombinedOutput(); err != nil {
		return out, fmt.Errorf("the disk's diff: qemu-img rebase: %v: %s", err, strings.TrimSpace(string(b)))
	}
	out.Commit = func() error { return os.Remove(cur) }
	return out, nil
}

// flatten writes to o.Diff the whole disk the ended top cur holds over
// the chain (o.Images): one qcow2 image that names no backing file. The
// running QEMU holds them all open, read-only now: they are read
// without its locks. The guest runs on meanwhile, over its new top.
func flatten(ctx context.Context, cur string, o driver.DiskSnap) error {
	if o.Images == nil {
		return errors.New("no chain to flatten")
	}
	files, release, err := o.Images()
	if err != nil {
		return err
	}
	defer release()
	spec := chainSpec(append([]string{cur}, files...)...)
	if out, err := exec.CommandContext(ctx, "qemu-img", "convert", "-q", "-U", "-O", "qcow2", spec, o.Diff.Name()).CombinedOutput(); err != nil {
		return fmt.Errorf("qemu-img convert: %v: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// chainSpec is QEMU's json: name of the chain of qcow2 files, topmost
// first, each over the next (none naming its backing file).
func chainSpec(files ...string) string {
	var o any
	for i := len(files) - 1; i >= 0; i-- {
		o = map[string]any{"driver": "qcow2", "file": map[string]any{"driver": "file", "filename": files[i]}, "backing": o}
	}
	b, _ := json.Marshal(o)
	return "json:" + string(b)
}

// maxChain is the longest chain a snapshot leaves (Settings.MaxChain).
func (d *Driver) maxChain() int {
	if m := d.settings.MaxChain; m > 0 && m <= vm.MaxChain {
		return m
	}
	return vm.MaxChain
}

// stack stacks the new top over the running guest's disk, its root
// file system frozen meanwhile, for how long it returns.
func (d *Driver) stack(ctx context.Context, v *vmm.VM, o driver.DiskSnap, t0 time.Time, over func() error) (time.Duration, error) {
	next := topFile(o.Upper, o.Depth+1)
	if err := v.FreezeFS(ctx); err != nil {
		v.ThawFS(ctx) // one a snapshot its worker did not see end left frozen
		os.Remove(next)
		return 0, fmt.Errorf("freeze the guest's root file system (try again): %w", err)
	}
	// The freeze flushed what the guest held back: the bound again.
	if err := over(); err != nil {
		v.ThawFS(ctx)
		os.Remove(next)
		return time.Since(t0), err
	}
	err := v.SnapshotDisk(ctx, TopNode(o.Depth), TopNode(o.Depth+1), next)
	var refused *vmm.NotStacked
	if errors.As(err, &refused) { // QEMU never opened next
		os.Remove(next)
	}
	terr := v.ThawFS(ctx)
	for i := 0; terr != nil && i < 3; i++ {
		time.Sleep(100 * time.Millisecond)
		terr = v.ThawFS(ctx)
	}
	frozen := time.Since(t0)
	switch {
	case err != nil:
		return frozen, err
	case terr != nil:
		return frozen, fmt.Errorf("the guest's root file system did not thaw after its snapshot (%v): stop and start the sandbox: %w", terr, errdefs.ErrUnavailable)
	}
	return frozen, nil
}
