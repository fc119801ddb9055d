package store

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/durable"
	"github.com/dsec-project/dsec/internal/layer/dedup"
	"github.com/dsec-project/dsec/internal/mount"
)

// Deduplicated layers. A store with dedup on (SetDedup) packs each layer
// it is given (Pack, package dedup): the layer's file data goes, chunk
// by chunk, into chunk blobs that every layer shares, and the layer
// keeps a metadata image whose files point into them. The kernel mounts
// that image with its chunk blobs as devices (MountLayer).
//
//	dedup                 present: layers are packed as they are added
//	packed/<hex>.erofs    a packed layer's metadata image
//	packed/<hex>.json     its chunk blobs (devices) and its extents
//	packed/<hex>.whole    the whole image of a layer a microVM maps
//	                      (Whole): a hard link to a whole layer's blob,
//	                      or a packed one's image made again
//	packed/<hex>.pending  a pack under way, between its record and its
//	                      head (gc finishes one that was killed)
//	chunks/<hex>          a chunk blob, named by the sha256 of its bytes
//	chunks/<hex>.idx      its chunks (dedup.EncodeEntries)
//	chunks/<hex>.windows  its window table (dedup.WindowTable): what a
//	                      host reading the store lazily checks
//
// The layer's blob (blobs/sha256/<hex>) stays, as its head: the canonical
// image with its file data left as holes, so it takes the metadata's
// size on disk while its size, its name and everything that only looks
// at them stay as they were. Open and Whole make the canonical image
// again (the head's metadata, the chunks' data) and check its digest.
// A mount made before the layer was packed keeps the canonical file it
// opened: Pack renames the head in, it never writes into the blob.

// packInfo is packed/<hex>.json.
type packInfo struct {
	Devices []digest.Digest `json:"devices"`
	Extents []dedup.Extent  `json:"extents"`
	Logical int64           `json:"logical"`
	Shared  int64           `json:"shared"`
	Holes   int64           `json:"holes"`
}

const maxPackInfo = 256 << 20

func (s *Store) packedPath(d digest.Digest, ext string) string {
	return filepath.Join(s.dir, "packed", d.Encoded()+ext)
}

func (s *Store) chunkPath(d digest.Digest) string { return ChunkPath(s.dir, d) }

// ChunkPath is chunk blob d of the store at dir, for a reader of its
// files that has not opened it.
func ChunkPath(dir string, d digest.Digest) string {
	return filepath.Join(dir, "chunks", d.Encoded())
}

// Dedup says whether the store packs the layers it is given: it was
// told so (SetDedup), unless DSEC_STORE_DEDUP says otherwise (1 or 0)
// for the stores this process builds into (a dir: remote's store, pushed
// to, follows its marker alone: DedupMarked).
func (s *Store) Dedup() bool {
	switch os.Getenv("DSEC_STORE_DEDUP") {
	case "1", "true":
		return true
	case "0", "false":
		return false
	}
	return s.DedupMarked()
}

// DedupMarked says whether the store was told to pack (SetDedup),
// whatever DSEC_STORE_DEDUP says: a dir: remote's store, which hosts
// share, follows only that.
func (s *Store) DedupMarked() bool {
	_, err := os.Stat(filepath.Join(s.dir, "dedup"))
	return err == nil
}

// SetDedup turns packing of new layers on or off. It packs or unpacks
// no layer: Pack and Unpack do.
func (s *Store) SetDedup(on bool) error {
	p := filepath.Join(s.dir, "dedup")
	if !on {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		return durable.SyncDir(s.dir)
	}
	return s.writeFile("dedup", []byte("layers are packed into shared chunks: dsec layer dedup\n"))
}

// IsPacked says whether the store at dir keeps layer d packed, for a
// reader of its blob files that has not opened it.
func IsPacked(dir string, d digest.Digest) bool {
	return (&Store{dir: dir}).Packed(d)
}

// Packed says whether layer d is kept packed.
func (s *Store) Packed(d digest.Digest) bool {
	if d.Validate() != nil {
		return false
	}
	_, err := os.Stat(s.packedPath(d, ".json"))
	return err == nil
}

func (s *Store) readPackInfo(d digest.Digest) (*packInfo, error) {
	b, err := os.ReadFile(s.packedPath(d, ".json"))
	if err != nil {
		return nil, err
	}
	if len(b) > maxPackInfo {
		return nil, fmt.Errorf("packed layer %s: its record is %d bytes: %w", d, len(b), errdefs.ErrDataLoss)
	}
	var pi packInfo
	if err := json.Unmarshal(b, &pi); err != nil {
		return nil, fmt.Errorf("packed layer %s: %v: %w", d, err, errdefs.ErrDataLoss)
	}
	for _, x := range pi.Devices {
		if x.Validate() != nil {
			return nil, fmt.Errorf("packed layer %s: device %q: %w", d, x, errdefs.ErrDataLoss)
		}
	}
	return &pi, nil
}

