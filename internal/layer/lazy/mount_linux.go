package lazy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/dedup"
	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/mount"
)

// Start describes how to start a fetcher process for a cache directory:
// the command and arguments, to which the directory is appended.
type Start struct {
	Path string
	Args []string
}

// Mount mounts a layer lazily on target. It writes the layer's spec and
// window table to its cache directory, starts the layer's fetcher unless
// one already serves it (one fetcher and one cache per layer per host,
// shared by every mount), and mounts EROFS on the fetcher's file.
func Mount(ctx context.Context, root string, spec Spec, table []byte, target string, start Start) error {
	dir := Dir(root, spec.Digest)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if spec.Record && ready(dir) {
		return fmt.Errorf("layer %s is already mounted on this host and its fetcher is not recording: unmount its mounts, then mount it with --record: %w", spec.Ref, errdefs.ErrFailedPrecondition)
	}
	return served(ctx, dir, spec, table, start, "mounted", func(image string) (func(), error) {
		if err := mount.EROFS(image).Mount(target); err != nil {
			return nil, err
		}
		return func() { mount.Unmount(target) }, nil
	}, func() error {
		if err := setReadAhead(target, spec.ReadAheadKB); err != nil {
			mount.Unmount(target)
			return err
		}
		return nil
	})
}

// MountPacked mounts layer spec, which the store s of a dir: remote
// keeps packed (store.Pack), lazily on target: its metadata image,
// copied whole into the layer's cache directory (it holds no file
// data), with its chunk blobs as devices. Each chunk blob is served by a
// fetcher of its own and cached once on the host, whichever layers read
// it: a chunk two layers share is fetched once, and the page cache holds
// it once. A chunk blob's fetcher lives while a mount holds its file
// open (the kernel holds a device open for as long as the mount lasts).
// Its windows are checked against the blob's table (store.ChunkBlob);
// the metadata image and the list of blobs are trusted as the remote's
// tags are.
func MountPacked(ctx context.Context, root string, s *store.Store, spec Spec, target string, start Start) error {
	meta, devs, extents, err := s.PackedLayer(spec.Digest)
	if err != nil {
		return fmt.Errorf("layer %s in %s: %w", spec.Ref, spec.Remote, err)
	}
	dir := Dir(root, spec.Digest)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	local := filepath.Join(dir, "meta.erofs")
	if err := copyIfChanged(meta, local); err != nil {
		return fmt.Errorf("layer %s: its metadata image: %w", spec.Ref, err)
	}
	if err := writeJSON(filepath.Join(dir, "packed.json"), packedSpec{Ref: spec.Ref, Digest: spec.Digest, Devices: devs}); err != nil {
		return err
	}
	// The chunk blobs' fetchers start side by side: each fetches its
	// first window before it serves.
	paths, holds, errs := make([]string, len(devs)), make([]*os.File, len(devs)), make([]error, len(devs))
	var wg sync.WaitGroup
	for i, x := range devs {
		wg.Go(func() {
			_, size, table, err := s.ChunkBlob(x)
			if err != nil {
				errs[i] = fmt.Errorf("layer %s in %s: %w", spec.Ref, spec.Remote, err)
				return
			}
			c := spec
			c.Ref, c.Digest, c.Size, c.Chunk, c.Raw = "chunks of "+spec.Ref, x, size, true, true
			// The part of the layer's hot region this blob holds, if
			// together: prefetched by its fetcher, if this mount
			// starts it.
			c.Metadata, c.Hot, c.Record = erofs.Region{}, dedup.HotIn(extents, spec.Hot, x), false
			c.Windows = layer.Windows{Size: dedup.WindowSize, Count: len(table) / 32, Digest: digest.FromBytes(table)}
			paths[i], holds[i], errs[i] = ServeFile(ctx, root, c, table, start)
		})
	}
	wg.Wait()
	defer func() { // once mounted, the mount holds the files open
		for _, h := range holds {
			if h != nil {
				h.Close()
			}
		}
	}()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if err := mount.EROFSDevices(local, paths).Mount(target); err != nil {
		return err
	}
	if err := setReadAhead(target, spec.ReadAheadKB); err != nil {
		mount.Unmount(target)
		return err
	}
	return nil
}

