package lazy

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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
	streams  [8]stream       // f.mu: readers going through the image in order
	slot     int             // f.mu: the next of streams to reuse
	misses   []uint8         // f.mu: reads' misses per region (saturating)
	files    extentsOf       // f.mu: where files' data lies, once mapFiles is done
	mapping  bool            // f.mu: mapFiles was started
	bg       context.Context // the fetcher's life: what reads ahead
	aheads   sync.WaitGroup  // reads ahead and the file map under way

	statsMu sync.Mutex
	written Stats

	rec *recorder // nil unless Spec.Record

	opens atomic.Int64 // the image's open handles: a reader by path (ServeFile) is a user
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
	// Each run of consecutive windows the cache lacks in one request, a
	// request's worth at a time: what a read wants later in the hot
	// region is not held behind the whole region.
	wins = slices.DeleteFunc(wins, f.c.has)
	per := max(1, int(maxRun/f.spec.Windows.Size))
	for i := 0; i < len(wins) && ctx.Err() == nil; {
		j := i + 1
		for j < len(wins) && wins[j] == wins[j-1]+1 && j-i < per {
			j++
		}
		f.ensure(ctx, wins[i], wins[j-1]+1, -1)
		i = j
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

// How much a read's miss fetches. The reader waits for the aligned
// firstFetch around its miss; what is read ahead beside it, it does not
// wait for: after a second miss in the same region of the image (a reader
// dense there, as a program's text faulted in page by page), what the
// region holds of the file read (files_linux.go); for a miss where an
// earlier fetch ended (a reader going in order), twice as far ahead as
// that fetch went, up to maxAhead. A request costs a round trip and a
// window's bytes cost bandwidth: these sizes are a trade between the two,
// measured on the agent steps of make bench (BENCHMARKS.md, Lazy
// loading). On a layer whose windows are larger, a window is the least a
// fetch takes.
const (
	firstFetch  = 128 << 10
	region      = 1 << 20
	denseMisses = 2
	maxAhead    = 1 << 20
	// maxRun bounds one request: a longer run of missing windows (the
	// metadata region of a large layer) is fetched in several.
	maxRun = 4 << 20
)

// run is windows [lo, hi) fetched in one request.
type run struct {
	lo, hi int
	fl     *flight
}

// stream is a reader going through the image in order: where its last
// fetch ended, and how many windows that fetch took.
type stream struct{ next, size int }

// windows is n bytes in windows, at least one.
func (f *fetcher) windows(n int64) int { return int(max(1, n/f.spec.Windows.Size)) }

// extent is what a read that misses windows [lo, hi) from byte at on
// should fetch: the reader waits for [a, b), which holds [lo, hi) aligned
// to firstFetch; what [ra, rb) holds beyond it is read ahead. f.mu is
// held.
func (f *fetcher) extent(lo, hi int, at int64) (a, b, ra, rb int) {
	first, reg := f.windows(firstFetch), f.windows(region)
	a = lo / first * first
	b = max(hi, a+first)
	ra, rb = a, max(b, f.ahead(lo, hi))
	c := lo / reg
	if f.misses[c] < denseMisses {
		f.misses[c]++
	}
	if f.misses[c] == denseMisses {
		x, y := c*reg, (c+1)*reg
		if file, ok := f.files.file(at); ok { // the region's part of the file read
			x, y = max(x, int(file[0]/f.spec.Windows.Size)), min(y, int((file[1]-1)/f.spec.Windows.Size)+1)
		} else if !f.mapping && !f.spec.Raw { // the first read ahead of a region: the map is read now, in the background
			f.mapping = true
			f.aheads.Add(1)
			go func() {
				defer f.aheads.Done()
				f.mapFiles(f.bg)
			}()
		}
		ra, rb = min(ra, x), max(rb, y)
	}
	return a, b, ra, rb
}

// ahead is where the fetch of a read's missing [lo, hi) should end for a
// reader in order: a miss at or just past (two windows at most) where an
// earlier fetch ended reads ahead twice as far as that fetch did, up to
// maxAhead, as the kernel's read-ahead grows; any other miss starts a
// stream and asks for no more than hi. f.mu is held.
func (f *fetcher) ahead(lo, hi int) int {
	for i := range f.streams {
		s := &f.streams[i]
		if s.size > 0 && lo >= s.next && lo <= s.next+2 {
			s.size = min(2*s.size, f.windows(maxAhead))
			s.next = max(hi, lo+s.size)
			return s.next
		}
	}
	f.streams[f.slot] = stream{next: hi, size: hi - lo}
	f.slot = (f.slot + 1) % len(f.streams)
	return hi
}

// ensure makes windows [lo, hi) present. A cached window is a hit; each
// run of missing windows is fetched in one request, so a read of several
// small windows costs one round trip, not one per window; a window
// another reader is fetching is waited for, not fetched twice. A read's
// ensure (at, the byte it misses from; -1 for none) widens its last run
// to the read's extent.
func (f *fetcher) ensure(ctx context.Context, lo, hi int, at int64) error {
	return f.ensureOnce(ctx, lo, hi, at, false)
}

// ensureOnce is ensure; retry says it is a read's second try, after a
// fetch it waited for failed.
func (f *fetcher) ensureOnce(ctx context.Context, lo, hi int, at int64, retry bool) error {
	if f.cached(lo, hi) { // a read's usual case, without f.mu
		return nil
	}
	var (
		runs  []run
		waits []*flight
		hits  int64
	)
	per := max(1, int(maxRun/f.spec.Windows.Size))
	f.mu.Lock()
	for w := lo; w < hi; w++ {
		switch fl := f.inflight[w]; {
		case f.c.has(w):
			f.c.touch(w)
			hits++
		case fl != nil:
			if len(waits) == 0 || waits[len(waits)-1] != fl {
				waits = append(waits, fl)
			}
		default:
			if n := len(runs); n > 0 && runs[n-1].hi == w && w-runs[n-1].lo < per {
				runs[n-1].hi++
			} else {
				runs = append(runs, run{lo: w, hi: w + 1, fl: &flight{done: make(chan struct{})}})
			}
			f.inflight[w] = runs[len(runs)-1].fl
		}
	}
	var ahead []run
	if n := len(runs); at >= 0 && n > 0 {
		ahead = f.widen(&runs[n-1], per, max(at, int64(runs[n-1].lo)*f.spec.Windows.Size))
	}
	f.mu.Unlock()
	if hits > 0 {
		f.c.count(func(s *Stats) { s.CacheHits += hits })
	}
	for _, r := range ahead {
		f.aheads.Add(1)
		go func() {
			defer f.aheads.Done()
			f.fetchRun(f.bg, r)
		}()
	}
	var first error
	for _, r := range runs {
		if err := f.fetchRun(ctx, r); first == nil {
			first = err
		}
	}
	var waited error
	for _, fl := range waits {
		select {
		case <-fl.done:
		case <-ctx.Done(): // the read was interrupted: the fetch goes on for others
			return ctx.Err()
		}
		if waited == nil {
			waited = fl.err
		}
	}
	if first == nil && waited == nil {
		return nil
	}
	// A fetch failed, maybe in part: a window that does not match drops
	// itself alone. The read fails only if what it needs is missing after
	// one more try, here, of just that.
	missing := false
	for w := lo; w < hi && !missing; w++ {
		missing = !f.c.has(w)
	}
	switch {
	case !missing:
		return nil
	case !retry:
		return f.ensureOnce(ctx, lo, hi, -1, true)
	}
	return cmp.Or(first, waited)
}

// cached says whether windows [lo, hi) are all in the cache, counting
// them as hits (and used) when they are.
func (f *fetcher) cached(lo, hi int) bool {
	for w := lo; w < hi; w++ {
		if !f.c.has(w) {
			return false
		}
	}
	for w := lo; w < hi; w++ {
		f.c.touch(w)
	}
	f.c.count(func(s *Stats) { s.CacheHits += int64(hi - lo) })
	return true
}

// widen grows r, the last run a read waits for, to the read's extent,
// and returns the runs to read ahead beside it, before it and after it:
// the windows there that are neither cached nor being fetched. f.mu is
// held.
func (f *fetcher) widen(r *run, per int, at int64) []run {
	a, b, ra, rb := f.extent(r.lo, r.hi, at)
	free := func(w int) bool { return !f.c.has(w) && f.inflight[w] == nil }
	for ; r.lo > a && r.hi-r.lo < per && free(r.lo-1); r.lo-- {
		f.inflight[r.lo-1] = r.fl
	}
	for b = min(b, f.spec.Windows.Count); r.hi < b && r.hi-r.lo < per && free(r.hi); r.hi++ {
		f.inflight[r.hi] = r.fl
	}
	var out []run
	claim := func(lo, hi int) { // each run of free windows in [lo, hi)
		for w := lo; w < hi; w++ {
			if !free(w) {
				continue
			}
			if n := len(out); n > 0 && out[n-1].hi == w && w-out[n-1].lo < per {
				out[n-1].hi++
			} else {
				out = append(out, run{lo: w, hi: w + 1, fl: &flight{done: make(chan struct{})}})
			}
			f.inflight[w] = out[len(out)-1].fl
		}
	}
	claim(max(ra, r.lo-per), r.lo)
	claim(r.hi, min(rb, r.hi+per, f.spec.Windows.Count))
	return out
}

// fetchRun fetches r's windows, then lets go of them and wakes who
// waits for them.
func (f *fetcher) fetchRun(ctx context.Context, r run) error {
	r.fl.err = f.fetch(ctx, r.lo, r.hi)
	f.writeStats()
	f.mu.Lock()
	for w := r.lo; w < r.hi; w++ {
		delete(f.inflight, w)
	}
	f.mu.Unlock()
	close(r.fl.done)
	return r.fl.err
}

// fetch reads windows [lo, hi) from the remote in one request, checks each
// against the layer's window table and caches those that match; one that
// does not fails the fetch, and is not cached.
func (f *fetcher) fetch(ctx context.Context, lo, hi int) error {
	off, _ := f.c.windowRange(lo)
	last, n := f.c.windowRange(hi - 1)
	buf := make([]byte, last+n-off)
	err := f.src.ReadAt(ctx, buf, off)
	f.c.count(func(s *Stats) { s.Requests++ })
	at, bad := off, error(nil) // where it failed: the request, or the first window that does not match
	if err == nil {
		var good []int // checked before eviction is held off
		for w := lo; w < hi; w++ {
			wo, wn := f.c.windowRange(w)
			if f.c.verify(w, buf[wo-off:wo-off+wn]) {
				good = append(good, w)
			} else if bad == nil {
				at, bad = wo, errors.New("does not match the layer's window table (corrupt remote?)")
			}
		}
		for _, w := range good { // a window at a time: reads of the cache go on between
			wo, wn := f.c.windowRange(w)
			f.evict.Lock()
			err = f.c.store(w, buf[wo-off:wo-off+wn])
			f.evict.Unlock()
			if err != nil {
				break
			}
			f.c.count(func(s *Stats) { s.WindowsFetched++; s.BytesFetched += wn })
		}
		if f.spec.MaxBytes > 0 {
			f.evict.Lock()
			f.c.trim()
			f.evict.Unlock()
		}
		if err != nil {
			f.c.count(func(s *Stats) { s.FetchErrors++ })
			return err
		}
	}
	if err = cmp.Or(err, bad); err != nil {
		if ctx.Err() != nil { // a read ahead stopped as the fetcher exits, or a read interrupted: no failure
			return err
		}
		f.c.count(func(s *Stats) { s.FetchErrors++ })
		f.log.Error("fetch failed: reads of it fail with EIO", "layer", f.spec.Ref, "digest", f.spec.Digest, "offset", at, "err", err)
		return fmt.Errorf("layer %s: window at offset %d: %w", f.spec.Ref, at, err)
	}
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
		if err := f.ensure(ctx, int(off/f.spec.Windows.Size), int((end-1)/f.spec.Windows.Size)+1, off); err != nil {
			return 0, err
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
	_ fs.NodeReleaser  = (*imageNode)(nil)
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
	n.f.opens.Add(1)
	return &openImage{}, fuse.FOPEN_DIRECT_IO, 0
}

// openImage is an open handle of the image: its release (Release) is
// counted (a nil handle's is not).
type openImage struct{ _ byte }

func (n *imageNode) Release(ctx context.Context, fh fs.FileHandle) syscall.Errno {
	n.f.opens.Add(-1)
	return 0
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
	bg, stop := context.WithCancel(ctx)
	f := &fetcher{spec: spec, dir: dir, c: c, src: src, log: log, inflight: map[int]*flight{}, bg: bg}
	f.misses = make([]uint8, spec.Windows.Count/f.windows(region)+1)
	defer f.aheads.Wait() // before the cache and the source close
	defer stop()
	if spec.Record {
		f.rec = newRecorder(spec.Size)
		defer func() {
			if err := f.rec.save(dir, spec.Windows.Size); err != nil {
				log.Error("saving the recorded access profile", "err", err)
			}
		}()
	}
	for lo := 0; lo < spec.Windows.Count; lo++ { // the pinned windows, a run at a time
		hi := lo
		for hi < spec.Windows.Count && c.pinned[hi] {
			hi++
		}
		if err := f.ensure(ctx, lo, hi, -1); err != nil {
			return fmt.Errorf("fetch metadata: %w", err)
		}
		lo = hi
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
	f.aheads.Add(1)
	go func() {
		defer f.aheads.Done()
		f.prefetch(pctx)
	}()
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
	// soon: a SIGTERM said the last mount went. The fetcher exits
	// termGrace after nothing uses it, not idle, but not at once: a mount
	// may have found it ready and not yet mounted its file (a new mount
	// ends soon). The unmounted file may still be open a moment (the
	// kernel drops its last reference asynchronously, later on a loaded
	// host): that is no new mount, and soon stays.
	soon := false
	for {
		select {
		case <-term:
			soon, idleSince = true, time.Now() // the grace counts from the signal
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		f.writeStats()
		if f.opens.Load() > 0 && !soon { // (mountinfo read only when it tells something)
			idleSince = time.Now()
			continue
		}
		users := Users(dir)
		if users > 0 {
			soon = false
		}
		if f.opens.Load() > 0 || users > 0 {
			idleSince = time.Now()
			continue
		}
		wait := idle
		if soon {
			wait = min(idle, termGrace)
		}
		if time.Since(idleSince) >= wait {
			// Not ready first, then no user: a mount that found it ready
			// and mounted since is seen here (it stays), and one that
			// mounts after sees it not ready (Mount's check after its
			// mount) and starts another.
			os.Remove(filepath.Join(dir, "fetcher.ready"))
			if f.opens.Load() > 0 || Users(dir) > 0 {
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
