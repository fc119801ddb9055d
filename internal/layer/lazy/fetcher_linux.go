package lazy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/erofs"
)

// ErrBusy says another fetcher already serves the layer.
var ErrBusy = errors.New("a fetcher already serves this layer")

type fetcher struct {
	spec  Spec
	dir   string
	c     *cache
	src   source
	log   *slog.Logger
	evict sync.RWMutex // readers of the cache file vs eviction

	mu       sync.Mutex
	inflight map[int]*flight

	statsMu sync.Mutex
	written Stats

	rec *recorder // nil unless Spec.Record
}

// recorder notes, in first touch order, the byte ranges of the image that
// reads asked for: the access profile of a run.
type recorder struct {
	mu     sync.Mutex
	seen   []uint64 // one bit per block
	ranges []erofs.Region
}

func newRecorder(size int64) *recorder {
	return &recorder{seen: make([]uint64, (size/erofs.BlockSize+64)/64)}
}

// add records the blocks of [off, end) not seen before.
func (r *recorder) add(off, end int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for b := off / erofs.BlockSize; b*erofs.BlockSize < end; b++ {
		if r.seen[b/64]&(1<<(b%64)) != 0 {
			continue
		}
		r.seen[b/64] |= 1 << (b % 64)
		start := b * erofs.BlockSize
		if n := len(r.ranges); n > 0 && r.ranges[n-1].Offset+r.ranges[n-1].Size == start {
			r.ranges[n-1].Size += erofs.BlockSize
			continue
		}
		r.ranges = append(r.ranges, erofs.Region{Offset: start, Size: erofs.BlockSize})
	}
}

// save writes the record as the layer's prefetch hint (windows in first
// touch order) and its access profile (byte ranges, "offset size" a line).
func (r *recorder) save(dir string, window int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	var hint, access strings.Builder
	seen := map[int64]bool{}
	for _, g := range r.ranges {
		fmt.Fprintln(&access, g.Offset, g.Size)
		for w := g.Offset / window; w*window < g.Offset+g.Size; w++ {
			if !seen[w] {
				seen[w] = true
				fmt.Fprintln(&hint, w)
			}
		}
	}
	if err := writeAtomic(filepath.Join(dir, "access"), []byte(access.String())); err != nil {
		return err
	}
	return writeAtomic(filepath.Join(dir, "prefetch"), []byte(hint.String()))
}

// prefetch fetches, in the background, the windows of the host's hint (a
// run recorded here) and then those of the layer's hot region (the access
// profile it was built with, wherever it was recorded), so a run like the
// recorded one finds them cached.
func (f *fetcher) prefetch(ctx context.Context) {
	var wins []int
	if b, err := os.ReadFile(filepath.Join(f.dir, "prefetch")); err == nil {
		for _, line := range strings.Fields(string(b)) {
			if w, err := strconv.Atoi(line); err == nil && w >= 0 && w < f.spec.Windows.Count {
				wins = append(wins, w)
			}
		}
	}
	if h := f.spec.Hot; h.Size > 0 {
		for w := h.Offset / f.spec.Windows.Size; w*f.spec.Windows.Size < min(h.Offset+h.Size, f.spec.Size); w++ {
			wins = append(wins, int(w))
		}
	}
	for _, w := range wins {
		if ctx.Err() != nil {
			return
		}
		if !f.c.has(w) {
			f.ensure(ctx, w)
		}
	}
}

// writeStats publishes the counters when they changed: after every
// fetch, so dsec layer stats sees a read that just happened, and on a
// timer for cache hits.
func (f *fetcher) writeStats() {
	f.statsMu.Lock()
	defer f.statsMu.Unlock()
	if s := f.c.snapshot(); s != f.written {
		if writeJSON(filepath.Join(f.dir, "stats.json"), s) == nil {
			f.written = s
		}
	}
}

type flight struct {
	done chan struct{}
	err  error
}

