package runtime

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
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/lazy"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/mount"
)

// Every sandbox of a root that stands on a layer shares one read-only
// mount of it, <root>/lower/<digest prefix>/mnt: one EROFS super block,
// so one page cache for its files, and for a lazy layer one fetcher and
// one cache. users/ holds a file per sandbox using it; the last one out
// unmounts it. The files, not a count, make it survive a worker's death.
var lowerMu sync.Mutex

func lowerDir(root, dgst string) string {
	hex := digest.Digest(dgst).Encoded()
	return filepath.Join(root, "lower", hex[:min(16, len(hex))])
}

// acquireLower mounts the layer ref (if no sandbox has it mounted yet)
// for user and returns the mount and the layer found. want, if set, is
// the digest the layer must have.
func acquireLower(ctx context.Context, root string, m Mounter, ref, user, want string) (string, *found, error) {
	f, err := resolveLayer(ctx, root, m, ref, want)
	if err != nil {
		return "", nil, err
	}
	dgst := f.digest
	if want != "" && dgst != want {
		return "", nil, fmt.Errorf("layer %s is now %s, not the %s the sandbox was made of: %w", ref, dgst, want, errdefs.ErrFailedPrecondition)
	}
	dir := lowerDir(root, dgst)
	mnt := filepath.Join(dir, "mnt")
	lowerMu.Lock()
	defer lowerMu.Unlock()
	if err := os.MkdirAll(filepath.Join(dir, "users"), 0o700); err != nil {
		return "", nil, err
	}
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		return "", nil, err
	}
	// The user is recorded first: a worker killed here leaves a user
	// file SweepLowers finds, never a mount nobody owns.
	if err := os.WriteFile(filepath.Join(dir, "users", user), nil, 0o600); err != nil {
		return "", nil, err
	}
	if t := kept[dir]; t != nil { // kept mounted since its last user left
		t.Stop()
		delete(kept, dir)
	}
	if !isMountpoint(mnt) {
		if err := f.mountOn(mnt); err != nil {
			os.Remove(filepath.Join(dir, "users", user))
			return "", nil, err
		}
	}
	return mnt, f, nil
}

// SweepLowers drops the layer users that are not among live (sandboxes
// a killed worker was creating or removing) and unmounts the layers
// nobody uses. Call it with the root's worker lock held, before any
// create.
func SweepLowers(root string, live []string) error {
	held, _ := filepath.Glob(filepath.Join(root, "lower", "*", "users", "*"))
	var errs []error
	for _, h := range held {
		if !slices.Contains(live, filepath.Base(h)) {
			if err := os.Remove(h); err != nil {
				errs = append(errs, err)
			}
		}
	}
	dirs, _ := filepath.Glob(filepath.Join(root, "lower", "*"))
	for _, dir := range dirs {
		if left, _ := os.ReadDir(filepath.Join(dir, "users")); len(left) > 0 {
			continue
		}
		errs = append(errs, unmountLower(dir))
	}
	return errors.Join(errs...)
}

// releaseLowers lets go of every layer user stands on, unmounting those
// no other sandbox uses.
func releaseLowers(root, user string) error {
	lowerMu.Lock()
	defer lowerMu.Unlock()
	held, _ := filepath.Glob(filepath.Join(root, "lower", "*", "users", user))
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
		if keepFor > 0 {
			keep(dir)
			continue
		}
		if err := unmountLower(dir); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Layers no sandbox uses stay mounted for keepFor (KeepLayers): the next
// sandbox on one skips its mount and finds its dentries and pages
// cached, and the last sandbox's removal skips the unmount. kept holds
// their unmount timers; both under lowerMu. A worker killed meanwhile
// leaves them to the next one's SweepLowers (they have no users).
var (
	keepFor time.Duration
	kept    = map[string]*time.Timer{}
)

// KeepLayers keeps a layer mounted for d after its last sandbox lets go
// of it (0: unmounted at once, the default).
func KeepLayers(d time.Duration) {
	lowerMu.Lock()
	defer lowerMu.Unlock()
	keepFor = d
}

// keep schedules the unmount of dir, a layer nobody uses, keepFor from
// now. Call it with lowerMu held.
func keep(dir string) {
	if t := kept[dir]; t != nil {
		t.Stop()
	}
	var t *time.Timer
	t = time.AfterFunc(keepFor, func() {
		lowerMu.Lock()
		defer lowerMu.Unlock()
		if kept[dir] != t {
			return // taken again meanwhile
		}
		delete(kept, dir)
		unmountLower(dir) // on an error, the next SweepLowers tries again
	})
	kept[dir] = t
}

// ReleaseLayers unmounts now the layers under root kept mounted without
// a user: a worker's last act.
func ReleaseLayers(root string) error {
	lowerMu.Lock()
	defer lowerMu.Unlock()
	var errs []error
	for dir, t := range kept {
		if filepath.Dir(filepath.Dir(dir)) != filepath.Clean(root) {
			continue
		}
		t.Stop()
		delete(kept, dir)
		errs = append(errs, unmountLower(dir))
	}
	return errors.Join(errs...)
}

// unmountLower unmounts a layer nobody uses and removes its directory.
func unmountLower(dir string) error {
	mnt := filepath.Join(dir, "mnt")
	if isMountpoint(mnt) {
		// lazy.Unmount also tells a lazy layer's fetcher it may go.
		if err := lazy.Unmount(mnt); err != nil && !isNotMounted(err) {
			return err
		}
	}
	return os.RemoveAll(dir)
}

func isMountpoint(p string) bool {
	var st, parent unix.Stat_t
	if unix.Lstat(p, &st) != nil || unix.Lstat(filepath.Dir(p), &parent) != nil {
		return false
	}
	return st.Dev != parent.Dev
}

// found is a layer resolveLayer found.
type found struct {
	digest  string
	kind    layer.Kind
	lineage *layer.Lineage // snapshots only
	mountOn func(target string) error
}

// resolveLayer finds a layer in the local store (by want, the image it
// must be, when its tag is gone or names other content), or in the
// remote when the store lacks it, and says how to mount it (lazily
// from a remote).
func resolveLayer(ctx context.Context, root string, m Mounter, ref, want string) (*found, error) {
	info, err := layer.ResolveImage(ctx, m.Store, ref, digest.Digest(want))
	if err == nil {
		return &found{info.Digest.String(), info.Kind, info.Snapshot, mount.EROFS(m.Store.BlobPath(info.Digest)).Mount}, nil
	}
	if !errdefs.IsNotFound(err) || m.Remote == nil {
		return nil, err
	}
	r, err := layer.ParseRef(ref)
	if err != nil {
		return nil, err
	}
	l, err := remote.Describe(ctx, m.Remote, r)
	if err != nil {
		return nil, err
	}
	spec := lazy.SpecFor(r.String(), l, m.Remote, m.Insecure, m.Cache)
	return &found{l.Blob.Digest.String(), l.Config.Kind, l.Config.Snapshot, func(target string) error {
		return lazy.Mount(ctx, root, spec, l.Windows, target, m.Fetcher)
	}}, nil
}

// lineage reads a snapshot's lineage from the store or the remote.
func lineage(ctx context.Context, m Mounter, ref string) (*layer.Lineage, string, error) {
	f, err := resolveLayer(ctx, "", m, ref, "")
	if err != nil {
		return nil, "", err
	}
	if f.lineage == nil {
		return nil, "", fmt.Errorf("layer %s is a %s layer, not a snapshot (dsec snap ls lists them): %w", ref, f.kind, errdefs.ErrInvalidArgument)
	}
	return f.lineage, f.digest, nil
}
