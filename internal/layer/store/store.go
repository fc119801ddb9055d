// Package store keeps content-addressed blobs and tags in an OCI image
// layout on a local (or shared POSIX) directory:
//
//	oci-layout           {"imageLayoutVersion":"1.0.0"}
//	index.json           one manifest descriptor per tag, the tag in the
//	                     org.opencontainers.image.ref.name annotation
//	blobs/sha256/<hex>   every blob, named by the sha256 of its bytes
//	ingest/              blobs being written; never read as content
//	.lock                flock: shared while a writer may add unreferenced
//	                     blobs, exclusive for garbage collection
//	locks/<name>         flocks of work one process does for all
//	                     (Exclusive); GC removes those nobody holds
//
// A blob becomes visible only by rename(2) after its bytes were fsynced
// and hashed, and the directory is fsynced after the rename, so a writer
// killed at any point leaves at most a file in ingest/. index.json is
// replaced the same way under an exclusive lock.
package store

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/durable"
)

// RefAnnotation names a tag in index.json.
const RefAnnotation = ocispec.AnnotationRefName

// ErrNoSpace is wrapped when the store's file system is full.
var ErrNoSpace = errors.New("no space left in the store")

// Store is an OCI image layout on disk.
type Store struct {
	dir string
	// index is index.json as last read, and which file that was: read
	// again only once another is in its place (every write renames a
	// new one in, this process's or another's). A create resolves its
	// refs more than once; a store of many layers has a large index.
	index indexCache
}

type indexCache struct {
	sync.Mutex
	file fileKey
	idx  *ocispec.Index
}

// copy is the index read last, for a caller to change.
func (c *indexCache) copy() *ocispec.Index {
	idx := *c.idx
	idx.Manifests = slices.Clone(idx.Manifests)
	return &idx
}

// fileKey tells one file from another at a path: its inode, size and
// change time (an inode is reused only after the file it was is gone).
type fileKey struct {
	ino, size uint64
	ctime     syscall.Timespec
}