// PackedLayer is how a lazy reader of the store finds a packed layer's
// parts: its metadata image's path, the chunk blobs it reads, in the
// order to mount them in, and where its canonical image's file data
// lies in them (dedup.HotIn finds its hot region there).
func (s *Store) PackedLayer(d digest.Digest) (meta string, devices []digest.Digest, extents []dedup.Extent, err error) {
	pi, err := s.readPackInfo(d)
	if err != nil {
		return "", nil, nil, err
	}
	return s.packedPath(d, ".erofs"), pi.Devices, pi.Extents, nil
}

// ChunkBlob is the path of chunk blob d, its size and its window table
// (dedup.WindowSize windows), for a lazy reader. A blob packed before
// tables were kept gets its table made now, and kept if the store is
// writable.
func (s *Store) ChunkBlob(d digest.Digest) (path string, size int64, table []byte, err error) {
	if err := d.Validate(); err != nil {
		return "", 0, nil, fmt.Errorf("chunk blob %q: %w", d, errdefs.ErrInvalidArgument)
	}
	path = s.chunkPath(d)
	fi, err := os.Stat(path)
	if err != nil {
		return "", 0, nil, err
	}
	size = fi.Size()
	want := int((size + dedup.WindowSize - 1) / dedup.WindowSize * 32)
	table, err = os.ReadFile(path + ".windows")
	if err == nil && len(table) == want {
		return path, size, table, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return "", 0, nil, err
	}
	defer f.Close()
	if table, err = dedup.WindowTable(f); err != nil {
		return "", 0, nil, err
	}
	_ = durable.WriteFileIn(filepath.Join(s.dir, "ingest"), path+".windows", table, 0o444) // a read-only store: made again next time
	return path, size, table, nil
}

// MountLayer mounts layer d, an EROFS image, on target: its blob, or its
// metadata image with its chunk blobs when it is packed. A pack that
// runs meanwhile writes the layer's record before it renames the head
// in, so a layer still unpacked once its blob is mounted was mounted
// whole; else the mount is made again, packed.
func (s *Store) MountLayer(d digest.Digest, target string) error {
	if !s.Packed(d) {
		if err := mount.EROFS(s.BlobPath(d)).Mount(target); err != nil {
			return err
		}
		if !s.Packed(d) {
			return nil
		}
		if err := mount.Unmount(target); err != nil {
			return err
		}
	}
	pi, err := s.readPackInfo(d)
	if err != nil {
		return err
	}
	devs := make([]string, len(pi.Devices))
	for i, x := range pi.Devices {
		devs[i] = s.chunkPath(x)
	}
	return mount.EROFSDevices(s.packedPath(d, ".erofs"), devs).Mount(target)
}

// OpenLayer opens layer d to read its tree: its blob, or its metadata
// image and its chunk blobs in device order (go-erofs reads them with
// WithExtraDevices), without making its canonical image again.
func (s *Store) OpenLayer(d digest.Digest) (img *os.File, devices []*os.File, err error) {
	if !s.Packed(d) {
		img, err = s.Open(d)
		return img, nil, err
	}
	pi, err := s.readPackInfo(d)
	if err != nil {
		return nil, nil, err
	}
	if img, err = os.Open(s.packedPath(d, ".erofs")); err != nil {
		return nil, nil, err
	}
	for _, x := range pi.Devices {
		f, err := os.Open(s.chunkPath(x))
		if err != nil {
			img.Close()
			for _, f := range devices {
				f.Close()
			}
			return nil, nil, fmt.Errorf("packed layer %s: %w", d, err)
		}
		devices = append(devices, f)
	}
	return img, devices, nil
}

// chunkIndex reads every chunk blob's index. A chunk two blobs hold is
// found in the first by name.
func (s *Store) chunkIndex() (*dedup.MapIndex, error) {
	idx := dedup.NewMapIndex()
	ents, err := os.ReadDir(filepath.Join(s.dir, "chunks"))
	if errors.Is(err, fs.ErrNotExist) {
		return idx, nil
	}
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".idx")
		if !ok {
			continue
		}
		d := digest.NewDigestFromEncoded(digest.SHA256, name)
		if d.Validate() != nil {
			continue
		}
		fi, err := os.Stat(s.chunkPath(d))
		if err != nil {
			continue // an index whose blob was never renamed in
		}
		b, err := os.ReadFile(filepath.Join(s.dir, "chunks", e.Name()))
		if err != nil {
			return nil, err
		}
		blocks := uint64(fi.Size()) / 4096
		es, err := dedup.DecodeEntries(b, blocks)
		if err != nil {
			return nil, fmt.Errorf("chunk blob %s: %w", d, err)
		}
		idx.Add(d, blocks, es)
	}
	return idx, nil
}

