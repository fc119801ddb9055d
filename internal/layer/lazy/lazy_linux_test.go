package lazy_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/lazy"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// TestMain doubles as the fetcher process the mounts start.
func TestMain(m *testing.M) {
	if os.Getenv("DSEC_TEST_FETCHER") == "1" {
		log := slog.New(slog.NewTextHandler(os.Stderr, nil))
		idle := 300 * time.Millisecond
		if d, err := time.ParseDuration(os.Getenv("DSEC_TEST_FETCHER_IDLE")); err == nil {
			idle = d
		}
		if d, err := time.ParseDuration(os.Getenv("DSEC_TEST_FETCHER_GRACE")); err == nil {
			lazy.SetTermGrace(d)
		}
		err := lazy.Serve(context.Background(), os.Args[len(os.Args)-1], idle, log)
		if err != nil && !errors.Is(err, lazy.ErrBusy) {
			fmt.Fprintln(os.Stderr, "fetcher:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

type env struct {
	root, remoteDir string
	target          remote.Target
	info            *layer.Info
	desc            *remote.Layer
	ref             layer.Ref
}

// setup builds src into a local store, pushes it to a dir: remote and
// describes it from there.
func setup(t *testing.T, src string) *env {
	t.Helper()
	layertest.RequireRoot(t)
	ctx := context.Background()
	root := t.TempDir()
	t.Cleanup(func() { detachLeft(t, root) }) // before the directory goes
	s, err := store.Open(filepath.Join(root, "store"))
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := layer.ParseRef("lazy/test:1")
	info, err := layer.Build(ctx, s, layer.BuildOptions{Source: src, Kind: layer.KindBase, Ref: ref})
	if err != nil {
		t.Fatal(err)
	}
	rdir := filepath.Join(t.TempDir(), "remote")
	target, err := remote.Open("dir://"+rdir, remote.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := remote.Copy(ctx, remote.Local(s), target, ref, false, nil); err != nil {
		t.Fatal(err)
	}
	desc, err := remote.Describe(ctx, target, ref)
	if err != nil {
		t.Fatal(err)
	}
	return &env{root: filepath.Join(root, "host"), remoteDir: rdir, target: target, info: info, desc: desc, ref: ref}
}

func (e *env) spec(maxBytes int64) lazy.Spec {
	return lazy.SpecFor(e.ref.String(), e.desc, e.target, false, lazy.Tuning{MaxBytes: maxBytes, ReadAheadKB: lazy.DefaultReadAheadKB})
}

// mount mounts the layer lazily and unmounts it, waiting for the fetcher
// to exit, when the test ends.
func (e *env) mount(t *testing.T, maxBytes int64) string {
	t.Helper()
	dir := e.mountWith(t, func(s *lazy.Spec) { s.MaxBytes = maxBytes })
	t.Cleanup(func() { e.umount(t, dir) })
	return dir
}

// mountWith mounts the layer lazily with a spec edit applies to; the
// caller unmounts it.
func (e *env) mountWith(t *testing.T, edit func(*lazy.Spec)) string {
	t.Helper()
	dir := t.TempDir()
	spec := e.spec(0)
	edit(&spec)
	t.Setenv("DSEC_TEST_FETCHER", "1")
	err := lazy.Mount(context.Background(), e.root, spec, e.desc.Windows, dir, lazy.Start{Path: os.Args[0]})
	os.Unsetenv("DSEC_TEST_FETCHER")
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

func (e *env) umount(t *testing.T, dir string) {
	cache := lazy.Dir(e.root, e.info.Digest)
	pid := pidOf(cache)
	if err := lazy.Unmount(dir); err != nil && !errors.Is(err, unix.EINVAL) {
		t.Error(err)
	}
	if lazy.Users(cache) == 0 {
		waitGone(t, pid)
	}
}

func pidOf(cache string) int {
	b, _ := os.ReadFile(filepath.Join(cache, "fetcher.pid"))
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return pid
}

// detachLeft detaches what is still mounted below root when a test
// ends, deepest first, and fails the test for it: a fetcher killed
// because it did not exit (waitGone) leaves its FUSE mount behind.
func detachLeft(t *testing.T, root string) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Error(err)
		return
	}
	var left []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], root+"/") {
			left = append(left, f[4])
		}
	}
	slices.SortFunc(left, func(a, b string) int { return len(b) - len(a) })
	for _, m := range left {
		t.Errorf("left mounted at the test's end: %s", m)
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil {
			t.Errorf("detach %s: %v", m, err)
		}
	}
}

// waitGone waits for a fetcher the test started to exit; one that does
// not is killed, and its FUSE mount detached by setup's cleanup.
func waitGone(t *testing.T, pid int) {
	if pid <= 0 {
		return
	}
	deadline := time.Now().Add(10 * time.Second)
	for syscall.Kill(pid, 0) == nil {
		if time.Now().After(deadline) {
			t.Errorf("fetcher %d still running", pid)
			syscall.Kill(pid, syscall.SIGKILL)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func stats(t *testing.T, e *env) lazy.Stats {
	t.Helper()
	time.Sleep(400 * time.Millisecond) // the fetcher writes stats every 250 ms
	s, err := lazy.ReadStats(e.root, e.info.Digest)
	if err != nil {
		t.Fatal(err)
	}
	return *s
}

func dataTree(t *testing.T) string {
	src := t.TempDir()
	r := rand.New(rand.NewSource(1))
	for i := range 8 {
		b := make([]byte, 1<<20+512<<10)
		r.Read(b)
		os.WriteFile(filepath.Join(src, fmt.Sprintf("blob%d", i)), b, 0o644)
	}
	for i := range 50 {
		os.WriteFile(filepath.Join(src, fmt.Sprintf("small%02d", i)), []byte(strings.Repeat("x", i*100)), 0o644)
	}
	return src
}

// TestFetchSizes: a read's miss fetches about what it needs, not a large
// window whatever the access: a lone 4 KiB read fetches 128 KiB; a second
// miss in the same 1 MiB of the image fetches the rest of it (read ahead:
// later reads there are cached); a file read in order comes in requests
// of several windows each.
func TestFetchSizes(t *testing.T) {
	layertest.RequireRoot(t)
	src := t.TempDir()
	r := rand.New(rand.NewSource(2))
	data := map[string][]byte{"seq": make([]byte, 6<<20), "sparse": make([]byte, 24<<20)}
	for name, b := range data {
		r.Read(b)
		if err := os.WriteFile(filepath.Join(src, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	e := setup(t, src)
	if e.info.Windows.Size != layer.WindowSize {
		t.Fatalf("windows of %d bytes, want %d", e.info.Windows.Size, layer.WindowSize)
	}
	dir := e.mount(t, 0)
	f, err := os.Open(filepath.Join(dir, "sparse"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	start, err := lazy.PhysicalStart(filepath.Join(dir, "sparse"))
	if err != nil {
		t.Fatal(err)
	}
	read := func(off int64) {
		t.Helper()
		buf := make([]byte, 4096)
		if _, err := f.ReadAt(buf, off); err != nil || !bytes.Equal(buf, data["sparse"][off:off+4096]) {
			t.Fatalf("read at %d: %v, or other bytes than the source's", off, err)
		}
	}
	const mib = 1 << 20
	var offs []int64 // 320 KiB into six regions (1 MiB of the image each) of the file's
	for i := range int64(6) {
		offs = append(offs, (start/mib+2+3*i)*mib+320<<10-start)
	}
	s0 := stats(t, e)
	for _, o := range offs {
		read(o)
	}
	s1 := stats(t, e)
	if got, reqs := s1.BytesFetched-s0.BytesFetched, s1.Requests-s0.Requests; got != 6*128<<10 || reqs != 6 {
		t.Fatalf("6 lone reads of 4 KiB fetched %d bytes in %d requests, want 128 KiB in one each", got, reqs)
	}
	for _, o := range offs {
		read(o + 512<<10)
	}
	s2 := stats(t, e)
	if got := s2.BytesFetched - s1.BytesFetched; got != 6*(mib-128<<10) {
		t.Fatalf("a second miss in each region fetched %d bytes, want the rest of the region (%d)", got, 6*(mib-128<<10))
	}
	for _, o := range offs {
		read(o + 700<<10)
		read(o - 300<<10)
	}
	s3 := stats(t, e)
	if s3.Requests != s2.Requests {
		t.Fatalf("reads in regions read ahead made %d more requests", s3.Requests-s2.Requests)
	}
	got, err := os.ReadFile(filepath.Join(dir, "seq"))
	if err != nil || !bytes.Equal(got, data["seq"]) {
		t.Fatalf("read of seq: %v, or other bytes than the source's", err)
	}
	s4 := stats(t, e)
	wins, reqs := s4.WindowsFetched-s3.WindowsFetched, s4.Requests-s3.Requests
	t.Logf("a 6 MiB file read in order: %d windows in %d requests", wins, reqs)
	if wins < 6<<20/layer.WindowSize || reqs*3 > wins {
		t.Fatalf("a 6 MiB file read in order: %d windows in %d requests, want 3 or more windows a request", wins, reqs)
	}
}

// TestFetchTakesTheFileRead: what a second miss in a region reads ahead
// is the region's part of the file read, not the next file's beside it;
// the file map that says so is read at the first read ahead, not before.
func TestFetchTakesTheFileRead(t *testing.T) {
	layertest.RequireRoot(t)
	src := t.TempDir()
	r := rand.New(rand.NewSource(3))
	data := map[string][]byte{"0": make([]byte, 3056<<10), "a": make([]byte, 1536<<10), "b": make([]byte, 1536<<10)}
	for name, b := range data {
		r.Read(b)
		if err := os.WriteFile(filepath.Join(src, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	e := setup(t, src)
	dir := e.mount(t, 0)
	const mib = 1 << 20
	read := func(name string, off int64) {
		t.Helper()
		f, err := os.Open(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		buf := make([]byte, 4096)
		if _, err := f.ReadAt(buf, off); err != nil || !bytes.Equal(buf, data[name][off:off+4096]) {
			t.Fatalf("read of %s at %d: %v, or other bytes than the source's", name, off, err)
		}
	}
	// The file map is read once a first region is read ahead: two misses
	// in a region inside 0.
	start0, err := lazy.PhysicalStart(filepath.Join(dir, "0"))
	if err != nil {
		t.Fatal(err)
	}
	if s := stats(t, e); s.FileExtents != 0 {
		t.Fatalf("the file map was read before any read ahead: %d extents", s.FileExtents)
	}
	r0 := (start0/mib + 1) * mib
	read("0", r0-start0)
	read("0", r0+512<<10-start0)
	for deadline := time.Now().Add(20 * time.Second); stats(t, e).FileExtents == 0; {
		if time.Now().After(deadline) {
			t.Fatal("the fetcher never read its file map")
		}
	}
	startA, err := lazy.PhysicalStart(filepath.Join(dir, "a"))
	if err != nil {
		t.Fatal(err)
	}
	startB, err := lazy.PhysicalStart(filepath.Join(dir, "b"))
	if err != nil {
		t.Fatal(err)
	}
	if startB < startA {
		t.Fatalf("b's data (%d) before a's (%d): the layout is not in path order", startB, startA)
	}
	region := startB / mib * mib // the region where a ends and b starts
	if startB-region < 400<<10 || region+mib-startB < 128<<10 {
		t.Fatalf("a ends %d bytes into its last region: too near its edge for two reads of a and one of b (the layout moved: change the files' sizes)", startB-region)
	}
	// Two misses in a, in the region it shares with b.
	read("a", region-startA)
	read("a", startB-startA-8192)
	s1 := stats(t, e)
	read("b", region+mib-layer.WindowSize-startB) // b's last window in the region
	s2 := stats(t, e)
	if s2.Requests == s1.Requests {
		t.Fatal("a read of b was cached: the read ahead of a took b's part of the region")
	}
	read("a", region-startA+200<<10) // what a's second miss read ahead
	if s3 := stats(t, e); s3.Requests != s2.Requests {
		t.Fatal("a read of a in the region made a request: its read ahead did not take a's part")
	}
}

func TestLazyMountReadsEqualSource(t *testing.T) {
	layertest.RequireRoot(t)
	src := t.TempDir()
	layertest.MakeRich(t, src, layertest.Options{Sockets: true})
	e := setup(t, src)
	dir := e.mount(t, 0)
	before := stats(t, e)
	// Listing and stat need no file data: only block 0 and metadata.
	want := layertest.ScanDir(t, src)
	for p := range want {
		if _, err := os.Lstat(filepath.Join(dir, p)); err != nil {
			t.Fatal(err)
		}
	}
	if s := stats(t, e); s.WindowsFetched != before.WindowsFetched {
		t.Fatalf("stat of every path fetched %d data windows", s.WindowsFetched-before.WindowsFetched)
	}
	got := layertest.ScanDir(t, dir)
	if d := layertest.Diff(want, got); len(d) > 0 {
		t.Fatalf("lazy mount differs:\n%s", strings.Join(d, "\n"))
	}
	s := stats(t, e)
	if s.BytesTotal != e.info.Size || s.BytesFetched > e.info.Size || s.WindowsFetched == 0 {
		t.Fatalf("stats %+v for a %d-byte layer", s, e.info.Size)
	}
}

func TestOneFetcherPerLayer(t *testing.T) {
	e := setup(t, dataTree(t))
	a := e.mount(t, 0)
	pid := pidOf(lazy.Dir(e.root, e.info.Digest))
	b := e.mount(t, 0)
	if p := pidOf(lazy.Dir(e.root, e.info.Digest)); p != pid {
		t.Fatalf("second mount started fetcher %d, first was %d", p, pid)
	}
	if n := lazy.Users(lazy.Dir(e.root, e.info.Digest)); n != 2 {
		t.Fatalf("%d users, want 2", n)
	}
	x, _ := os.ReadFile(filepath.Join(a, "blob3"))
	y, _ := os.ReadFile(filepath.Join(b, "blob3"))
	if !bytes.Equal(x, y) || len(x) == 0 {
		t.Fatal("two mounts of one layer read different bytes")
	}
}

func TestKilledFetcherFailsClosed(t *testing.T) {
	src := dataTree(t)
	e := setup(t, src)
	dir := e.mount(t, 0)
	if _, err := os.ReadFile(filepath.Join(dir, "blob0")); err != nil {
		t.Fatal(err)
	}
	cache := lazy.Dir(e.root, e.info.Digest)
	pid := pidOf(cache)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitGone(t, pid)
	b, err := os.ReadFile(filepath.Join(dir, "blob5"))
	if err == nil {
		t.Fatalf("read %d bytes through a dead fetcher", len(b))
	}
	if !errors.Is(err, syscall.EIO) && !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("read through a dead fetcher: %v, want EIO", err)
	}
	// The dead FUSE mount goes with the layer mount.
	if err := lazy.Unmount(dir); err != nil {
		t.Fatal(err)
	}
	unix.Unmount(filepath.Join(cache, "fuse"), unix.MNT_DETACH)
}

func TestCorruptWindowFailsThatReadOnly(t *testing.T) {
	src := dataTree(t)
	e := setup(t, src)
	blob := filepath.Join(e.remoteDir, "blobs", "sha256", e.info.Digest.Encoded())
	raw, err := os.ReadFile(blob)
	if err != nil {
		t.Fatal(err)
	}
	// blob2 starts at the third 1.5 MiB file: corrupt a byte inside it.
	fi, _ := os.Stat(filepath.Join(src, "blob2"))
	want, _ := os.ReadFile(filepath.Join(src, "blob2"))
	off := bytes.Index(raw, want[:4096])
	if off < 0 || fi.Size() != int64(len(want)) {
		t.Fatal("blob2 not found in the image")
	}
	raw[off+100] ^= 0xff
	os.Chmod(blob, 0o644)
	if err := os.WriteFile(blob, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	dir := e.mount(t, 0)
	if _, err := os.ReadFile(filepath.Join(dir, "blob2")); !errors.Is(err, syscall.EIO) {
		t.Fatalf("read of a corrupt window: %v, want EIO", err)
	}
	got, err := os.ReadFile(filepath.Join(dir, "blob6"))
	exp, _ := os.ReadFile(filepath.Join(src, "blob6"))
	if err != nil || !bytes.Equal(got, exp) {
		t.Fatalf("other files must still read: %v", err)
	}
	// The window after it came in the same request, was dropped with it,
	// and reads alone.
	f, err := os.Open(filepath.Join(dir, "blob2"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	part := make([]byte, 4096)
	next := (int64(off)/layer.WindowSize+1)*layer.WindowSize - int64(off)
	if _, err := f.ReadAt(part, next); err != nil || !bytes.Equal(part, want[next:next+4096]) {
		t.Fatalf("read of blob2 past its corrupt window: %v", err)
	}
	if s := stats(t, e); s.FetchErrors == 0 {
		t.Fatal("no fetch error counted")
	}
	log, _ := os.ReadFile(filepath.Join(lazy.Dir(e.root, e.info.Digest), "fetcher.log"))
	if !bytes.Contains(log, []byte("lazy/test:1")) || !bytes.Contains(log, []byte(fmt.Sprintf("offset=%d", int64(off)/layer.WindowSize*layer.WindowSize))) {
		t.Fatalf("fetcher log does not name the layer and offset:\n%s", log)
	}
}

func TestEvictionAndRestart(t *testing.T) {
	src := dataTree(t)
	e := setup(t, src)
	readAll := func(dir string) {
		for i := range 8 {
			got, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("blob%d", i)))
			exp, _ := os.ReadFile(filepath.Join(src, fmt.Sprintf("blob%d", i)))
			if err != nil || !bytes.Equal(got, exp) {
				t.Fatalf("blob%d: %v", i, err)
			}
		}
	}
	// A budget of 4 MiB holds the metadata and a few data windows.
	small := e.mount(t, 4<<20)
	readAll(small)
	s := stats(t, e)
	if s.Evictions == 0 || s.BytesCached > 4<<20 {
		t.Fatalf("small cache: %+v", s)
	}
	e.umount(t, small)
	// Unbounded: fetch everything, then restart: nothing is fetched again.
	dir := e.mount(t, 0)
	readAll(dir)
	e.umount(t, dir)
	again := e.mount(t, 0)
	dropCaches(t)
	readAll(again)
	if s := stats(t, e); s.WindowsFetched != 0 || s.CacheHits == 0 {
		t.Fatalf("after restart: %+v, want every read from the cache", s)
	}
}

// dropCaches drops the page cache so reads reach the fetcher.
func dropCaches(t *testing.T) {
	unix.Sync()
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0o200); err != nil {
		t.Fatal(err)
	}
}

// TestLazyFromRegistry mounts a layer from a real registry: windows are
// fetched with HTTP Range requests.
func TestLazyFromRegistry(t *testing.T) {
	layertest.RequireRoot(t)
	ctx := context.Background()
	src := dataTree(t)
	e := setup(t, src)
	addr, _ := layertest.StartRegistry(t)
	reg, err := remote.Open("oci://"+addr+"/dsec", remote.Options{Insecure: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := remote.Copy(ctx, e.target, reg, e.ref, false, nil); err != nil {
		t.Fatal(err)
	}
	e.target = reg
	if e.desc, err = remote.Describe(ctx, reg, e.ref); err != nil {
		t.Fatal(err)
	}
	spec := e.spec(0)
	spec.Insecure = true
	dir := t.TempDir()
	t.Setenv("DSEC_TEST_FETCHER", "1")
	err = lazy.Mount(ctx, e.root, spec, e.desc.Windows, dir, lazy.Start{Path: os.Args[0]})
	os.Unsetenv("DSEC_TEST_FETCHER")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.umount(t, dir) })
	got, err := os.ReadFile(filepath.Join(dir, "blob4"))
	exp, _ := os.ReadFile(filepath.Join(src, "blob4"))
	if err != nil || !bytes.Equal(got, exp) {
		t.Fatalf("blob4 through the registry: %v", err)
	}
	if s := stats(t, e); s.BytesFetched >= e.info.Size || s.WindowsFetched == 0 {
		t.Fatalf("stats %+v: reading one file should not fetch the whole %d-byte layer", s, e.info.Size)
	}
}

// TestRecordAndPrefetch records the windows a run reads; a later mount
// on a cold cache fetches them in the background before they are read.
func TestRecordAndPrefetch(t *testing.T) {
	src := dataTree(t)
	e := setup(t, src)
	dir := e.mountWith(t, func(s *lazy.Spec) { s.Record = true })
	for _, f := range []string{"blob1", "blob6"} {
		if _, err := os.ReadFile(filepath.Join(dir, f)); err != nil {
			t.Fatal(err)
		}
	}
	e.umount(t, dir)
	cache := lazy.Dir(e.root, e.info.Digest)
	hint, err := os.ReadFile(filepath.Join(cache, "prefetch"))
	if err != nil || len(strings.Fields(string(hint))) < 2 {
		t.Fatalf("prefetch hint %q: %v", hint, err)
	}
	// A cold cache, as on another host with the same hint.
	os.Remove(filepath.Join(cache, "image"))
	os.Remove(filepath.Join(cache, "present"))
	again := e.mount(t, 0)
	deadline := time.Now().Add(10 * time.Second)
	prev := stats(t, e)
	for {
		s := stats(t, e)
		if s.WindowsFetched >= int64(len(strings.Fields(string(hint)))) && s == prev {
			break // prefetch done: nothing moved for a while
		}
		prev = s
		if time.Now().After(deadline) {
			t.Fatalf("hinted windows not prefetched: %+v", s)
		}
	}
	before := stats(t, e)
	got, _ := os.ReadFile(filepath.Join(again, "blob6"))
	exp, _ := os.ReadFile(filepath.Join(src, "blob6"))
	if !bytes.Equal(got, exp) {
		t.Fatal("blob6 differs")
	}
	if s := stats(t, e); s.WindowsFetched != before.WindowsFetched {
		t.Fatalf("reading a prefetched file fetched %d more windows", s.WindowsFetched-before.WindowsFetched)
	}
}

// TestProfileAndOrder: a recorded run's access profile names the files it
// read in first read order (nothing else: not block 0, not metadata, not
// a neighbour); a layer rebuilt with that order holds them at its front
// (the hot region, in its config on the remote), reads the same, and the
// same run on a cold host fetches fewer windows than on the first layout.
func TestProfileAndOrder(t *testing.T) {
	src := dataTree(t)
	e := setup(t, src)
	dir := e.mountWith(t, func(s *lazy.Spec) { s.Record = true })
	run := []string{"blob6", "small07", "blob1"}
	read := func(dir string) {
		for _, f := range run {
			got, err := os.ReadFile(filepath.Join(dir, f))
			exp, _ := os.ReadFile(filepath.Join(src, f))
			if err != nil || !bytes.Equal(got, exp) {
				t.Fatalf("%s: %d bytes, want %d: %v", f, len(got), len(exp), err)
			}
		}
		// the first 8 KiB of blob3 only (the kernel reads ahead some)
		f, err := os.Open(filepath.Join(dir, "blob3"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		got := make([]byte, 8192)
		exp := make([]byte, 8192)
		ef, _ := os.Open(filepath.Join(src, "blob3"))
		defer ef.Close()
		ef.ReadAt(exp, 0)
		if _, err := f.ReadAt(got, 0); err != nil || !bytes.Equal(got, exp) {
			t.Fatalf("blob3's head: %v", err)
		}
	}
	read(dir)
	first := stats(t, e)
	e.umount(t, dir)
	paths, err := lazy.Profile(e.root, e.info.Digest)
	if err != nil {
		t.Fatal(err)
	}
	prof := string(layer.FormatProfile(paths))
	want := regexp.MustCompile("^/blob6\n/small07\n/blob1\n/blob3\t0\\+([0-9]+)\n$")
	m := want.FindStringSubmatch(prof)
	if m == nil {
		t.Fatalf("profile %q, want %s", prof, want)
	}
	headBlocks, _ := strconv.Atoi(m[1])
	if headBlocks < 2 || headBlocks >= 384 {
		t.Fatalf("blob3 read from block 0 for %d blocks: want its head only", headBlocks)
	}
	if m, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(m), lazy.Dir(e.root, e.info.Digest)+"/profile-") {
		t.Fatal("Profile left its mount behind")
	}

	s, err := store.Open(filepath.Join(t.TempDir(), "store"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ref, _ := layer.ParseRef("lazy/test:2")
	info, err := layer.Build(ctx, s, layer.BuildOptions{Source: src, Kind: layer.KindBase, Ref: ref, Order: paths})
	if err != nil {
		t.Fatal(err)
	}
	hot := int64(384 + 1 + 384 + headBlocks) // blocks of blob6, small07, blob1, blob3's head
	if info.Hot == nil || *info.Hot != (erofs.Region{Offset: erofs.BlockSize, Size: hot * erofs.BlockSize}) {
		t.Fatalf("hot region %+v, want %d blocks from block 1", info.Hot, hot)
	}
	if _, err := remote.Copy(ctx, remote.Local(s), e.target, ref, false, nil); err != nil {
		t.Fatal(err)
	}
	desc, err := remote.Describe(ctx, e.target, ref)
	if err != nil {
		t.Fatal(err)
	}
	if desc.Config.Hot == nil || *desc.Config.Hot != *info.Hot {
		t.Fatalf("the remote's config has hot region %+v, want %+v", desc.Config.Hot, info.Hot)
	}
	e2 := &env{root: e.root, remoteDir: e.remoteDir, target: e.target, info: info, desc: desc, ref: ref}
	read(e2.mount(t, 0))
	second := stats(t, e2)
	t.Logf("windows fetched for the run: %d on the first layout, %d ordered (metadata included)", first.WindowsFetched, second.WindowsFetched)
	if second.WindowsFetched >= first.WindowsFetched {
		t.Fatalf("the ordered layout fetched %d windows for the run, the first layout %d", second.WindowsFetched, first.WindowsFetched)
	}
	if _, err := layer.Build(ctx, s, layer.BuildOptions{Source: "-", Stdin: bytes.NewReader(layertest.Tar(layertest.File{Name: "a", Body: "x"})), Kind: layer.KindBase,
		Ref: ref, Force: true, Order: paths}); err == nil || !strings.Contains(err.Error(), "needs a directory") {
		t.Fatalf("ordering a stream: %v, want a refusal", err)
	}
}

// TestReadAhead: each lazy mount gets the read-ahead its spec asks for,
// on its own backing device info, leaving other mounts alone.
func TestReadAhead(t *testing.T) {
	e := setup(t, dataTree(t))
	raOf := func(dir string) string {
		f, err := os.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		var buf [129]byte // FS_IOC_GETFSSYSFSPATH
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), 0x80811501, uintptr(unsafe.Pointer(&buf[0]))); e != 0 {
			t.Fatalf("FS_IOC_GETFSSYSFSPATH on %s: %v", dir, e)
		}
		b, err := os.ReadFile(filepath.Join("/sys/class/bdi", filepath.Base(string(buf[1:1+buf[0]])), "read_ahead_kb"))
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	a := e.mountWith(t, func(s *lazy.Spec) { s.ReadAheadKB = 48 })
	b := e.mountWith(t, func(s *lazy.Spec) { s.ReadAheadKB = 0 })
	t.Cleanup(func() { e.umount(t, b) })
	t.Cleanup(func() { e.umount(t, a) })
	if ra, rb := raOf(a), raOf(b); ra != "48" || rb != "0" {
		t.Fatalf("read-ahead %s KiB and %s KiB, want 48 and 0", ra, rb)
	}
}
