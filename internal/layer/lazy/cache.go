// Package lazy mounts a layer whose bytes live in a remote store and are
// fetched only when read.
//
// A fetcher process serves the layer's EROFS image as one file of a FUSE
// file system; the kernel mounts EROFS on that file (file-backed, no loop
// device). A read of windows the host has not got fetches them from the
// remote in one request (64 KiB windows, a read's at least 128 KiB: never
// a 4 KiB request to a shared file system; more read ahead beside it, see
// fetcher_linux.go), checks each against the layer's window table,
// writes them to the host cache and serves them. Block 0 and the metadata
// region are fetched before the mount, so listing, stat and readlink never
// wait for the network.
//
// It fails closed: a window that cannot be fetched or does not match its
// hash makes the read fail with EIO, and a dead fetcher makes every
// uncached read fail (the FUSE connection is gone); a sandbox never reads
// zeros or stale bytes.
//
// Layout of the host cache, one directory per layer digest:
//
//	<root>/cache/<hex>/layer.json   what the fetcher serves and from where
//	<root>/cache/<hex>/windows      the window table (sha256 per window)
//	<root>/cache/<hex>/image        sparse file: fetched windows in place
//	<root>/cache/<hex>/present      one byte per window: 1 when cached
//	<root>/cache/<hex>/stats.json   counters, rewritten by the fetcher
//	<root>/cache/<hex>/prefetch     windows a recorded run touched, one
//	                                index a line: fetched in the background
//	                                by every later fetcher of the layer
//	<root>/cache/<hex>/access       byte ranges a recorded run read, in first
//	                                touch order, "offset size" a line: what
//	                                Profile turns into paths
//	<root>/cache/<hex>/fuse/image   the FUSE file the kernel mounts
//	<root>/cache/<hex>/fetcher.*    lock, pid and log of the fetcher
package lazy

import (
	"bytes"
	"container/list"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"syscall"

	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/remote"
)

// Spec is what a fetcher serves: written by Mount, read by the fetcher.
type Spec struct {
	Ref      string        `json:"name"`
	Digest   digest.Digest `json:"digest"`
	Size     int64         `json:"size"`
	Metadata erofs.Region  `json:"metadata"`
	Windows  layer.Windows `json:"windows"`
	Remote   string        `json:"remote"`
	Insecure bool          `json:"insecure,omitempty"`
	MaxBytes int64         `json:"max_bytes,omitempty"` // budget of the whole host cache, 0: unbounded
	// Hot is the layer's hot region (layer.Config.Hot): prefetched.
	Hot erofs.Region `json:"hot"`
	// ReadAheadKB is the kernel's read-ahead on each EROFS mount of the
	// layer (cache.read_ahead_kb). Whatever the kernel reads ahead may
	// cost a window from the remote, so lazy mounts read ahead little;
	// record a profile with the read-ahead its replays will use.
	ReadAheadKB int `json:"read_ahead_kb"`
	// Raw says the blob is no EROFS image (a full VM's disk, read by
	// QEMU through ServeFile): only its first window is fetched before
	// it is served, and no file map is read for its reads ahead.
	Raw bool `json:"raw,omitempty"`
	// Chunk says the blob is a chunk blob of a store that packs its
	// layers (store.ChunkBlob), which packed layers read as a device:
	// raw, served by ServeFile.
	Chunk bool `json:"chunk,omitempty"`
	// Record makes the fetcher write, when it exits, the byte ranges reads
	// asked for in first touch order (the access profile) and the windows
	// they lie in (the prefetch hint).
	Record bool `json:"record,omitempty"`
}

// Stats are a fetcher's counters.
type Stats struct {
	BytesTotal     int64 `json:"bytes_total"`
	BytesRead      int64 `json:"bytes_read"` // served to the kernel: what reads asked for
	BytesFetched   int64 `json:"bytes_fetched"`
	BytesCached    int64 `json:"bytes_cached"`
	WindowsFetched int64 `json:"windows_fetched"`
	Requests       int64 `json:"requests"`     // to the remote: a run of windows is one
	FileExtents    int64 `json:"file_extents"` // files' data extents read from the metadata (0 until the file map is read)
	CacheHits      int64 `json:"cache_hits"`
	FetchErrors    int64 `json:"fetch_errors"`
	Evictions      int64 `json:"evictions"`
}

// Dir is the cache directory of a layer.
func Dir(root string, d digest.Digest) string {
	return filepath.Join(root, "cache", d.Encoded())
}

