package lazy_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/lazy"
)

// TestRemoteFaults: a blob missing from the remote fails the mount with
// a clear error; a remote blob that shrinks mid-use fails the reads it
// cannot serve; a full host disk makes the cache evict, and reads go on.
func TestRemoteFaults(t *testing.T) {
	src := dataTree(t)
	e := setup(t, src)
	blob := filepath.Join(e.remoteDir, "blobs", "sha256", e.info.Digest.Encoded())

	t.Run("missing blob", func(t *testing.T) {
		os.Rename(blob, blob+".away")
		defer os.Rename(blob+".away", blob)
		dir := t.TempDir()
		t.Setenv("DSEC_TEST_FETCHER", "1")
		err := lazy.Mount(context.Background(), e.root, e.spec(0), e.desc.Windows, dir, lazy.Start{Path: os.Args[0]})
		os.Unsetenv("DSEC_TEST_FETCHER")
		if err == nil || !strings.Contains(err.Error(), "no such file") {
			t.Fatalf("mount with the blob missing: %v", err)
		}
		if lazy.Users(lazy.Dir(e.root, e.info.Digest)) != 0 {
			t.Fatal("a failed mount left a mount behind")
		}
	})

	t.Run("store shrinks", func(t *testing.T) {
		dir := e.mount(t, 0)
		if _, err := os.ReadFile(filepath.Join(dir, "blob0")); err != nil {
			t.Fatal(err)
		}
		raw, _ := os.ReadFile(blob)
		defer func() { os.Chmod(blob, 0o644); os.WriteFile(blob, raw, 0o444) }()
		os.Chmod(blob, 0o644)
		if err := os.Truncate(blob, 2<<20); err != nil {
			t.Fatal(err)
		}
		if _, err := os.ReadFile(filepath.Join(dir, "blob7")); !errors.Is(err, syscall.EIO) {
			t.Fatalf("read past what the store still has: %v, want EIO", err)
		}
		e.umount(t, dir)
	})

	t.Run("full cache", func(t *testing.T) {
		full := &env{root: t.TempDir(), remoteDir: e.remoteDir, target: e.target, info: e.info, desc: e.desc, ref: e.ref}
		cacheDir := filepath.Join(full.root, "cache")
		os.MkdirAll(cacheDir, 0o755)
		// Room for the metadata windows and a little more.
		if err := unix.Mount("tmpfs", cacheDir, "tmpfs", 0, "size=6m"); err != nil {
			t.Fatal(err)
		}
		defer unix.Unmount(cacheDir, unix.MNT_DETACH)
		dir := full.mount(t, 0)
		for i := range 8 {
			got, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("blob%d", i)))
			exp, _ := os.ReadFile(filepath.Join(src, fmt.Sprintf("blob%d", i)))
			if err != nil || !bytes.Equal(got, exp) {
				t.Fatalf("blob%d with a full disk: %v", i, err)
			}
		}
		s, err := lazy.ReadStats(full.root, full.info.Digest)
		if err != nil || s.Evictions == 0 {
			t.Fatalf("a 6 MiB disk held a 12 MiB layer without evicting: %+v %v", s, err)
		}
		full.umount(t, dir)
	})
}

// TestHostWideBudget: cache.max_bytes bounds the host cache across
// layers; the cache of a layer nothing mounts goes first.
func TestHostWideBudget(t *testing.T) {
	src := dataTree(t)
	a := setup(t, src)
	os.WriteFile(filepath.Join(src, "other"), []byte("a second layer"), 0o644)
	b := setup(t, src)
	b.root = a.root // one host
	dirA := a.mount(t, 0)
	for i := range 8 {
		os.ReadFile(filepath.Join(dirA, fmt.Sprintf("blob%d", i)))
	}
	a.umount(t, dirA)
	imgA := filepath.Join(lazy.Dir(a.root, a.info.Digest), "image")
	var st syscall.Stat_t
	if err := syscall.Stat(imgA, &st); err != nil || st.Blocks*512 < 12<<20 {
		t.Fatalf("layer a's cache holds %d bytes", st.Blocks*512)
	}
	dirB := b.mount(t, 16<<20)
	for i := range 8 {
		got, err := os.ReadFile(filepath.Join(dirB, fmt.Sprintf("blob%d", i)))
		exp, _ := os.ReadFile(filepath.Join(src, fmt.Sprintf("blob%d", i)))
		if err != nil || !bytes.Equal(got, exp) {
			t.Fatalf("blob%d: %v", i, err)
		}
	}
	if err := syscall.Stat(imgA, &st); err == nil && st.Blocks > 0 {
		t.Fatalf("the idle layer's cache (%d bytes) was kept over a full budget", st.Blocks*512)
	}
}