// Open opens the layout at dir, creating it if needed.
func Open(dir string) (*Store, error) {
	s := &Store{dir: dir}
	for _, d := range []string{"blobs/sha256", "ingest"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return nil, fmt.Errorf("open store %s: %w", dir, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, ocispec.ImageLayoutFile)); errors.Is(err, fs.ErrNotExist) {
		b, _ := json.Marshal(ocispec.ImageLayout{Version: ocispec.ImageLayoutVersion})
		if err := s.writeFile(ocispec.ImageLayoutFile, b); err != nil {
			return nil, err
		}
	}
	if _, err := os.Stat(filepath.Join(dir, ocispec.ImageIndexFile)); errors.Is(err, fs.ErrNotExist) {
		if err := s.writeIndex(emptyIndex()); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// Dir is the layout's directory.
func (s *Store) Dir() string { return s.dir }

func emptyIndex() *ocispec.Index {
	return &ocispec.Index{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageIndex, Manifests: []ocispec.Descriptor{}}
}

// BlobPath is where the blob with digest d lives.
func (s *Store) BlobPath(d digest.Digest) string {
	return filepath.Join(s.dir, "blobs", d.Algorithm().String(), d.Encoded())
}

func classify(op string, err error) error {
	if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
		return fmt.Errorf("%s: %w: %w", op, ErrNoSpace, err)
	}
	return fmt.Errorf("%s: %w", op, err)
}

// writeFile atomically replaces a file at the top of the layout (its
// temporary file in ingest/, where an interrupted write is swept).
func (s *Store) writeFile(name string, b []byte) error {
	if err := durable.WriteFileIn(filepath.Join(s.dir, "ingest"), filepath.Join(s.dir, name), b, 0o644); err != nil {
		return classify("write "+name, err)
	}
	return nil
}

// Ingest is a blob being written. Write to it, then Commit or Abort.
// Writes start the kernel's writeback every few MiB, so the fsync at
// commit has little left to do.
type Ingest struct {
	*os.File
	s       *Store
	written int64
	kicked  int64
	keep    bool // a resumable ingest: Abort leaves its bytes for the next try
}

const writebackEvery = 32 << 20

// Write appends to the blob.
func (in *Ingest) Write(p []byte) (int, error) {
	n, err := in.File.Write(p)
	in.written += int64(n)
	if in.written-in.kicked >= writebackEvery {
		startWriteback(in.File, in.kicked, in.written-in.kicked)
		in.kicked = in.written
	}
	return n, err
}

// ReadFrom appends r through Write (not the file's own ReadFrom), so the
// size and the writeback see every byte.
func (in *Ingest) ReadFrom(r io.Reader) (int64, error) {
	return io.CopyBuffer(struct{ io.Writer }{in}, r, make([]byte, 1<<20))
}

// CommitDigest publishes a blob whose digest the caller computed from
// exactly the bytes it wrote, in order. It syncs, checks the size and
// renames; it does not read the blob again.
func (in *Ingest) CommitDigest(d digest.Digest, size int64) (ocispec.Descriptor, error) {
	defer in.Abort()
	if err := in.Sync(); err != nil {
		return ocispec.Descriptor{}, classify("sync blob", err)
	}
	st, err := in.Stat()
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	if st.Size() != size {
		return ocispec.Descriptor{}, fmt.Errorf("blob is %d bytes, its writer hashed %d: %w", st.Size(), size, errdefs.ErrDataLoss)
	}
	desc := ocispec.Descriptor{Digest: d, Size: size}
	return desc, in.s.publish(in.File.Name(), desc)
}

// NewIngest starts a blob.
func (s *Store) NewIngest() (*Ingest, error) {
	f, err := os.CreateTemp(filepath.Join(s.dir, "ingest"), "blob.*")
	if err != nil {
		return nil, classify("create blob", err)
	}
	return &Ingest{File: f, s: s}, nil
}

// ResumeIngest continues the blob d that an interrupted copy left partly
// written, or starts it: Size says how many bytes it holds, and writes
// append. Abort keeps it for the next try; Discard drops it. While one
// copy holds it (a lock on the file), another gets a fresh ingest.
func (s *Store) ResumeIngest(d digest.Digest) (*Ingest, error) {
	if err := d.Validate(); err != nil {
		return nil, err
	}
	path := filepath.Join(s.dir, "ingest", "partial-"+d.Encoded())
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, classify("create blob", err)
	}
	if unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil {
		f.Close()
		return s.NewIngest()
	}
	if !samePath(f, path) { // removed (its copy ended) between the open and the lock
		f.Close()
		return s.ResumeIngest(d)
	}
	n, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		f.Close()
		return nil, err
	}
	return &Ingest{File: f, s: s, written: n, kicked: n, keep: true}, nil
}

// Resumable says whether the ingest is kept for the next try when
// aborted (ResumeIngest's, which no other copy held).
func (in *Ingest) Resumable() bool { return in.keep }

// Size is how many bytes the ingest holds.
func (in *Ingest) Size() int64 { return in.written }

// Abort discards the ingest, or keeps a resumable one for the next try.
func (in *Ingest) Abort() {
	if !in.keep {
		os.Remove(in.File.Name()) // before its lock goes with the file: no other copy takes it up
	}
	in.File.Close()
}

// Discard drops the ingest's bytes, resumable or not.
func (in *Ingest) Discard() {
	in.keep = false
	in.Abort()
}

// Commit syncs the ingest, hashes what is on disk, checks it against
// want (if not empty) and publishes it as a blob. The ingest is gone
// afterwards, whatever the result.
func (in *Ingest) Commit(want digest.Digest) (ocispec.Descriptor, error) {
	defer in.Abort()
	if err := in.Sync(); err != nil {
		return ocispec.Descriptor{}, classify("sync blob", err)
	}
	if _, err := in.Seek(0, io.SeekStart); err != nil {
		return ocispec.Descriptor{}, err
	}
	h := sha256.New()
	n, err := io.CopyBuffer(h, in.File, make([]byte, 1<<20))
	if err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("hash blob: %w", err)
	}
	got := digest.NewDigestFromEncoded(digest.SHA256, hex.EncodeToString(h.Sum(nil)))
	if want != "" && got != want {
		in.keep = false // bad bytes: the next try starts over
		return ocispec.Descriptor{}, fmt.Errorf("blob has digest %s, expected %s: %w", got, want, errdefs.ErrDataLoss)
	}
	desc := ocispec.Descriptor{Digest: got, Size: n}
	return desc, in.s.publish(in.File.Name(), desc)
}