// ensure makes window w present: a cache hit, or one fetch shared by
// every reader that wants it meanwhile.
func (f *fetcher) ensure(ctx context.Context, w int) error {
	if f.c.has(w) {
		f.c.touch(w)
		f.c.count(func(s *Stats) { s.CacheHits++ })
		return nil
	}
	f.mu.Lock()
	if fl := f.inflight[w]; fl != nil {
		f.mu.Unlock()
		<-fl.done
		return fl.err
	}
	fl := &flight{done: make(chan struct{})}
	f.inflight[w] = fl
	f.mu.Unlock()
	fl.err = f.fetch(ctx, w)
	f.writeStats()
	f.mu.Lock()
	delete(f.inflight, w)
	f.mu.Unlock()
	close(fl.done)
	return fl.err
}

func (f *fetcher) fetch(ctx context.Context, w int) error {
	off, n := f.c.windowRange(w)
	buf := make([]byte, n)
	err := f.src.ReadAt(ctx, buf, off)
	if err == nil && !f.c.verify(w, buf) {
		err = fmt.Errorf("window at offset %d does not match the layer's window table (corrupt remote?)", off)
	}
	if err != nil {
		f.c.count(func(s *Stats) { s.FetchErrors++ })
		f.log.Error("fetch failed: reads of it fail with EIO", "layer", f.spec.Ref, "digest", f.spec.Digest, "offset", off, "err", err)
		return fmt.Errorf("layer %s: window at offset %d: %w", f.spec.Ref, off, err)
	}
	f.evict.Lock()
	err = f.c.store(w, buf)
	f.evict.Unlock()
	if err != nil {
		f.c.count(func(s *Stats) { s.FetchErrors++ })
		return err
	}
	f.c.count(func(s *Stats) { s.WindowsFetched++; s.BytesFetched += n })
	return nil
}

// read serves a FUSE read: every window it touches is made present, then
// the bytes come from the cache file while eviction is held off.
func (f *fetcher) read(ctx context.Context, dest []byte, off int64) (int, error) {
	if off >= f.spec.Size {
		return 0, nil
	}
	end := min(off+int64(len(dest)), f.spec.Size)
	if f.rec != nil {
		f.rec.add(off, end)
	}
	for {
		for w := int(off / f.spec.Windows.Size); int64(w)*f.spec.Windows.Size < end; w++ {
			if err := f.ensure(ctx, w); err != nil {
				return 0, err
			}
		}
		f.evict.RLock()
		ok := true
		for w := int(off / f.spec.Windows.Size); int64(w)*f.spec.Windows.Size < end; w++ {
			ok = ok && f.c.has(w)
		}
		var n int
		var err error
		if ok {
			n, err = f.c.img.ReadAt(dest[:end-off], off)
		}
		f.evict.RUnlock()
		if ok {
			f.c.count(func(s *Stats) { s.BytesRead += int64(n) })
			return n, err
		}
		// A window was evicted between fetch and read: fetch again.
	}
}

type imageNode struct {
	fs.Inode
	f *fetcher
}

var (
	_ fs.NodeOpener    = (*imageNode)(nil)
	_ fs.NodeReader    = (*imageNode)(nil)
	_ fs.NodeGetattrer = (*imageNode)(nil)
)

func (n *imageNode) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFREG | 0o444
	out.Size = uint64(n.f.spec.Size)
	return 0
}

// Open asks for direct I/O: the EROFS mount above caches what it reads,
// so the FUSE file must not cache the same bytes a second time.
func (n *imageNode) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	if flags&(syscall.O_WRONLY|syscall.O_RDWR) != 0 {
		return nil, 0, syscall.EROFS
	}
	return nil, fuse.FOPEN_DIRECT_IO, 0
}

func (n *imageNode) Read(ctx context.Context, fh fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	k, err := n.f.read(ctx, dest, off)
	if err != nil {
		return nil, syscall.EIO
	}
	return fuse.ReadResultData(dest[:k]), 0
}

// pmemNode is the image as a microVM's virtio-pmem device maps it: its
// bytes, then zeros to the next multiple of PmemAlign (the device maps
// whole 2 MiB sections), read through the page cache (a shared mapping
// needs one: every guest on the layer maps the same pages, which it
// reads with DAX, keeping no copy of its own). A page nobody fetched
// faults to the fetcher, which fetches its window; a dead fetcher's
// faults fail (QEMU takes a SIGBUS), never read zeros.
type pmemNode struct {
	fs.Inode
	f *fetcher
}