// cache holds fetched windows of one layer on local disk.
type cache struct {
	spec    Spec
	dir     string
	img     *os.File
	present *os.File
	table   []byte // window hashes
	pinned  []bool // block 0 and metadata windows: never evicted

	mu     sync.Mutex
	have   []bool
	lru    *list.List // of int (window index), front = most recent
	elem   map[int]*list.Element
	cached int64
	stats  Stats
}

func (c *cache) windowRange(w int) (int64, int64) {
	off := int64(w) * c.spec.Windows.Size
	return off, min(c.spec.Windows.Size, c.spec.Size-off)
}

// openCache opens (or creates) a layer's cache and drops any window whose
// bytes no longer match the table, so a restart after a crash serves
// only verified bytes.
func openCache(dir string, spec Spec) (*cache, error) {
	table, err := os.ReadFile(filepath.Join(dir, "windows"))
	if err != nil {
		return nil, err
	}
	if digest.FromBytes(table) != spec.Windows.Digest || len(table) != 32*spec.Windows.Count {
		return nil, fmt.Errorf("window table of %s is corrupt", spec.Digest)
	}
	img, err := os.OpenFile(filepath.Join(dir, "image"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	if err := img.Truncate(spec.Size); err != nil {
		img.Close()
		return nil, err
	}
	present, err := os.OpenFile(filepath.Join(dir, "present"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		img.Close()
		return nil, err
	}
	c := &cache{spec: spec, dir: dir, img: img, present: present, table: table,
		have: make([]bool, spec.Windows.Count), pinned: make([]bool, spec.Windows.Count),
		lru: list.New(), elem: map[int]*list.Element{}}
	c.stats.BytesTotal = spec.Size
	c.pinned[0] = true
	for w := int(spec.Metadata.Offset / spec.Windows.Size); w < spec.Windows.Count && !spec.Raw; w++ {
		c.pinned[w] = true
	}
	marks := make([]byte, spec.Windows.Count)
	if _, err := present.ReadAt(marks, 0); err != nil && !errors.Is(err, errEOF) {
		c.close()
		return nil, err
	}
	buf := make([]byte, spec.Windows.Size)
	for w, m := range marks {
		if m != 1 {
			continue
		}
		off, n := c.windowRange(w)
		if _, err := img.ReadAt(buf[:n], off); err == nil && c.verify(w, buf[:n]) {
			c.have[w] = true
			c.cached += n
			c.elem[w] = c.lru.PushBack(w)
			continue
		}
		present.WriteAt([]byte{0}, int64(w)) // stale: fetch again
	}
	c.stats.BytesCached = c.cached
	return c, nil
}

func (c *cache) verify(w int, b []byte) bool {
	sum := sha256.Sum256(b)
	return bytes.Equal(sum[:], c.table[32*w:32*w+32])
}

func (c *cache) close() {
	c.img.Close()
	c.present.Close()
}

// store puts a verified window in the cache; trim then evicts the least
// recently used unpinned windows beyond the budget. When the host's disk is full it
// evicts until the window fits, and fails only if nothing is left to
// evict: the present map never claims a window whose write failed.
func (c *cache) store(w int, b []byte) error {
	off, _ := c.windowRange(w)
	for {
		_, err := c.img.WriteAt(b, off)
		if err == nil {
			break
		}
		if !errors.Is(err, syscall.ENOSPC) {
			return err
		}
		c.mu.Lock()
		ok := c.evictOne()
		c.mu.Unlock()
		if !ok {
			return fmt.Errorf("host cache full (%s) and nothing left to evict: %w", c.dir, err)
		}
	}
	if _, err := c.present.WriteAt([]byte{1}, int64(w)); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.have[w] = true
	c.cached += int64(len(b))
	c.elem[w] = c.lru.PushFront(w)
	c.stats.BytesCached = c.cached
	return nil
}

// trim keeps the host cache under its budget (enforceBudget): once a
// request's windows are stored, not once a window, as it lists the cache.
func (c *cache) trim() {
	if c.spec.MaxBytes > 0 {
		c.mu.Lock()
		c.enforceBudget()
		c.stats.BytesCached = c.cached
		c.mu.Unlock()
	}
}

// enforceBudget keeps the whole host cache, every layer's, under
// MaxBytes: first the caches of layers no fetcher serves (nothing pins
// them; oldest first), then this layer's least recently used unpinned
// windows. Pinned windows stay: a mounted layer's metadata is never
// evicted. c.mu is held.
func (c *cache) enforceBudget() {
	others := filepath.Dir(c.dir)
	for hostUsage(others) > c.spec.MaxBytes {
		if dropIdleCache(others, c.dir) {
			continue
		}
		if !c.evictOne() {
			return
		}
	}
}

// touch records a use of a cached window.
func (c *cache) touch(w int) {
	c.mu.Lock()
	if e := c.elem[w]; e != nil {
		c.lru.MoveToFront(e)
	}
	c.mu.Unlock()
}

func (c *cache) evictOne() bool {
	for e := c.lru.Back(); e != nil; e = e.Prev() {
		w := e.Value.(int)
		if c.pinned[w] {
			continue
		}
		off, n := c.windowRange(w)
		c.present.WriteAt([]byte{0}, int64(w))
		punchHole(c.img, off, n)
		c.have[w] = false
		c.cached -= n
		c.lru.Remove(e)
		delete(c.elem, w)
		c.stats.Evictions++
		return true
	}
	return false
}

func (c *cache) has(w int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.have[w]
}

func (c *cache) snapshot() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stats
}

func (c *cache) count(f func(*Stats)) {
	c.mu.Lock()
	f(&c.stats)
	c.mu.Unlock()
}

// ReadStats reads the counters a layer's fetcher last wrote.
//
// A layer mounted packed (MountPacked) has no fetcher of its own: its
// figures are its chunk blobs' summed, which other layers on the host
// may share, and its metadata image, fetched whole.
func ReadStats(root string, d digest.Digest) (*Stats, error) {
	if s, err := packedStats(root, d); !errors.Is(err, fs.ErrNotExist) {
		return s, err // (a microVM's whole image of it has a fetcher beside: not these figures)
	}
	return fetcherStats(root, d)
}

// fetcherStats are the figures the fetcher of blob d last wrote.
func fetcherStats(root string, d digest.Digest) (*Stats, error) {
	b, err := os.ReadFile(filepath.Join(Dir(root, d), "stats.json"))
	if err != nil {
		return nil, err
	}
	var s Stats
	return &s, json.Unmarshal(b, &s)
}

// packedSpec is packed.json: a layer mounted packed, and the chunk blobs
// it reads (each cached in a directory of its own).
type packedSpec struct {
	Ref     string          `json:"name"`
	Digest  digest.Digest   `json:"digest"`
	Devices []digest.Digest `json:"devices"`
}

func packedStats(root string, d digest.Digest) (*Stats, error) {
	var ps packedSpec
	b, err := os.ReadFile(filepath.Join(Dir(root, d), "packed.json"))
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(b, &ps); err != nil {
		return nil, err
	}
	var sum Stats
	if fi, err := os.Stat(filepath.Join(Dir(root, d), "meta.erofs")); err == nil {
		sum.BytesTotal, sum.BytesFetched, sum.BytesCached = fi.Size(), fi.Size(), fi.Size()
	}
	for _, x := range ps.Devices {
		if x.Validate() != nil {
			continue
		}
		s, err := fetcherStats(root, x)
		if err != nil {
			continue // a blob not read yet
		}
		sum.BytesTotal += s.BytesTotal
		sum.BytesRead += s.BytesRead
		sum.BytesFetched += s.BytesFetched
		sum.BytesCached += s.BytesCached
		sum.WindowsFetched += s.WindowsFetched
		sum.Requests += s.Requests
		sum.CacheHits += s.CacheHits
		sum.FetchErrors += s.FetchErrors
		sum.Evictions += s.Evictions
	}
	return &sum, nil
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return writeAtomic(path, append(b, '\n'))
}

// writeAtomic replaces path with b through a temp file of its own, so
// concurrent writers (racing mounts of one layer) never share one.
func writeAtomic(path string, b []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Chmod(f.Name(), 0o644); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

// DefaultReadAheadKB is the default cache.read_ahead_kb. Measured on the
// agent step of make bench: 128 (the kernel's default) makes the kernel
// read 6.6% of a Debian base for it, 16 reads 4.2% and the step takes
// 1.4x as long on a cold host, 0 reads 3.2% and takes 2.4x as long.
const DefaultReadAheadKB = 16

// Tuning is how a host mounts lazy layers: cache.max_bytes and
// cache.read_ahead_kb.
type Tuning struct {
	MaxBytes    int64 // the whole host cache; 0: unbounded
	ReadAheadKB int   // 0: none (DefaultReadAheadKB is the configured default)
}

// SpecFor is the Spec that serves remote layer l, named ref, from t.
func SpecFor(ref string, l *remote.Layer, t remote.Target, insecure bool, tune Tuning) Spec {
	s := Spec{Ref: ref, Digest: l.Blob.Digest, Size: l.Blob.Size, Metadata: l.Config.Metadata,
		Windows: l.Config.Windows, Remote: t.String(), Insecure: insecure, MaxBytes: tune.MaxBytes, ReadAheadKB: tune.ReadAheadKB}
	if l.Config.Hot != nil {
		s.Hot = *l.Config.Hot
	}
	return s
}