func (s *Store) publish(tmp string, desc ocispec.Descriptor) error {
	dst := s.BlobPath(desc.Digest)
	if st, err := os.Stat(dst); err == nil && st.Size() == desc.Size {
		return nil // a concurrent writer published the same bytes
	}
	if err := os.Chmod(tmp, 0o444); err != nil {
		return err
	}
	if err := os.Rename(tmp, dst); err != nil {
		return classify("publish blob", err)
	}
	return durable.SyncDir(filepath.Dir(dst))
}

// WriteBlob stores b and returns its descriptor with mediaType set.
func (s *Store) WriteBlob(mediaType string, b []byte) (ocispec.Descriptor, error) {
	in, err := s.NewIngest()
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	if _, err := in.Write(b); err != nil {
		in.Abort()
		return ocispec.Descriptor{}, classify("write blob", err)
	}
	desc, err := in.Commit(digest.FromBytes(b))
	desc.MediaType = mediaType
	return desc, err
}

// Open opens a blob for reading. The caller verifies what it reads or
// uses ReadBlob. A packed layer's canonical image is made again, and
// checked, in an unlinked file (see Pack): what a push or an export
// reads.
func (s *Store) Open(d digest.Digest) (*os.File, error) {
	if err := d.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %v", errdefs.ErrInvalidArgument, err)
	}
	if s.Packed(d) {
		return s.openPacked(d)
	}
	f, err := os.Open(s.BlobPath(d))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("blob %s: %w", d, errdefs.ErrNotFound)
	}
	return f, err
}

// ReadBlob reads a small blob whole and verifies its digest.
func (s *Store) ReadBlob(d digest.Digest, max int64) ([]byte, error) {
	f, err := s.Open(d)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > max {
		return nil, fmt.Errorf("blob %s is larger than %d bytes: %w", d, max, errdefs.ErrDataLoss)
	}
	if digest.FromBytes(b) != d {
		return nil, fmt.Errorf("blob %s is corrupt (its bytes hash to %s): %w", d, digest.FromBytes(b), errdefs.ErrDataLoss)
	}
	return b, nil
}

// VerifyBlob hashes a blob whole and compares it with its name.
func (s *Store) VerifyBlob(d digest.Digest) error {
	f, err := s.Open(d)
	if err != nil {
		return err
	}
	defer f.Close()
	v := d.Verifier()
	if _, err := io.CopyBuffer(v, f, make([]byte, 1<<20)); err != nil {
		return err
	}
	if !v.Verified() {
		return fmt.Errorf("blob %s is corrupt: %w", d, errdefs.ErrDataLoss)
	}
	return nil
}

// Exists reports whether a blob is present.
func (s *Store) Exists(d digest.Digest) bool {
	_, err := os.Stat(s.BlobPath(d))
	return err == nil
}