// PmemAlign is the multiple of its size a virtio-pmem region needs.
const PmemAlign = 2 << 20

// PmemFile is the file of the layer cached in dir that a microVM maps.
func PmemFile(dir string) string { return filepath.Join(dir, "fuse", "pmem") }

var (
	_ fs.NodeOpener    = (*pmemNode)(nil)
	_ fs.NodeReader    = (*pmemNode)(nil)
	_ fs.NodeGetattrer = (*pmemNode)(nil)
)

func (n *pmemNode) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFREG | 0o444
	out.Size = uint64((n.f.spec.Size + PmemAlign - 1) / PmemAlign * PmemAlign)
	return 0
}

func (n *pmemNode) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	if flags&(syscall.O_WRONLY|syscall.O_RDWR) != 0 {
		return nil, 0, syscall.EROFS
	}
	return nil, fuse.FOPEN_KEEP_CACHE, 0
}

func (n *pmemNode) Read(ctx context.Context, fh fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	size := (n.f.spec.Size + PmemAlign - 1) / PmemAlign * PmemAlign
	if off >= size {
		return fuse.ReadResultData(nil), 0
	}
	dest = dest[:min(int64(len(dest)), size-off)]
	k := 0
	if off < n.f.spec.Size {
		var err error
		if k, err = n.f.read(ctx, dest[:min(int64(len(dest)), n.f.spec.Size-off)], off); err != nil {
			return nil, syscall.EIO
		}
	}
	clear(dest[k:]) // the padding
	return fuse.ReadResultData(dest), 0
}

type rootNode struct {
	fs.Inode
	img  *imageNode
	pmem *pmemNode
}

func (r *rootNode) OnAdd(ctx context.Context) {
	r.AddChild("image", r.NewPersistentInode(ctx, r.img, fs.StableAttr{Mode: syscall.S_IFREG, Ino: 2}), false)
	r.AddChild("pmem", r.NewPersistentInode(ctx, r.pmem, fs.StableAttr{Mode: syscall.S_IFREG, Ino: 3}), false)
}

// Users counts the EROFS mounts of a layer's FUSE file on this host.
func Users(dir string) int {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return 0
	}
	want := filepath.Join(dir, "fuse", "image")
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		_, post, ok := strings.Cut(line, " - ")
		if f := strings.Fields(post); ok && len(f) >= 2 && f[0] == "erofs" && f[1] == want {
			n++
		}
	}
	return n
}

// termGrace is how long a fetcher told to exit (SIGTERM: its last mount
// went) still waits for a new mount (a var: a test on a loaded host
// gives its fetchers longer).
var termGrace = time.Second

// Serve runs a layer's fetcher until no mount has used it for idle. It
// fetches block 0 and the metadata region first, mounts the FUSE file and
// writes fetcher.ready.
func Serve(ctx context.Context, dir string, idle time.Duration, log *slog.Logger) error {
	// Caught from the start: a SIGTERM that comes once a mount found the
	// fetcher ready (written below) gets its grace, never the default
	// action, which would end it at once and leave its FUSE mount dead.
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(term)
	lock, err := os.OpenFile(filepath.Join(dir, "fetcher.lock"), os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return ErrBusy
	}
	var spec Spec
	if err := readJSON(filepath.Join(dir, "layer.json"), &spec); err != nil {
		return err
	}
	c, err := openCache(dir, spec)
	if err != nil {
		return err
	}
	defer c.close()
	src, err := openSource(spec)
	if err != nil {
		return err
	}
	defer src.Close()
	f := &fetcher{spec: spec, dir: dir, c: c, src: src, log: log, inflight: map[int]*flight{}}
	if spec.Record {
		f.rec = newRecorder(spec.Size)
		defer func() {
			if err := f.rec.save(dir, spec.Windows.Size); err != nil {
				log.Error("saving the recorded access profile", "err", err)
			}
		}()
	}
	for w := 0; w < spec.Windows.Count; w++ {
		if c.pinned[w] {
			if err := f.ensure(ctx, w); err != nil {
				return fmt.Errorf("fetch metadata: %w", err)
			}
		}
	}
	mnt := filepath.Join(dir, "fuse")
	_ = unix.Unmount(mnt, unix.MNT_DETACH) // a killed fetcher's dead mount
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		return err
	}
	srv, err := mountFUSE(mnt, f, spec)
	if err != nil {
		return err
	}
	defer unmountFUSE(srv, mnt, log)
	os.WriteFile(filepath.Join(dir, "fetcher.pid"), []byte(strconv.Itoa(os.Getpid())), 0o644)
	f.written = Stats{BytesTotal: -1} // publish the first counters now
	f.writeStats()
	if err := os.WriteFile(filepath.Join(dir, "fetcher.ready"), nil, 0o644); err != nil {
		return err
	}
	defer os.Remove(filepath.Join(dir, "fetcher.ready"))
	log.Info("serving", "layer", spec.Ref, "digest", spec.Digest, "cached", c.cached)
	pctx, stopPrefetch := context.WithCancel(ctx)
	defer stopPrefetch()
	go f.prefetch(pctx)
	return untilIdle(ctx, f, term, dir, idle, log)
}