// Pack keeps layer d packed: its file data in chunk blobs, stored once
// for every layer that holds it. Packing a packed layer does nothing.
// An image dsec did not build (dedup.ErrNotCanonical) stays as it is.
func (s *Store) Pack(ctx context.Context, d digest.Digest) (*dedup.Result, error) {
	release, err := s.Writer()
	if err != nil {
		return nil, err
	}
	defer release()
	unlock, err := s.Exclusive(ctx, "pack")
	if err != nil {
		return nil, err
	}
	defer unlock()
	if s.Packed(d) {
		return nil, nil
	}
	img, err := s.Open(d)
	if err != nil {
		return nil, err
	}
	defer img.Close()
	fi, err := img.Stat()
	if err != nil {
		return nil, err
	}
	for _, dir := range []string{"packed", "chunks"} {
		if err := os.MkdirAll(filepath.Join(s.dir, dir), 0o755); err != nil {
			return nil, err
		}
	}
	idx, err := s.chunkIndex()
	if err != nil {
		return nil, err
	}
	ing := filepath.Join(s.dir, "ingest")
	meta, err := os.CreateTemp(ing, "blob.meta-")
	if err != nil {
		return nil, classify("pack", err)
	}
	defer os.Remove(meta.Name())
	defer meta.Close()
	blob, err := os.CreateTemp(ing, "blob.chunks-")
	if err != nil {
		return nil, classify("pack", err)
	}
	defer os.Remove(blob.Name())
	defer blob.Close()
	res, err := dedup.Pack(img, meta, blob, idx)
	if err != nil {
		return nil, fmt.Errorf("pack layer %s: %w", d, err)
	}
	// The head, checked: it and the chunks make the canonical image
	// (the new chunks read from where they were written) before
	// anything is published.
	pi := &packInfo{Devices: res.Devices, Extents: res.Extents, Logical: res.Logical, Shared: res.Shared, Holes: res.Holes}
	head, err := s.newHead(d, img, fi.Size(), pi, map[digest.Digest]string{res.Blob: blob.Name()})
	if err != nil {
		return nil, fmt.Errorf("pack layer %s: %w", d, err)
	}
	defer os.Remove(head.Name())
	defer head.Close()
	if res.Blob != "" {
		if err := s.publishChunks(blob, res); err != nil {
			return nil, err
		}
	}
	for _, f := range []*os.File{meta, head} {
		if err := f.Sync(); err != nil {
			return nil, classify("pack", err)
		}
		if err := f.Chmod(0o444); err != nil {
			return nil, err
		}
	}
	if err := os.Rename(meta.Name(), s.packedPath(d, ".erofs")); err != nil {
		return nil, classify("pack", err)
	}
	b, err := json.Marshal(pi)
	if err != nil {
		return nil, err
	}
	// The record makes the layer packed; until the head is renamed in,
	// its blob is still the canonical image, which is as good. The
	// pending mark says so to a gc after a kill in between (finishHead).
	if err := durable.WriteFileIn(ing, s.packedPath(d, ".pending"), nil, 0o444); err != nil {
		return nil, classify("pack", err)
	}
	if err := durable.WriteFileIn(ing, s.packedPath(d, ".json"), b, 0o444); err != nil {
		return nil, classify("pack", err)
	}
	if err := os.Rename(head.Name(), s.BlobPath(d)); err != nil {
		return nil, classify("pack", err)
	}
	if err := durable.SyncDir(filepath.Dir(s.BlobPath(d))); err != nil {
		return nil, err
	}
	os.Remove(s.packedPath(d, ".pending"))
	return res, nil
}