// readIndex is the store's index, the caller's to change (its
// descriptors' annotations are shared: replace them, never write them).
func (s *Store) readIndex() (*ocispec.Index, error) {
	s.index.Lock()
	defer s.index.Unlock()
	p := filepath.Join(s.dir, ocispec.ImageIndexFile)
	if fi, err := os.Stat(p); err == nil && s.index.idx != nil {
		if key, ok := keyOf(fi); ok && key == s.index.file {
			return s.index.copy(), nil
		}
	}
	f, err := os.Open(p)
	if errors.Is(err, fs.ErrNotExist) {
		return emptyIndex(), nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	key, ok := keyOf(fi)
	if !ok || s.index.idx == nil || key != s.index.file {
		b, err := io.ReadAll(f)
		if err != nil {
			return nil, err
		}
		var idx ocispec.Index
		if err := json.Unmarshal(b, &idx); err != nil {
			return nil, fmt.Errorf("store index %s is corrupt: %v: %w", p, err, errdefs.ErrDataLoss)
		}
		s.index.file, s.index.idx = key, &idx
		if !ok {
			s.index.idx = nil
			return &idx, nil
		}
	}
	return s.index.copy(), nil
}

func (s *Store) writeIndex(idx *ocispec.Index) error {
	slices.SortFunc(idx.Manifests, func(a, b ocispec.Descriptor) int {
		return strings.Compare(a.Annotations[RefAnnotation], b.Annotations[RefAnnotation])
	})
	b, err := json.MarshalIndent(idx, "", "  ")
	if err != nil {
		return err
	}
	return s.writeFile(ocispec.ImageIndexFile, append(b, '\n'))
}

// Tags lists the tagged manifests in tag order.
func (s *Store) Tags(ctx context.Context) ([]ocispec.Descriptor, error) {
	idx, err := s.readIndex()
	if err != nil {
		return nil, err
	}
	return idx.Manifests, nil
}

// Resolve finds the manifest tagged ref.
func (s *Store) Resolve(ctx context.Context, ref string) (ocispec.Descriptor, error) {
	idx, err := s.readIndex()
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	for _, d := range idx.Manifests {
		if d.Annotations[RefAnnotation] == ref {
			return d, nil
		}
	}
	return ocispec.Descriptor{}, fmt.Errorf("%s: %w", ref, errdefs.ErrNotFound)
}

// Tag points ref at desc. An existing tag for other content is replaced
// only with force; retagging the same content is a no-op.
func (s *Store) Tag(ctx context.Context, ref string, desc ocispec.Descriptor, force bool) error {
	unlock, err := s.lock(lockIndex, true)
	if err != nil {
		return err
	}
	defer unlock()
	idx, err := s.readIndex()
	if err != nil {
		return err
	}
	if !s.Exists(desc.Digest) {
		return fmt.Errorf("tag %s: manifest %s: %w", ref, desc.Digest, errdefs.ErrNotFound)
	}
	desc.Annotations = withRef(desc.Annotations, ref)
	for i, d := range idx.Manifests {
		if d.Annotations[RefAnnotation] != ref {
			continue
		}
		if d.Digest == desc.Digest {
			return nil
		}
		if !force {
			return fmt.Errorf("tag %s already names %s: %w", ref, d.Digest, errdefs.ErrAlreadyExists)
		}
		idx.Manifests[i] = desc
		return s.writeIndex(idx)
	}
	idx.Manifests = append(idx.Manifests, desc)
	return s.writeIndex(idx)
}

func withRef(a map[string]string, ref string) map[string]string {
	out := make(map[string]string, len(a)+1)
	for k, v := range a {
		out[k] = v
	}
	out[RefAnnotation] = ref
	return out
}

// Untag removes ref. Blobs stay until GC.
func (s *Store) Untag(ctx context.Context, ref string) (ocispec.Descriptor, error) {
	unlock, err := s.lock(lockIndex, true)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	defer unlock()
	idx, err := s.readIndex()
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	for i, d := range idx.Manifests {
		if d.Annotations[RefAnnotation] == ref {
			idx.Manifests = slices.Delete(idx.Manifests, i, i+1)
			return d, s.writeIndex(idx)
		}
	}
	return ocispec.Descriptor{}, fmt.Errorf("%s: %w", ref, errdefs.ErrNotFound)
}

// SmallBlobs lists the blobs of at most max bytes.
func (s *Store) SmallBlobs(max int64) ([]ocispec.Descriptor, error) {
	ents, err := os.ReadDir(filepath.Join(s.dir, "blobs", "sha256"))
	if err != nil {
		return nil, err
	}
	var out []ocispec.Descriptor
	for _, e := range ents {
		if info, err := e.Info(); err == nil && info.Size() <= max {
			out = append(out, ocispec.Descriptor{Digest: digest.NewDigestFromEncoded(digest.SHA256, e.Name()), Size: info.Size()})
		}
	}
	return out, nil
}

// GCResult says what a collection removed.
type GCResult struct {
	Blobs   int   `json:"blobs_removed"`
	Bytes   int64 `json:"bytes_freed"`
	Ingests int   `json:"ingests_removed"`
}

// Marks says what a collection keeps beyond what the tags reach
// (containerd's leases and gc labels are the model).
type Marks struct {
	// Refs returns the blobs a JSON blob refers to (nil for a leaf).
	Refs func(ocispec.Descriptor, []byte) ([]ocispec.Descriptor, error)
	// Roots are kept, and what they refer to, whatever the tags say;
	// so are LiveRoots', read once the collection holds the store (what
	// a writer records as it ends, a sandbox's state, is then there).
	Roots     []ocispec.Descriptor
	LiveRoots func() ([]ocispec.Descriptor, error)
	// Owner says, of a small untagged blob, the blob that keeps it (a
	// manifest: its image) and its media type; a blob whose owner is
	// kept is kept, with what it refers to. nil: none.
	Owner func(b []byte) (owner digest.Digest, mediaType string, ok bool) // LeasedAs is the media type of the blobs live leases hold: each is
	// a root of that type (Lease).
	LeasedAs string
}

// maxOwned bounds the blobs Owner is asked about.
const maxOwned = 64 << 10

// GC removes every blob that m does not reach from a tag, a root, a live
// lease or a kept owner, and every leftover ingest. It waits for writers holding
// the shared lock.
func (s *Store) GC(ctx context.Context, m Marks) (GCResult, error) {
	var res GCResult
	unlock, err := s.lock(lockGC, true)
	if err != nil {
		return res, err
	}
	defer unlock()
	idx, err := s.readIndex()
	if err != nil {
		return res, err
	}
	dir := filepath.Join(s.dir, "blobs", "sha256")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return res, err
	}
	live := map[digest.Digest]bool{}
	queue := append(slices.Clone(idx.Manifests), m.Roots...)
	if m.LiveRoots != nil {
		more, err := m.LiveRoots()
		if err != nil {
			return res, err
		}
		queue = append(queue, more...)
	}
	leased, err := s.Leased()
	if err != nil {
		return res, err
	}
	for _, d := range slices.Sorted(maps.Keys(leased)) {
		queue = append(queue, ocispec.Descriptor{MediaType: m.LeasedAs, Digest: d})
	}
	mark := func() error {
		for len(queue) > 0 {
			d := queue[0]
			queue = queue[1:]
			if live[d.Digest] {
				continue
			}
			live[d.Digest] = true
			if !isJSON(d.MediaType) || m.Refs == nil {
				continue
			}
			b, err := s.ReadBlob(d.Digest, 4<<20)
			if errors.Is(err, errdefs.ErrNotFound) {
				continue
			}
			if err != nil {
				return fmt.Errorf("gc: %w", err)
			}
			more, err := m.Refs(d, b)
			if err != nil {
				return fmt.Errorf("gc: %s: %w", d.Digest, err)
			}
			queue = append(queue, more...)
		}
		return nil
	}
	if err := mark(); err != nil {
		return res, err
	}
	// Owned blobs, to a fixed point: a kept manifest's config may be a
	// snapshot's, whose lowers keep more images, and their manifests.
	candidates := s.ownedBlobs(ents, live, m)
	for grew := true; grew; {
		grew = false
		for _, c := range candidates {
			if live[c.owner] && !live[c.self.Digest] {
				queue, grew = append(queue, c.self), true
			}
		}
		if err := mark(); err != nil {
			return res, err
		}
	}
	if err := s.sweep(dir, ents, live, &res); err != nil {
		return res, err
	}
	if err := s.sweepPacked(&res); err != nil {
		return res, err
	}
	s.sweepLocks()
	return res, durable.SyncDir(dir)
}

