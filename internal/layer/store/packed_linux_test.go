package store_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/mount"
)

// buildLayer builds a layer of files (name -> content) in s.
func buildLayer(t *testing.T, s *store.Store, tag string, files map[string][]byte) digest.Digest {
	t.Helper()
	dir := t.TempDir()
	for n, b := range files {
		if err := os.WriteFile(filepath.Join(dir, n), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ref, _ := layer.ParseRef(tag)
	info, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: dir, Kind: layer.KindBase, Ref: ref})
	if err != nil {
		t.Fatal(err)
	}
	return info.Digest
}

func randomBytes(seed byte, n int) []byte {
	b := make([]byte, n)
	x := uint32(seed) + 1
	for i := range b {
		x = x*1664525 + 1013904223
		b[i] = byte(x >> 24)
	}
	return b
}

func mountLayer(t *testing.T, s *store.Store, d digest.Digest) string {
	t.Helper()
	dir := t.TempDir()
	if err := s.MountLayer(d, dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := mount.Unmount(dir); err != nil {
			t.Error(err)
		}
	})
	return dir
}

// TestPackKeepsMountsAndDigest packs a layer that is mounted: the mount
// goes on reading the whole image it opened, a new mount reads the
// packed one, Open makes the canonical bytes again, and GC keeps the
// chunks while a layer uses them.
func TestPackKeepsMountsAndDigest(t *testing.T) {
	layertest.RequireRoot(t)
	s := open(t)
	ctx := context.Background()
	wheel := randomBytes(1, 300<<10)
	a := buildLayer(t, s, "a:1", map[string][]byte{"wheel": wheel, "a": randomBytes(2, 70<<10)})
	b := buildLayer(t, s, "b:1", map[string][]byte{"wheel": wheel, "b": randomBytes(3, 5000)})
	before := mountLayer(t, s, a)
	whole, _ := os.ReadFile(s.BlobPath(a))
	// A microVM's file of a, taken before the pack: it stays a's image.
	linked, err := s.Whole(a)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []digest.Digest{a, b} {
		if _, err := s.Pack(ctx, d); err != nil {
			t.Fatal(err)
		}
	}
	if res, err := s.Pack(ctx, a); err != nil || res != nil {
		t.Fatalf("packing a packed layer again: %v, %v", res, err)
	}
	if got, _ := os.ReadFile(filepath.Join(before, "wheel")); !bytes.Equal(got, wheel) {
		t.Fatal("a mount made before the pack reads other bytes")
	}
	if got, _ := os.ReadFile(linked); !bytes.Equal(got, whole) {
		t.Fatal("the whole file taken before the pack changed")
	}
	wb, err := s.Whole(b) // made again from the chunks
	if err != nil {
		t.Fatal(err)
	}
	if err := exec.Command("fsck.erofs", wb).Run(); err != nil {
		t.Fatalf("fsck of b's whole copy: %v", err)
	}
	after := mountLayer(t, s, b)
	if got, _ := os.ReadFile(filepath.Join(after, "wheel")); !bytes.Equal(got, wheel) {
		t.Fatal("the packed layer reads other bytes")
	}
	fi, _ := os.Stat(s.BlobPath(a))
	if fi.Size() != int64(len(whole)) || store.Allocated(fi) >= int64(len(whole))/2 {
		t.Errorf("a's head is %d bytes taking %d; its image is %d", fi.Size(), store.Allocated(fi), len(whole))
	}
	st, err := s.PackStats()
	if err != nil {
		t.Fatal(err)
	}
	if st.Layers != 2 || st.Shared != int64(len(wheel)) {
		t.Errorf("stats %+v: want 2 layers sharing the %d bytes of the wheel", st, len(wheel))
	}
	f, err := s.Open(a)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(f.Name())
	if got == nil { // unlinked: read through the descriptor
		buf := new(bytes.Buffer)
		buf.ReadFrom(f)
		got = buf.Bytes()
	}
	f.Close()
	if !bytes.Equal(got, whole) {
		t.Fatal("Open of a packed layer is not its canonical image")
	}
	if err := s.VerifyBlob(b); err != nil {
		t.Fatal(err)
	}
	// a goes: its chunks stay while b uses them.
	if _, err := s.Untag(ctx, "a:1"); err != nil {
		t.Fatal(err)
	}
	if _, err := layer.GC(ctx, s, nil); err != nil {
		t.Fatal(err)
	}
	if s.Exists(a) || s.Packed(a) {
		t.Fatal("gc kept the untagged layer a")
	}
	if _, err := os.Stat(linked); err == nil {
		t.Fatal("gc kept the whole file of a layer it removed")
	}
	if err := s.VerifyBlob(b); err != nil {
		t.Fatalf("b after a's gc: %v", err)
	}
	// A corrupt chunk is found, never served as b's bytes.
	chunks, _ := filepath.Glob(filepath.Join(s.Dir(), "chunks", "*[0-9a-f]"))
	for _, c := range chunks {
		os.Chmod(c, 0o644)
		cf, err := os.OpenFile(c, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		cf.WriteAt([]byte("x"), 100)
		cf.Close()
	}
	if err := s.VerifyBlob(b); !errors.Is(err, errdefs.ErrDataLoss) {
		t.Fatalf("b with a corrupt chunk: %v, want ErrDataLoss", err)
	}
}

// TestUnpack makes a packed layer whole again; gc then removes its
// chunks.
func TestUnpack(t *testing.T) {
	s := open(t)
	ctx := context.Background()
	d := buildLayer(t, s, "a:1", map[string][]byte{"x": randomBytes(4, 200<<10)})
	whole, _ := os.ReadFile(s.BlobPath(d))
	if _, err := s.Pack(ctx, d); err != nil {
		t.Fatal(err)
	}
	// Read on demand, range by range, it is the canonical image.
	r, err := s.PackedReader(d)
	if err != nil {
		t.Fatal(err)
	}
	for _, rg := range [][2]int{{0, len(whole)}, {0, 1}, {4095, 4098}, {8191, 70000}, {len(whole) - 5000, len(whole)}, {100, 100}} {
		got := make([]byte, rg[1]-rg[0])
		if n, err := r.ReadAt(got, int64(rg[0])); err != nil || n != len(got) || !bytes.Equal(got, whole[rg[0]:rg[1]]) {
			t.Fatalf("bytes %d-%d read from the packed layer: %d, %v, or other bytes", rg[0], rg[1], n, err)
		}
	}
	r.Close()
	if err := s.Unpack(ctx, d); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(s.BlobPath(d)); s.Packed(d) || !bytes.Equal(got, whole) {
		t.Fatal("the unpacked layer is not its canonical image")
	}
	res, err := layer.GC(ctx, s, nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.Blobs != 1 || !s.Exists(d) {
		t.Errorf("gc removed %d blobs, want the one chunk blob; the layer is there: %v", res.Blobs, s.Exists(d))
	}
	if chunks, _ := os.ReadDir(filepath.Join(s.Dir(), "chunks")); len(chunks) != 0 {
		t.Errorf("%d files left in chunks/", len(chunks))
	}
}

// TestPackProfiledLayer packs a layer built with an access profile,
// whose file is in the hot region in part: its blocks are not where a
// file's usually are, and the pack follows them.
func TestPackProfiledLayer(t *testing.T) {
	layertest.RequireRoot(t)
	s := open(t)
	dir := t.TempDir()
	big := randomBytes(5, 300<<10)
	if err := os.WriteFile(filepath.Join(dir, "big"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "small"), []byte("small"), 0o644); err != nil {
		t.Fatal(err)
	}
	ref, _ := layer.ParseRef("hot:1")
	info, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: dir, Kind: layer.KindBase, Ref: ref,
		Order: []erofs.Hot{{Path: "small"}, {Path: "big", Blocks: []erofs.BlockRange{{Start: 3, Count: 2}, {Start: 40, Count: 1}}}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pack(context.Background(), info.Digest); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(filepath.Join(mountLayer(t, s, info.Digest), "big")); !bytes.Equal(got, big) {
		t.Fatal("the packed profiled layer reads other bytes")
	}
	if err := s.VerifyBlob(info.Digest); err != nil {
		t.Fatal(err)
	}
}

// TestChunkBlobForLazyHosts: what a host that mounts a packed layer of
// this store lazily reads: its metadata image and chunk blobs, and each
// blob's window table, the sha256 of each 64 KiB of it, kept beside it
// by the pack, made again (and kept) where it is missing.
func TestChunkBlobForLazyHosts(t *testing.T) {
	s := open(t)
	d := buildLayer(t, s, "a:1", map[string][]byte{"x": randomBytes(5, 200<<10), "y": randomBytes(6, 10<<10)})
	if _, err := s.Pack(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	meta, devs, _, err := s.PackedLayer(d)
	if err != nil || len(devs) != 1 {
		t.Fatalf("packed layer: %s %v %v", meta, devs, err)
	}
	if _, err := os.Stat(meta); err != nil {
		t.Fatal(err)
	}
	kept, _ := os.ReadFile(store.ChunkPath(s.Dir(), devs[0]) + ".windows") // the pack's, before ChunkBlob could make one
	path, size, table, err := s.ChunkBlob(devs[0])
	if err != nil {
		t.Fatal(err)
	}
	blob, _ := os.ReadFile(path)
	var want []byte
	for off := 0; off < len(blob); off += 64 << 10 {
		sum := sha256.Sum256(blob[off:min(off+64<<10, len(blob))])
		want = append(want, sum[:]...)
	}
	if int64(len(blob)) != size || size < 210<<10 || !bytes.Equal(table, want) || !bytes.Equal(kept, want) {
		t.Fatalf("chunk blob of %d bytes (%d said), table of %d bytes: want the sha256 of each 64 KiB window, %d bytes", len(blob), size, len(table), len(want))
	}
	os.Remove(path + ".windows") // a blob packed before tables were kept
	if _, _, again, err := s.ChunkBlob(devs[0]); err != nil || !bytes.Equal(again, want) {
		t.Fatalf("table made again: %v", err)
	}
	if kept, _ := os.ReadFile(path + ".windows"); !bytes.Equal(kept, want) {
		t.Fatal("the table made again is not kept")
	}
	if _, _, _, err := s.ChunkBlob("sha256:../../etc"); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("a chunk blob named by a path: %v", err)
	}
}

// TestGCFinishesAKilledPack: a pack killed after the layer's record and
// before its head leaves the whole image as the blob, marked pending;
// gc puts the head in, and the layer reads as before.
func TestGCFinishesAKilledPack(t *testing.T) {
	s := open(t)
	ctx := context.Background()
	d := buildLayer(t, s, "a:1", map[string][]byte{"x": randomBytes(7, 300<<10)})
	whole, _ := os.ReadFile(s.BlobPath(d))
	if _, err := s.Pack(ctx, d); err != nil {
		t.Fatal(err)
	}
	pending := filepath.Join(s.Dir(), "packed", d.Encoded()+".pending")
	if _, err := os.Stat(pending); err == nil {
		t.Fatal("a finished pack left its pending mark")
	}
	// The kill: the record is there, the blob is still the whole image.
	tmp := s.BlobPath(d) + ".tmp"
	if err := os.WriteFile(tmp, whole, 0o444); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, s.BlobPath(d)); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(pending, nil, 0o444); err != nil {
		t.Fatal(err)
	}
	if _, err := layer.GC(ctx, s, nil); err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(s.BlobPath(d))
	if _, err := os.Stat(pending); err == nil || store.Allocated(fi) >= int64(len(whole))/2 {
		t.Fatalf("after gc the blob takes %d of %d bytes (pending mark left: %v)", store.Allocated(fi), len(whole), err == nil)
	}
	if err := s.VerifyBlob(d); err != nil {
		t.Fatal(err)
	}
}