// finishHead puts the head in place of packed layer d's blob, which a
// pack killed after writing the layer's record left whole (its pending
// mark); gc calls it, under the exclusive lock. A blob that is the head
// already gets an identical one.
func (s *Store) finishHead(d digest.Digest) error {
	pi, err := s.readPackInfo(d)
	if err != nil {
		return err
	}
	img, err := os.Open(s.BlobPath(d))
	if err != nil {
		return err
	}
	defer img.Close()
	fi, err := img.Stat()
	if err != nil {
		return err
	}
	head, err := s.newHead(d, img, fi.Size(), pi, nil)
	if err != nil {
		return err
	}
	defer os.Remove(head.Name())
	defer head.Close()
	if err := head.Sync(); err != nil {
		return classify("pack", err)
	}
	if err := head.Chmod(0o444); err != nil {
		return err
	}
	if err := os.Rename(head.Name(), s.BlobPath(d)); err != nil {
		return classify("pack", err)
	}
	return durable.SyncDir(filepath.Dir(s.BlobPath(d)))
}

// newHead writes the head of canonical image img (size bytes), packed
// as pi, to a file of the ingest directory, and checks that it and the
// chunk blobs (from at[digest] where given: a pack's new blob, not
// published yet) make layer d again. The caller removes the file.
func (s *Store) newHead(d digest.Digest, img io.ReaderAt, size int64, pi *packInfo, at map[digest.Digest]string) (*os.File, error) {
	head, err := os.CreateTemp(filepath.Join(s.dir, "ingest"), "blob.head-")
	if err != nil {
		return nil, classify("pack", err)
	}
	err = head.Truncate(size)
	if err == nil {
		err = dedup.Head(head, img, size, pi.Extents)
	}
	if err != nil {
		err = classify("pack", err)
	} else {
		h := sha256.New()
		if err = s.rebuild(h, head, size, pi, at); err == nil {
			err = checkSum(h.Sum(nil), d)
		}
	}
	if err != nil {
		head.Close()
		os.Remove(head.Name())
		return nil, err
	}
	return head, nil
}

// publishChunks renames a pack's new chunk blob in, after its index.
func (s *Store) publishChunks(blob *os.File, res *dedup.Result) error {
	if err := blob.Sync(); err != nil {
		return classify("pack", err)
	}
	if err := blob.Chmod(0o444); err != nil {
		return err
	}
	ing := filepath.Join(s.dir, "ingest")
	if err := durable.WriteFileIn(ing, s.chunkPath(res.Blob)+".windows", res.Windows, 0o444); err != nil {
		return classify("pack", err)
	}
	if err := durable.WriteFileIn(ing, s.chunkPath(res.Blob)+".idx", dedup.EncodeEntries(res.New), 0o444); err != nil {
		return classify("pack", err)
	}
	if err := os.Rename(blob.Name(), s.chunkPath(res.Blob)); err != nil {
		return classify("pack", err)
	}
	return durable.SyncDir(filepath.Join(s.dir, "chunks"))
}

// rebuild writes the canonical image made from head and pi to w,
// reading a chunk blob from at[digest] where given (a pack's new blob,
// not published yet), else from the store.
func (s *Store) rebuild(w io.Writer, head io.ReaderAt, size int64, pi *packInfo, at map[digest.Digest]string) error {
	var opened []*os.File
	defer func() {
		for _, o := range opened {
			o.Close()
		}
	}()
	err := dedup.Rebuild(w, head, size, pi.Extents, func(b digest.Digest) (io.ReaderAt, error) {
		p, ok := at[b]
		if !ok {
			p = s.chunkPath(b)
		}
		o, err := os.Open(p)
		if err != nil {
			return nil, fmt.Errorf("chunk blob %s: %w", b, err)
		}
		opened = append(opened, o)
		return o, nil
	})
	if err != nil {
		return classify("rebuild layer", err)
	}
	return nil
}

// Unpack keeps a packed layer whole again: its canonical image, made
// again from its chunks and checked, replaces its head. Chunk blobs no
// layer uses any longer are GC's to remove. It needs the free space of
// the whole image.
func (s *Store) Unpack(ctx context.Context, d digest.Digest) error {
	release, err := s.Writer()
	if err != nil {
		return err
	}
	defer release()
	unlock, err := s.Exclusive(ctx, "pack")
	if err != nil {
		return err
	}
	defer unlock()
	if !s.Packed(d) {
		return nil
	}
	if err := s.rebuildTo(d, s.BlobPath(d)); err != nil {
		return err
	}
	s.dropPacked(d)
	return durable.SyncDir(filepath.Join(s.dir, "packed"))
}

// dropPacked removes what kept layer d packed, its record first: a
// metadata image or copy left without one is a leftover gc removes.
func (s *Store) dropPacked(d digest.Digest) {
	for _, ext := range []string{".json", ".erofs", ".whole", ".pending"} {
		os.Remove(s.packedPath(d, ext))
	}
}