// owned is a small untagged blob and the blob that keeps it (Marks.Owner).
type owned struct {
	owner digest.Digest
	self  ocispec.Descriptor
}

// ownedBlobs are the blobs of ents, not live, that m.Owner says a blob
// keeps.
func (s *Store) ownedBlobs(ents []os.DirEntry, live map[digest.Digest]bool, m Marks) []owned {
	var candidates []owned
	if m.Owner != nil {
		for _, e := range ents {
			d := digest.NewDigestFromEncoded(digest.SHA256, e.Name())
			if info, err := e.Info(); live[d] || err != nil || info.Size() > maxOwned {
				continue
			}
			b, err := s.ReadBlob(d, maxOwned)
			if err != nil {
				continue
			}
			if owner, mt, ok := m.Owner(b); ok {
				candidates = append(candidates, owned{owner, ocispec.Descriptor{MediaType: mt, Digest: d, Size: int64(len(b))}})
			}
		}
	}
	return candidates
}

// sweep removes the blobs of ents (in dir) not live and every leftover
// ingest, counting them in res.
func (s *Store) sweep(dir string, ents []os.DirEntry, live map[digest.Digest]bool, res *GCResult) error {
	for _, e := range ents {
		d := digest.NewDigestFromEncoded(digest.SHA256, e.Name())
		if live[d] {
			continue
		}
		if info, err := e.Info(); err == nil {
			res.Bytes += Allocated(info)
		}
		if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
			return err
		}
		res.Blobs++
	}
	ing, _ := os.ReadDir(filepath.Join(s.dir, "ingest"))
	for _, e := range ing {
		switch {
		case strings.HasPrefix(e.Name(), "blob."):
			info, err := e.Info()
			if err == nil && os.Remove(filepath.Join(s.dir, "ingest", e.Name())) == nil {
				res.Ingests++
				res.Bytes += Allocated(info)
			}
		case strings.HasPrefix(e.Name(), "partial-"):
			// What an interrupted transfer kept to take up later: gone
			// unless a transfer holds it now (that one goes on; a later
			// one starts over).
			if n, ok := removeUnheld(filepath.Join(s.dir, "ingest", e.Name())); ok {
				res.Ingests++
				res.Bytes += n
			}
		case strings.HasPrefix(e.Name(), "tree."), strings.HasPrefix(e.Name(), "layer."):
			// A killed VM image build's stack of trees (package vm), an
			// overlay on m beside its upper and work, and the layers it
			// mounted as trees.
			p := filepath.Join(s.dir, "ingest", e.Name())
			detach(filepath.Join(p, "m"))
			detach(p)
			if removeUnmounted(p) {
				res.Ingests++
			}
		} // index.json and oci-layout temps belong to their lock
	}
	return nil
}