// copyIfChanged copies src to dst unless dst holds its bytes already.
func copyIfChanged(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return writeIfChanged(dst, b)
}

// ServeFile serves a blob lazily as a file for a reader that opens it
// by its path (QEMU, a full VM's disk read from a remote): it writes the
// blob's spec and window table to its cache directory, starts its
// fetcher unless one serves it, and returns the FUSE file's path with a
// handle of it open. The fetcher serves while the file is open anywhere
// or mounted: the caller closes the handle once the reader has the file
// open.
func ServeFile(ctx context.Context, root string, spec Spec, table []byte, start Start) (string, *os.File, error) {
	root, err := filepath.Abs(root) // (the reader's path)
	if err != nil {
		return "", nil, err
	}
	dir := Dir(root, spec.Digest)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", nil, err
	}
	var f *os.File
	err = served(ctx, dir, spec, table, start, "opened", func(image string) (func(), error) {
		var err error
		if f, err = os.Open(image); err != nil {
			return nil, err
		}
		return func() { f.Close() }, nil
	}, nil)
	if err != nil {
		return "", nil, err
	}
	return f.Name(), f, nil
}

// served writes spec and its window table to the cache directory dir,
// starts its fetcher unless one serves it, and has use take the
// fetcher's file (mount or open it), then done (nil: nothing). A
// fetcher found ready may be on its way out (no user for its idle
// time): once taken, the file has its user if the fetcher is still
// ready; if not, it left (or is leaving), use is undone, and another
// fetcher is started.
func served(ctx context.Context, dir string, spec Spec, table []byte, start Start, what string, use func(image string) (undo func(), err error), done func() error) error {
	if err := writeIfChanged(filepath.Join(dir, "windows"), table); err != nil {
		return err
	}
	if err := writeJSON(filepath.Join(dir, "layer.json"), spec); err != nil {
		return err
	}
	for try := 0; ; try++ {
		if !ready(dir) {
			if err := startFetcher(ctx, dir, start); err != nil {
				return err
			}
		}
		pid := fetcherPID(dir)
		undo, err := use(filepath.Join(dir, "fuse", "image"))
		still := ready(dir) && fetcherPID(dir) == pid
		switch {
		case err != nil && still:
			return err
		case err == nil && still:
			if done != nil {
				return done()
			}
			return nil
		case err == nil:
			undo()
		}
		if try == 10 {
			return fmt.Errorf("%s: its fetcher kept exiting as its file was %s: %s", spec.Ref, what, lastLine(filepath.Join(dir, "fetcher.log")))
		}
	}
}

// fsIocGetFSSysfsPath is FS_IOC_GETFSSYSFSPATH (Linux 6.9): the name of a
// mounted file system under /sys/fs, which EROFS also gives the backing
// device info of a file-backed mount (/sys/class/bdi/erofs-N).
const fsIocGetFSSysfsPath = 0x80811501

// setReadAhead sets the kernel's read-ahead of the EROFS mount on target.
// Each file-backed mount has a backing device info of its own, so this
// touches no other mount. A kernel without the ioctl keeps its default.
func setReadAhead(target string, kb int) error {
	f, err := os.Open(target)
	if err != nil {
		return err
	}
	defer f.Close()
	var buf [129]byte // struct fs_sysfs_path: u8 len, u8 name[128]
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), fsIocGetFSSysfsPath, uintptr(unsafe.Pointer(&buf[0]))); e != 0 {
		if e == unix.ENOTTY {
			return nil
		}
		return fmt.Errorf("find the EROFS mount on %s under /sys/fs: %w", target, e)
	}
	name := string(buf[1 : 1+min(int(buf[0]), 128)]) // "erofs/erofs-N"
	p := filepath.Join("/sys/class/bdi", filepath.Base(name), "read_ahead_kb")
	if err := os.WriteFile(p, []byte(strconv.Itoa(kb)), 0); err != nil {
		return fmt.Errorf("set the read-ahead of %s: %w", target, err)
	}
	return nil
}