// PackedStats sums what packing keeps: the layers' file data (logical),
// the part of it that was found stored already or is zeros, and what the
// metadata images, records, rebuilt copies and chunk blobs take on disk.
type PackedStats struct {
	Layers  int   `json:"layers"`
	Logical int64 `json:"logical_bytes"`
	Shared  int64 `json:"shared_bytes"`
	Holes   int64 `json:"hole_bytes"`
	// Stored is what the chunk blobs and the packed layers' records and
	// metadata images take; the layers' heads are counted as blobs.
	Stored int64 `json:"stored_bytes"`
	Chunks int64 `json:"chunk_blob_bytes"`
	// Whole is what copies made again for microVMs take.
	Whole int64 `json:"whole_bytes"`
}

// PackStats reads every packed layer's record and what is on disk.
func (s *Store) PackStats() (PackedStats, error) {
	var st PackedStats
	ents, _ := os.ReadDir(filepath.Join(s.dir, "packed"))
	for _, e := range ents {
		info, err := e.Info()
		if err != nil {
			continue
		}
		switch {
		case strings.HasSuffix(e.Name(), ".whole"):
			if sys, ok := info.Sys().(*syscall.Stat_t); !ok || sys.Nlink == 1 {
				st.Whole += Allocated(info) // (a link to a whole blob takes nothing more)
			}
			continue
		case strings.HasSuffix(e.Name(), ".json"):
			d := digest.NewDigestFromEncoded(digest.SHA256, strings.TrimSuffix(e.Name(), ".json"))
			if pi, err := s.readPackInfo(d); err == nil {
				st.Layers++
				st.Logical += pi.Logical
				st.Shared += pi.Shared
				st.Holes += pi.Holes
			}
		}
		st.Stored += Allocated(info)
	}
	chunks, _ := os.ReadDir(filepath.Join(s.dir, "chunks"))
	for _, e := range chunks {
		if info, err := e.Info(); err == nil {
			st.Stored += Allocated(info)
			if !strings.Contains(e.Name(), ".") { // not .idx, .windows
				st.Chunks += Allocated(info)
			}
		}
	}
	return st, nil
}

// sweepPacked removes what kept a layer packed once its blob is gone,
// then the chunk blobs no packed layer uses. It runs under the
// exclusive GC lock: no pack is under way.
func (s *Store) sweepPacked(res *GCResult) error {
	ents, _ := os.ReadDir(filepath.Join(s.dir, "packed"))
	used := map[digest.Digest]bool{}
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			continue
		}
		d := digest.NewDigestFromEncoded(digest.SHA256, name)
		if _, err := os.Stat(s.BlobPath(d)); errors.Is(err, fs.ErrNotExist) {
			s.dropPacked(d)
			continue
		}
		pi, err := s.readPackInfo(d)
		if err != nil {
			// A record it cannot read may need any chunk: all are kept
			// (the layer's reads fail, and say so, until it goes).
			return nil
		}
		for _, x := range pi.Devices {
			used[x] = true
		}
	}
	// Leftovers: a metadata image without its record (a pack or gc that
	// was killed), a whole copy or link without its layer; a pack killed
	// between its record and its head is finished.
	for _, e := range ents {
		name, ext, _ := strings.Cut(e.Name(), ".")
		d := digest.NewDigestFromEncoded(digest.SHA256, name)
		var gone bool
		switch ext {
		case "pending":
			if s.Packed(d) && s.Exists(d) {
				if err := s.finishHead(d); err != nil {
					return fmt.Errorf("finish the pack of layer %s: %w", d, err)
				}
			}
			gone = true
		case "erofs":
			_, err := os.Stat(s.packedPath(d, ".json"))
			gone = errors.Is(err, fs.ErrNotExist)
		case "whole":
			_, err := os.Stat(s.BlobPath(d))
			gone = errors.Is(err, fs.ErrNotExist)
		}
		if gone {
			os.Remove(filepath.Join(s.dir, "packed", e.Name()))
		}
	}
	chunks, _ := os.ReadDir(filepath.Join(s.dir, "chunks"))
	names := make([]string, 0, len(chunks))
	for _, e := range chunks {
		names = append(names, e.Name())
	}
	slices.Sort(names)
	for _, n := range names {
		name, ext, _ := strings.Cut(n, ".")
		if used[digest.NewDigestFromEncoded(digest.SHA256, name)] {
			continue
		}
		p := filepath.Join(s.dir, "chunks", n)
		if info, err := os.Stat(p); err == nil && os.Remove(p) == nil {
			res.Bytes += Allocated(info)
			if ext == "" {
				res.Blobs++
			}
		}
	}
	return nil
}