// TestConcurrentMountsShareOneFetcher: mounts racing to start the same
// layer's fetcher all succeed on one fetcher.
func TestConcurrentMountsShareOneFetcher(t *testing.T) {
	e := setup(t, dataTree(t))
	t.Setenv("DSEC_TEST_FETCHER", "1")
	dirs := make([]string, 4)
	errs := make(chan error, len(dirs))
	for i := range dirs {
		dirs[i] = t.TempDir()
		go func(d string) {
			errs <- lazy.Mount(context.Background(), e.root, e.spec(0), e.desc.Windows, d, lazy.Start{Path: os.Args[0]})
		}(dirs[i])
	}
	for range dirs {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	os.Unsetenv("DSEC_TEST_FETCHER")
	for _, d := range dirs {
		t.Cleanup(func() { e.umount(t, d) })
	}
	if n := lazy.Users(lazy.Dir(e.root, e.info.Digest)); n != len(dirs) {
		t.Fatalf("%d mounts, want %d", n, len(dirs))
	}
}

// A mount that comes while the layer's fetcher is on its way out (idle,
// its ready file gone, its lock still held) starts a new fetcher once the
// lock is free, and does not wait for the one leaving.
func TestMountWhileFetcherLeaves(t *testing.T) {
	e := setup(t, dataTree(t))
	cache := lazy.Dir(e.root, e.info.Digest)
	if err := os.MkdirAll(cache, 0o700); err != nil {
		t.Fatal(err)
	}
	lock, err := os.OpenFile(filepath.Join(cache, "fetcher.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil { // the leaving fetcher's
		t.Fatal(err)
	}
	time.AfterFunc(500*time.Millisecond, func() { lock.Close() }) // it exits
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	dir := t.TempDir()
	t.Setenv("DSEC_TEST_FETCHER", "1")
	start := time.Now()
	err = lazy.Mount(ctx, e.root, e.spec(0), e.desc.Windows, dir, lazy.Start{Path: os.Args[0]})
	os.Unsetenv("DSEC_TEST_FETCHER")
	if err != nil {
		t.Fatalf("mount while the fetcher left: %v", err)
	}
	t.Cleanup(func() { e.umount(t, dir) })
	t.Logf("mounted %v after the call, the lock freed at 500ms", time.Since(start).Round(time.Millisecond))
	if b, err := os.ReadFile(filepath.Join(dir, "blob3")); err != nil || len(b) == 0 {
		t.Fatalf("read through the new fetcher: %d bytes, %v", len(b), err)
	}
}

// A fetcher told to exit (its last mount went) still serves a mount that
// comes soon after: it waits a moment (termGrace) before it counts its
// mounts, for a mount that found it ready just before the signal.
func TestFetcherTermGrace(t *testing.T) {
	e := setup(t, dataTree(t))
	cache := lazy.Dir(e.root, e.info.Digest)
	t.Setenv("DSEC_TEST_FETCHER_IDLE", "1m") // only the signal ends it
	// A grace longer than the real one's second: a new mount on a loaded
	// CI host took longer than that to come.
	const grace = 3 * time.Second
	t.Setenv("DSEC_TEST_FETCHER_GRACE", grace.String())
	a := e.mountWith(t, func(*lazy.Spec) {})
	pid := pidOf(cache)
	if err := unix.Unmount(a, 0); err != nil { // not lazy.Unmount: the test sends the signal
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // the signal is handled; the mount comes within the grace
	b := e.mount(t, 0)
	if got := pidOf(cache); got != pid {
		t.Errorf("the mount after SIGTERM is served by fetcher %d, not %d", got, pid)
	}
	if data, err := os.ReadFile(filepath.Join(b, "blob3")); err != nil || len(data) == 0 {
		t.Fatalf("read after SIGTERM: %d bytes, %v", len(data), err)
	}
	time.Sleep(grace + 500*time.Millisecond) // past the grace
	if err := syscall.Kill(pid, 0); err != nil {
		t.Fatalf("fetcher %d exited with a mount using it: %v", pid, err)
	}
}

// TestFreshMountFetchesMetadataOnly: a layer built without --order has
// no hot region, from any source (issue 29, item 1: tar streams and
// image archives carried one spanning all their data, so every lazy
// mount fetched them whole); a fresh lazy mount fetches block 0 and the
// metadata region, and a listing of every path stays within them.
func TestFreshMountFetchesMetadataOnly(t *testing.T) {
	layertest.RequireRoot(t)
	tree := dataTree(t)
	var tb bytes.Buffer
	layertest.WriteTar(t, tree, &tb)
	gzb, zst := layertest.Compressed(tb.Bytes())
	files := t.TempDir()
	sources := map[string]string{"dir": tree}
	for kind, b := range map[string][]byte{"tar": tb.Bytes(), "tar.gz": gzb, "tar.zst": zst,
		"docker archive": layertest.DockerArchive(tb.Bytes()), "OCI archive": layertest.OCIArchive(false, tb.Bytes())} {
		p := filepath.Join(files, strings.ReplaceAll(kind, " ", "-"))
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		sources[kind] = p
	}
	for kind, src := range sources {
		t.Run(strings.ReplaceAll(kind, " ", "-"), func(t *testing.T) {
			e := setup(t, src)
			if e.info.Hot != nil || e.desc.Config.Hot != nil {
				t.Fatalf("a hot region %+v without --order", e.info.Hot)
			}
			w := e.info.Windows.Size
			m := e.info.Metadata
			allowed := map[int64]bool{0: true}
			for o := m.Offset / w * w; o < m.Offset+m.Size; o += w {
				allowed[o/w] = true
			}
			dir := e.mount(t, 0)
			for p := range layertest.ScanDir(t, tree) {
				if _, err := os.Lstat(filepath.Join(dir, p)); err != nil {
					t.Fatal(err)
				}
			}
			if s := stats(t, e); s.WindowsFetched > int64(len(allowed)) || s.BytesFetched >= e.info.Size/2 {
				t.Fatalf("a fresh mount and a listing fetched %d windows (%d bytes) of %d; block 0 and the metadata are %d windows",
					s.WindowsFetched, s.BytesFetched, e.info.Windows.Count, len(allowed))
			}
		})
	}
}

// TestMountAsFetcherExits: mounts that come just as the layer's idle
// fetcher exits (each at another point of its 250 ms tick) each end on a
// fetcher that serves them: the one leaving, which stays for them, or a
// new one; never on one that left.
func TestMountAsFetcherExits(t *testing.T) {
	e := setup(t, dataTree(t))
	t.Setenv("DSEC_TEST_FETCHER_IDLE", "1ms")
	for i := range 24 {
		a := e.mountWith(t, func(*lazy.Spec) {})
		if err := unix.Unmount(a, 0); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(i) * 12 * time.Millisecond)
		b := e.mountWith(t, func(*lazy.Spec) {})
		data, err := os.ReadFile(filepath.Join(b, "blob3"))
		e.umount(t, b)
		if err != nil || len(data) == 0 {
			t.Fatalf("mounted %v after the last went: read %d bytes, %v", time.Duration(i)*12*time.Millisecond, len(data), err)
		}
	}
}