// SweepPartials removes what interrupted transfers kept to take up
// later (resumable ingests) untouched for longer than age, unless a
// transfer holds them now: a pull taken up after that starts over. It
// says how many it removed and their bytes.
func (s *Store) SweepPartials(age time.Duration) (n int, bytes int64) {
	ing, _ := os.ReadDir(filepath.Join(s.dir, "ingest"))
	for _, e := range ing {
		info, err := e.Info()
		if !strings.HasPrefix(e.Name(), "partial-") || err != nil || time.Since(info.ModTime()) < age {
			continue
		}
		if b, ok := removeUnheld(filepath.Join(s.dir, "ingest", e.Name())); ok {
			n, bytes = n+1, bytes+b
		}
	}
	return n, bytes
}

// removeUnheld removes path, a resumable ingest, unless a transfer holds
// its lock, and says how many bytes it held.
func removeUnheld(path string) (int64, bool) {
	f, err := os.Open(path)
	if err != nil {
		return 0, false
	}
	defer f.Close()
	if unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil || !samePath(f, path) {
		return 0, false
	}
	st, err := f.Stat()
	if err != nil || os.Remove(path) != nil {
		return 0, false
	}
	return Allocated(st), true
}

// Allocated is what fi's file takes on disk: its size, or less where it
// is sparse (a VM image's disk, an interrupted build's).
func Allocated(fi os.FileInfo) int64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return min(fi.Size(), st.Blocks*512)
	}
	return fi.Size()
}

// samePath says whether path still names the file f opened.
func samePath(f *os.File, path string) bool {
	a, err := f.Stat()
	if err != nil {
		return false
	}
	b, err := os.Stat(path)
	return err == nil && os.SameFile(a, b)
}

func isJSON(mt string) bool {
	return strings.HasSuffix(mt, "+json") || mt == "application/json"
}

// Writer holds the shared GC lock while it adds blobs that no tag reaches
// yet; call the returned function when they are tagged or abandoned.
func (s *Store) Writer() (func(), error) {
	return s.lock(lockGC, false)
}
