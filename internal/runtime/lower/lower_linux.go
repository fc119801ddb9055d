// Package lower holds a root's layers mounted for its sandboxes: one
// read-only mount per layer, shared by every sandbox on it, from the
// local store or lazily from a remote, with a user file per sandbox so
// that the last one out unmounts it, even across a worker's death.
package lower

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/lazy"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/mount"
)

// Every sandbox of a root that stands on a layer shares one read-only
// mount of it, <root>/lower/<digest prefix>/mnt: one EROFS super block,
// so one page cache for its files, and for a lazy layer one fetcher and
// one cache. users/ holds a file per sandbox using it; the last one out
// unmounts it. The files, not a count, make it survive a worker's death.
//
// Mounts are one root's: its lock orders every use of the user files,
// and it keeps the layers no sandbox uses mounted for a while (Keep).
// A process holds one per root (New).
type Mounts struct {
	root string

	mu sync.Mutex
	// Layers no sandbox uses stay mounted for keepFor (Keep): the next
	// sandbox on one skips its mount and finds its dentries and pages
	// cached, and the last sandbox's removal skips the unmount. kept
	// holds their unmount timers. A worker killed meanwhile leaves them
	// to the next one's Sweep (they have no users).
	keepFor time.Duration
	kept    map[string]*time.Timer
	// whole orders the mounts of a layer's whole image (Acquire's
	// Whole), a mutex per layer directory.
	whole sync.Map
}

// New returns the Mounts of root. A process holds one per root (a
// runtime Host's): two would order the user files each under its own
// lock.
func New(root string) *Mounts {
	abs, err := filepath.Abs(root)
	if err != nil {
		abs = filepath.Clean(root)
	}
	return &Mounts{root: abs, kept: map[string]*time.Timer{}}
}

func lowerDir(root, dgst string) string {
	hex := digest.Digest(dgst).Encoded()
	return filepath.Join(root, "lower", hex[:min(16, len(hex))])
}

// Acquire mounts the layer ref (if no sandbox has it mounted yet)
// for user and returns the mount and the layer Found. want, if set, is
// the digest the layer must have.
func (ms *Mounts) Acquire(ctx context.Context, src Source, ref, user, want string) (string, *Found, error) {
	f, err := Resolve(ctx, ms.root, src, ref, want)
	if err != nil {
		return "", nil, err
	}
	dgst := f.Digest
	if want != "" && dgst != want {
		return "", nil, fmt.Errorf("layer %s is now %s, not the %s the sandbox was made of: %w", ref, dgst, want, errdefs.ErrFailedPrecondition)
	}
	dir := lowerDir(ms.root, dgst)
	mnt := filepath.Join(dir, "mnt")
	ms.mu.Lock()
	defer ms.mu.Unlock()
	if err := os.MkdirAll(filepath.Join(dir, "users"), 0o700); err != nil {
		return "", nil, err
	}
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		return "", nil, err
	}
	// The user is recorded first: a worker killed here leaves a user
	// file Sweep finds, never a mount nobody owns.
	if err := os.WriteFile(filepath.Join(dir, "users", user), nil, 0o600); err != nil {
		return "", nil, err
	}
	if t := ms.kept[dir]; t != nil { // kept mounted since its last user left
		t.Stop()
		delete(ms.kept, dir)
	}
	if mounted, _ := mount.IsMountPoint(mnt); !mounted {
		if err := f.mountOn(mnt); err != nil {
			os.Remove(filepath.Join(dir, "users", user))
			return "", nil, err
		}
	}
	if f.wholeOn == nil { // the local store's layer: Whole is its own
		return mnt, f, nil
	}
	if _, err := os.Stat(filepath.Join(dir, "packed")); err == nil {
		// Mounted packed (now, or before the remote changed): the whole
		// image is mounted beside, lazily, the first time a microVM
		// asks: its fetcher lives while that mount does, and gives the
		// file the guest maps. Mounted whole, the mount's fetcher gives
		// it (Image).
		img := f.Image
		f.Image = ""
		f.Whole = func() (string, error) {
			// Not under ms.mu: a fetcher's start would hold every
			// other sandbox's mounts. The caller's user file keeps dir.
			l, _ := ms.whole.LoadOrStore(dir, new(sync.Mutex))
			l.(*sync.Mutex).Lock()
			defer l.(*sync.Mutex).Unlock()
			w := filepath.Join(dir, "whole")
			if mounted, _ := mount.IsMountPoint(w); mounted {
				return img, nil
			}
			if err := os.MkdirAll(w, 0o700); err != nil {
				return "", err
			}
			return img, f.wholeOn(w)
		}
	}
	return mnt, f, nil
}

// Sweep drops the layer users that are not among live (sandboxes
// a killed worker was creating or removing) and unmounts the layers
// nobody uses. Call it with the root's worker lock held, before any
// create.
func (ms *Mounts) Sweep(live []string) error {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	held, _ := filepath.Glob(filepath.Join(ms.root, "lower", "*", "users", "*"))
	var errs []error
	for _, h := range held {
		if !slices.Contains(live, filepath.Base(h)) {
			if err := os.Remove(h); err != nil {
				errs = append(errs, err)
			}
		}
	}
	dirs, _ := filepath.Glob(filepath.Join(ms.root, "lower", "*"))
	for _, dir := range dirs {
		if left, _ := os.ReadDir(filepath.Join(dir, "users")); len(left) > 0 {
			continue
		}
		if t := ms.kept[dir]; t != nil {
			t.Stop()
			delete(ms.kept, dir)
		}
		errs = append(errs, unmountLower(dir))
	}
	return errors.Join(errs...)
}