func writeIfChanged(p string, b []byte) error {
	if cur, err := os.ReadFile(p); err == nil && bytes.Equal(cur, b) {
		return nil
	}
	return writeAtomic(p, b)
}

// ready reports whether a live fetcher serves dir.
func ready(dir string) bool {
	if _, err := os.Stat(filepath.Join(dir, "fetcher.ready")); err != nil {
		return false
	}
	pid := fetcherPID(dir)
	return pid > 0 && syscall.Kill(pid, 0) == nil
}

func fetcherPID(dir string) int {
	b, err := os.ReadFile(filepath.Join(dir, "fetcher.pid"))
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return pid
}

// startFetcher runs the fetcher in a session of its own, so it outlives
// the command that started it, and waits until its FUSE file is served.
// A fetcher that finds the layer's lock held exits cleanly: another one
// serves the layer, is about to, or is on its way out (no mount used it
// for its idle time). For that last, a new one starts once the lock is
// free and no fetcher is ready.
func startFetcher(ctx context.Context, dir string, start Start) error {
	os.Remove(filepath.Join(dir, "fetcher.ready"))
	exited, err := launchFetcher(dir, start)
	if err != nil {
		return err
	}
	deadline := time.NewTimer(2 * time.Minute)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-exited:
			if err != nil {
				return fmt.Errorf("fetcher for %s exited (%v): %s", dir, err, lastLine(filepath.Join(dir, "fetcher.log")))
			}
			exited = nil
		case <-deadline.C:
			return fmt.Errorf("fetcher for %s did not become ready in 2 minutes: %s", dir, lastLine(filepath.Join(dir, "fetcher.log")))
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
			if _, err := os.Stat(filepath.Join(dir, "fetcher.ready")); err == nil {
				return nil // the process lives on; Wait's goroutine ends with us
			}
			if exited == nil && lockFree(dir) {
				if exited, err = launchFetcher(dir, start); err != nil {
					return err
				}
			}
		}
	}
}

// launchFetcher starts a fetcher for dir; its exit arrives on the channel.
func launchFetcher(dir string, start Start) (<-chan error, error) {
	logf, err := os.OpenFile(filepath.Join(dir, "fetcher.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd := exec.Command(start.Path, append(append([]string(nil), start.Args...), dir)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start fetcher: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	return exited, nil
}

// lockFree reports whether no fetcher holds dir's lock (Serve's flock).
func lockFree(dir string) bool {
	f, err := os.OpenFile(filepath.Join(dir, "fetcher.lock"), os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return false
	}
	defer f.Close() // the lock goes with the file
	return unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil
}

func lastLine(p string) string {
	b, _ := os.ReadFile(p)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return lines[len(lines)-1]
}

// Unmount unmounts a lazily mounted layer and tells its fetcher, which
// exits once no mount uses it.
func Unmount(target string) error {
	src := mountSource(target)
	if err := mount.Unmount(target); err != nil {
		return err
	}
	if strings.HasSuffix(src, "/fuse/image") {
		dir := filepath.Dir(filepath.Dir(src))
		if pid := fetcherPID(dir); pid > 0 && Users(dir) == 0 {
			syscall.Kill(pid, syscall.SIGTERM)
		}
	}
	return nil
}

// mountSource returns the source of the mount on target, if any.
func mountSource(target string) string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if ok && len(f) > 4 && f[4] == target && len(g) > 1 {
			return g[1]
		}
	}
	return ""
}

func readJSON(p string, v any) error {
	b, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%s is missing: mount the layer again", p)
	}
	if err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}
