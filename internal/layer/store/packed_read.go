package store

import (
	"bufio"
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/durable"
	"github.com/dsec-project/dsec/internal/layer/dedup"
)

// Reading a packed layer: its image rebuilt, whole or as it is read,
// from its head and the chunk blobs its extents name.

func checkSum(sum []byte, d digest.Digest) error {
	if got := hex.EncodeToString(sum); got != d.Encoded() {
		return fmt.Errorf("layer %s made again from its chunks hashes to sha256:%s: %w", d, got, errdefs.ErrDataLoss)
	}
	return nil
}

// openPacked makes a packed layer's canonical image again, checked, in
// an unlinked file of the ingest directory.
func (s *Store) openPacked(d digest.Digest) (*os.File, error) {
	pi, err := s.readPackInfo(d)
	if err != nil {
		return nil, err
	}
	head, err := os.Open(s.BlobPath(d))
	if err != nil {
		return nil, err
	}
	defer head.Close()
	fi, err := head.Stat()
	if err != nil {
		return nil, err
	}
	f, err := os.CreateTemp(filepath.Join(s.dir, "ingest"), "blob.whole-")
	if err != nil {
		return nil, classify("rebuild layer", err)
	}
	os.Remove(f.Name())
	h := sha256.New()
	bw := bufio.NewWriterSize(io.MultiWriter(f, h), 1<<20)
	err = s.rebuild(bw, head, fi.Size(), pi, nil)
	if err == nil {
		err = bw.Flush()
	}
	if err == nil {
		err = checkSum(h.Sum(nil), d)
	}
	if err == nil {
		_, err = f.Seek(0, io.SeekStart)
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// PackedReader reads ranges of packed layer d's canonical image as they
// are asked for: the head's bytes, with the file data its extents put
// in read from the chunk blobs. Nothing is written: a host reading a
// shared remote lazily (lazy's whole image of a packed layer, for a
// microVM or a recording) needs only read access, and checks what it
// reads against the layer's window table.
func (s *Store) PackedReader(d digest.Digest) (*PackedReader, error) {
	pi, err := s.readPackInfo(d)
	if err != nil {
		return nil, err
	}
	head, err := os.Open(s.BlobPath(d))
	if err != nil {
		return nil, err
	}
	ext := slices.Clone(pi.Extents)
	slices.SortFunc(ext, func(a, b dedup.Extent) int { return cmp.Compare(a.At, b.At) })
	return &PackedReader{s: s, head: head, ext: ext, blobs: map[digest.Digest]*os.File{}}, nil
}

// PackedReader is a packed layer's canonical image, read on demand.
type PackedReader struct {
	s    *Store
	head *os.File
	ext  []dedup.Extent // by At

	mu    sync.Mutex
	blobs map[digest.Digest]*os.File
}

// ReadAt reads len(p) bytes at off; it fails rather than return bytes
// it could not read.
func (r *PackedReader) ReadAt(p []byte, off int64) (int, error) {
	n, err := r.head.ReadAt(p, off) // the file data's blocks read as holes: zeros
	if err != nil && !(errors.Is(err, io.EOF) && n > 0) {
		return n, err
	}
	end := off + int64(n)
	const bs = 4096
	i, _ := slices.BinarySearchFunc(r.ext, off, func(e dedup.Extent, o int64) int {
		return cmp.Compare((int64(e.At)+int64(e.Blocks))*bs, o+1)
	})
	for ; i < len(r.ext) && int64(r.ext[i].At)*bs < end; i++ {
		e := r.ext[i]
		lo, hi := max(off, int64(e.At)*bs), min(end, (int64(e.At)+int64(e.Blocks))*bs)
		if lo >= hi {
			continue
		}
		b, err := r.blob(e.Blob)
		if err != nil {
			return 0, err
		}
		if _, err := b.ReadAt(p[lo-off:hi-off], int64(e.Block)*bs+lo-int64(e.At)*bs); err != nil {
			return 0, fmt.Errorf("chunk blob %s: %w", e.Blob, err)
		}
	}
	return n, err
}

func (r *PackedReader) blob(d digest.Digest) (*os.File, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if f := r.blobs[d]; f != nil {
		return f, nil
	}
	f, err := os.Open(r.s.chunkPath(d))
	if err != nil {
		return nil, fmt.Errorf("chunk blob %s: %w", d, err)
	}
	r.blobs[d] = f
	return f, nil
}

// Close closes the head and the chunk blobs.
func (r *PackedReader) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, f := range r.blobs {
		f.Close()
	}
	return r.head.Close()
}

// Whole is a file that holds layer d's canonical image for as long as
// the layer is kept, whatever packs or unpacks it meanwhile (a microVM
// maps a layer as one file, opened after this returns): for a whole
// layer, a hard link to its blob; for a packed one, a copy made again
// from its chunks and checked. Both are packed/<hex>.whole.
func (s *Store) Whole(d digest.Digest) (string, error) {
	if err := d.Validate(); err != nil {
		return "", fmt.Errorf("%w: %v", errdefs.ErrInvalidArgument, err)
	}
	p := s.packedPath(d, ".whole")
	if _, err := os.Stat(p); err == nil {
		return p, nil
	}
	release, err := s.Writer() // gc sweeps the ingest directory
	if err != nil {
		return "", err
	}
	defer release()
	if err := os.MkdirAll(filepath.Join(s.dir, "packed"), 0o755); err != nil {
		return "", err
	}
	if !s.Packed(d) {
		// Linked while the layer has no record: the blob linked is the
		// whole image (a pack writes the record before its head).
		tmp := filepath.Join(s.dir, "ingest", "blob.link-"+d.Encoded())
		os.Remove(tmp)
		if err := os.Link(s.BlobPath(d), tmp); err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return "", fmt.Errorf("layer %s: %w", d, errdefs.ErrNotFound)
			}
			return "", err
		}
		defer os.Remove(tmp)
		if !s.Packed(d) {
			if err := os.Rename(tmp, p); err != nil {
				return "", err
			}
			return p, nil
		}
	}
	if err := s.rebuildTo(d, p); err != nil {
		return "", err
	}
	return p, nil
}

// rebuildTo makes packed layer d's canonical image again, checks it,
// syncs it and renames it to path.
func (s *Store) rebuildTo(d digest.Digest, path string) error {
	f, err := s.openPacked(d)
	if err != nil {
		return err
	}
	defer f.Close()
	tmp, err := os.CreateTemp(filepath.Join(s.dir, "ingest"), "blob.whole-")
	if err != nil {
		return classify("rebuild layer", err)
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	if _, err := io.Copy(tmp, f); err != nil {
		return classify("rebuild layer", err)
	}
	if err := tmp.Sync(); err != nil {
		return classify("rebuild layer", err)
	}
	if err := tmp.Chmod(0o444); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return classify("rebuild layer", err)
	}
	return durable.SyncDir(filepath.Dir(path))
}