// Release lets go of every layer user stands on, unmounting those
// no other sandbox uses.
func (ms *Mounts) Release(user string) error {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	held, _ := filepath.Glob(filepath.Join(ms.root, "lower", "*", "users", user))
	var errs []error
	for _, h := range held {
		if err := os.Remove(h); err != nil {
			errs = append(errs, err)
			continue
		}
		dir := filepath.Dir(filepath.Dir(h))
		if left, _ := os.ReadDir(filepath.Join(dir, "users")); len(left) > 0 {
			continue
		}
		if ms.keepFor > 0 {
			ms.keep(dir)
			continue
		}
		if err := unmountLower(dir); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Keep keeps a layer mounted for d after its last sandbox lets go
// of it (0: unmounted at once, the default).
func (ms *Mounts) Keep(d time.Duration) {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	ms.keepFor = d
}

// keep schedules the unmount of dir, a layer nobody uses, keepFor from
// now. Call it with ms.mu held.
func (ms *Mounts) keep(dir string) {
	if t := ms.kept[dir]; t != nil {
		t.Stop()
	}
	var t *time.Timer
	t = time.AfterFunc(ms.keepFor, func() {
		ms.mu.Lock()
		defer ms.mu.Unlock()
		if ms.kept[dir] != t {
			return // taken again meanwhile
		}
		delete(ms.kept, dir)
		unmountLower(dir) // on an error, the next Sweep tries again
	})
	ms.kept[dir] = t
}

// ReleaseKept unmounts now the layers kept mounted without a user: a
// worker's last act.
func (ms *Mounts) ReleaseKept() error {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	var errs []error
	for dir, t := range ms.kept {
		t.Stop()
		delete(ms.kept, dir)
		errs = append(errs, unmountLower(dir))
	}
	return errors.Join(errs...)
}

// unmountLower unmounts a layer nobody uses and removes its directory.
func unmountLower(dir string) error {
	for _, mnt := range []string{filepath.Join(dir, "mnt"), filepath.Join(dir, "whole")} {
		if mounted, _ := mount.IsMountPoint(mnt); mounted {
			// lazy.Unmount also tells a lazy layer's fetcher it may go.
			if err := lazy.Unmount(mnt); err != nil && !mount.IsNotMounted(err) {
				return err
			}
		}
	}
	return os.RemoveAll(dir)
}

// Found is a layer Resolve found.
type Found struct {
	Digest  string
	Kind    layer.Kind
	Lineage *layer.Lineage // snapshots only
	// Image is the file a lazy layer's image is, for a microVM to map:
	// its fetcher's padded file (once it is mounted). For a layer of the
	// local store it is "", and Whole gives the file (store.Whole: it
	// stays the whole image if the store packs the layer meanwhile).
	Image   string
	Whole   func() (string, error)
	mountOn func(target string) error
	// wholeOn mounts a remote layer's whole image lazily: a microVM's
	// file when the layer is mounted packed (Acquire).
	wholeOn func(target string) error
}

// Source is where a root's layers come from: the local store, and for
// those missing there a remote, mounted lazily by fetchers Fetcher
// starts.
type Source struct {
	Store    *store.Store
	Remote   remote.Target
	Insecure bool
	Fetcher  lazy.Start
	Cache    lazy.Tuning // cache.max_bytes, cache.read_ahead_kb
}

// Resolve finds a layer in the local store (by want, the image it
// must be, when its tag is gone or names other content), or in the
// remote when the store lacks it, and says how to mount it (lazily
// from a remote).
func Resolve(ctx context.Context, root string, src Source, ref, want string) (*Found, error) {
	info, err := layer.ResolveImage(ctx, src.Store, ref, digest.Digest(want))
	if err == nil {
		d := info.Digest
		return &Found{Digest: d.String(), Kind: info.Kind, Lineage: info.Snapshot,
			Whole:   func() (string, error) { return src.Store.Whole(d) },
			mountOn: func(target string) error { return src.Store.MountLayer(d, target) }}, nil
	}
	if !errdefs.IsNotFound(err) || src.Remote == nil {
		return nil, err
	}
	r, err := layer.ParseRef(ref)
	if err != nil {
		return nil, err
	}
	l, err := remote.Describe(ctx, src.Remote, r)
	if err != nil {
		return nil, err
	}
	spec := lazy.SpecFor(r.String(), l, src.Remote, src.Insecure, src.Cache)
	whole := func(target string) error { return lazy.Mount(ctx, root, spec, l.Windows, target, src.Fetcher) }
	f := &Found{Digest: l.Blob.Digest.String(), Kind: l.Config.Kind, Lineage: l.Config.Snapshot, Image: lazy.PmemFile(lazy.Dir(root, l.Blob.Digest)), mountOn: whole, wholeOn: whole}
	if d, ok := src.Remote.(*remote.Dir); ok && d.Store().Packed(l.Blob.Digest) {
		// A dir: remote that packs its layers: the layer's metadata
		// image, with the chunk blobs it reads served each once per
		// host. A microVM maps the whole image (Acquire's Whole); the
		// marker beside the mount says how it was mounted.
		f.mountOn = func(target string) error {
			if err := lazy.MountPacked(ctx, root, d.Store(), spec, target, src.Fetcher); err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(filepath.Dir(target), "packed"), nil, 0o600)
		}
	}
	return f, nil
}

// Lineage reads a snapshot's Lineage from the store or the remote.
func Lineage(ctx context.Context, src Source, ref string) (*layer.Lineage, string, error) {
	f, err := Resolve(ctx, "", src, ref, "")
	if err != nil {
		return nil, "", err
	}
	if f.Lineage == nil {
		return nil, "", fmt.Errorf("layer %s is a %s layer, not a snapshot (dsec snap ls lists them): %w", ref, f.Kind, errdefs.ErrInvalidArgument)
	}
	return f.Lineage, f.Digest, nil
}