// mountFUSE mounts f's files (the image, its pmem view) on mnt.
func mountFUSE(mnt string, f *fetcher, spec Spec) (*fuse.Server, error) {
	root := &rootNode{img: &imageNode{f: f}, pmem: &pmemNode{f: f}}
	sec := time.Hour // attributes never change
	srv, err := fs.Mount(mnt, root, &fs.Options{
		EntryTimeout: &sec, AttrTimeout: &sec,
		MountOptions: fuse.MountOptions{
			FsName: "dsec-" + spec.Digest.Encoded()[:12], Name: "dsec", AllowOther: true,
			DirectMount: true, DirectMountStrict: true, MaxReadAhead: 1 << 20,
			// The kernel refuses a file-backed EROFS mount on a FUSE file
			// that may pass through to a backing file.
			DisabledCapabilities: fuse.CAP_PASSTHROUGH,
		},
	})
	if err != nil {
		return nil, fmt.Errorf("mount FUSE: %w", err)
	}
	return srv, nil
}

// unmountFUSE unmounts srv from mnt as the fetcher exits.
func unmountFUSE(srv *fuse.Server, mnt string, log *slog.Logger) {
	// The EROFS mount that just went may hold the image open a moment
	// longer (its last reference drops asynchronously), failing the
	// unmount: retry, then detach. A fetcher never exits leaving a
	// dead FUSE mount behind (CI saw one once).
	for range 50 {
		if srv.Unmount() == nil {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil {
		log.Error("unmounting the FUSE mount", "err", err)
	}
}

// untilIdle serves until ctx ends or no mount has used the layer for
// idle (a SIGTERM on term: soon, after termGrace).
func untilIdle(ctx context.Context, f *fetcher, term <-chan os.Signal, dir string, idle time.Duration, log *slog.Logger) error {
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	idleSince := time.Now()
	for {
		select {
		case <-term:
			// Exit soon, but not at once: a mount may have found this
			// fetcher ready and not yet mounted its file.
			if soon := time.Now().Add(termGrace - idle); soon.Before(idleSince) {
				idleSince = soon
			}
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		f.writeStats()
		if Users(dir) > 0 {
			idleSince = time.Now()
			continue
		}
		if time.Since(idleSince) >= idle {
			// Not ready first, then no user: a mount that found it ready
			// and mounted since is seen here (it stays), and one that
			// mounts after sees it not ready (Mount's check after its
			// mount) and starts another.
			os.Remove(filepath.Join(dir, "fetcher.ready"))
			if Users(dir) > 0 {
				if err := os.WriteFile(filepath.Join(dir, "fetcher.ready"), nil, 0o644); err != nil {
					return err
				}
				idleSince = time.Now()
				continue
			}
			f.writeStats()
			log.Info("no mount uses the layer: exiting", "layer", f.spec.Ref)
			return nil
		}
	}
}
