package dedup_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/dedup"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/mount"
)

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// canonical builds src into a layer of a store of its own and returns
// the path of its canonical image.
func canonical(t *testing.T, src string) string {
	t.Helper()
	s, err := store.Open(filepath.Join(t.TempDir(), "store"))
	must(t, err)
	ref, _ := layer.ParseRef("l:1")
	info, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: src, Kind: layer.KindBase, Ref: ref})
	must(t, err)
	return s.BlobPath(info.Digest)
}

// packed is a layer packed into dir: its metadata image and blob.
type packed struct {
	meta, blob string
	res        *dedup.Result
}

// pack packs the canonical image img against idx, into dir, and adds
// the new blob to idx (as a store would once it kept the blob).
func pack(t *testing.T, img, dir string, idx *dedup.MapIndex) packed {
	t.Helper()
	in, err := os.Open(img)
	must(t, err)
	defer in.Close()
	metaPath := filepath.Join(dir, "meta-"+filepath.Base(img))
	meta, err := os.Create(metaPath)
	must(t, err)
	defer meta.Close()
	tmp, err := os.CreateTemp(dir, "blob-")
	must(t, err)
	defer tmp.Close()
	res, err := dedup.Pack(in, meta, tmp, idx)
	must(t, err)
	p := packed{meta: metaPath, res: res}
	if res.Blob == "" {
		if fi, _ := tmp.Stat(); fi.Size() != 0 {
			t.Fatalf("no new blob, but %d bytes were written", fi.Size())
		}
		os.Remove(tmp.Name())
	} else {
		p.blob = filepath.Join(dir, res.Blob.Encoded())
		must(t, os.Rename(tmp.Name(), p.blob))
		b, err := os.ReadFile(p.blob)
		must(t, err)
		if digest.FromBytes(b) != res.Blob || uint64(len(b)) != res.BlobBlocks*4096 {
			t.Fatalf("blob is %d bytes, digest %s; the result says %d blocks, %s", len(b), digest.FromBytes(b), res.BlobBlocks, res.Blob)
		}
		idx.Add(res.Blob, res.BlobBlocks, res.New)
		blobFiles[res.Blob] = p.blob
	}
	rebuilt(t, in, dir, res)
	return p
}

// blobFiles are the blobs tests packed, by digest.
var blobFiles = map[digest.Digest]string{}

// rebuilt checks that the image's head and the blobs make the canonical
// image again, and that the head keeps none of the file data.
func rebuilt(t *testing.T, img *os.File, dir string, res *dedup.Result) {
	t.Helper()
	fi, err := img.Stat()
	must(t, err)
	head, err := os.CreateTemp(dir, "head-")
	must(t, err)
	defer os.Remove(head.Name())
	defer head.Close()
	must(t, head.Truncate(fi.Size()))
	must(t, dedup.Head(head, img, fi.Size(), res.Extents))
	out := new(bytes.Buffer)
	must(t, dedup.Rebuild(out, head, fi.Size(), res.Extents, func(d digest.Digest) (io.ReaderAt, error) {
		return os.Open(blobFiles[d])
	}))
	want, _ := os.ReadFile(img.Name())
	if got := out.Bytes(); !bytes.Equal(got, want) {
		t.Fatalf("the rebuilt image (%d bytes, %s) is not the canonical one (%d bytes, %s)", len(got), digest.FromBytes(got), len(want), digest.FromBytes(want))
	}
	var st unix.Stat_t
	must(t, unix.Fstat(int(head.Fd()), &st))
	if data := res.Logical - res.Holes; data > 1<<20 && st.Blocks*512 > data/2 {
		t.Errorf("the head takes %d bytes on disk for %d bytes of file data", st.Blocks*512, data)
	}
}

func (p packed) devices() []string {
	var out []string
	for _, d := range p.res.Devices {
		out = append(out, blobFiles[d])
	}
	return out
}

// mounted mounts a packed layer with its devices and fscks it first.
func mounted(t *testing.T, p packed, dir string) string {
	t.Helper()
	args := []string{}
	for _, d := range p.devices() {
		args = append(args, "--device="+d)
	}
	if out, err := exec.Command("fsck.erofs", append(args, p.meta)...).CombinedOutput(); err != nil {
		t.Fatalf("fsck.erofs: %v\n%s", err, out)
	}
	mnt := t.TempDir()
	must(t, mount.EROFSDevices(p.meta, p.devices()).Mount(mnt))
	t.Cleanup(func() {
		if err := mount.Unmount(mnt); err != nil {
			t.Error(err)
		}
	})
	return mnt
}

func same(t *testing.T, what string, want, got layertest.Tree) {
	t.Helper()
	if d := layertest.Diff(want, got); len(d) > 0 {
		t.Fatalf("%s differs:\n%s", what, strings.Join(d[:min(len(d), 30)], "\n"))
	}
}

// TestPackRoundTrip packs a layer holding every kind of entry (hard
// links, devices, whiteouts, opaque directories, xattrs, sparse files)
// and checks that the kernel shows the same tree from the packed form.
func TestPackRoundTrip(t *testing.T) {
	layertest.RequireRoot(t)
	src := t.TempDir()
	layertest.MakeRich(t, src, layertest.Options{Sockets: true})
	want := layertest.ScanDir(t, src)
	img := canonical(t, src)
	dir := t.TempDir()
	p := pack(t, img, dir, dedup.NewMapIndex())
	same(t, "the packed layer, mounted", want, layertest.ScanDir(t, mounted(t, p, dir)))
	if p.res.Logical == 0 || p.res.Holes == 0 {
		t.Errorf("logical %d bytes, holes %d: the rich tree has data and sparse files", p.res.Logical, p.res.Holes)
	}
	if fi, _ := os.Stat(p.meta); fi.Size() > 1<<20 {
		t.Errorf("the metadata image is %d bytes", fi.Size())
	}
}

// TestPackShares packs two layers that hold some of the same files:
// the second stores only what the first lacks, reads its shared files
// from the first one's blob, and packs to the same bytes every time.
func TestPackShares(t *testing.T) {
	layertest.RequireRoot(t)
	a, b := t.TempDir(), t.TempDir()
	must(t, layertest.RandomTree(filepath.Join(a, "site-packages/numpy"), "numpy", 12, 300<<10))
	must(t, layertest.RandomTree(filepath.Join(a, "app"), "app-a", 5, 100<<10))
	// b: the same package under another path, a copy of it inside b,
	// a file of zeros, and files of its own
	must(t, layertest.RandomTree(filepath.Join(b, "usr/lib/python3/numpy"), "numpy", 12, 300<<10))
	must(t, exec.Command("cp", "-a", filepath.Join(b, "usr/lib/python3/numpy"), filepath.Join(b, "copy")).Run())
	must(t, os.WriteFile(filepath.Join(b, "zeros"), make([]byte, 3*dedup.ChunkSize), 0o644))
	must(t, layertest.RandomTree(filepath.Join(b, "app"), "app-b", 5, 100<<10))
	wantB := layertest.ScanDir(t, b)
	imgA, imgB := canonical(t, a), canonical(t, b)
	dir := t.TempDir()
	idx := dedup.NewMapIndex()
	pa := pack(t, imgA, dir, idx)
	pb := pack(t, imgB, dir, idx)
	same(t, "layer b, packed after a", wantB, layertest.ScanDir(t, mounted(t, pb, dir)))
	same(t, "layer a", layertest.ScanDir(t, a), layertest.ScanDir(t, mounted(t, pa, dir)))

	numpy := treeBytes(t, filepath.Join(a, "site-packages/numpy"))
	appB := treeBytes(t, filepath.Join(b, "app"))
	if got := pb.res.BlobBlocks * 4096; got < uint64(appB) || got > uint64(appB)+uint64(5*4096*2) {
		t.Errorf("b's new blob is %d bytes; b's own files are %d bytes", got, appB)
	}
	if pb.res.Shared != 2*numpy {
		t.Errorf("b shares %d bytes, want %d (numpy twice)", pb.res.Shared, 2*numpy)
	}
	if pb.res.Holes != 3*dedup.ChunkSize {
		t.Errorf("b's holes are %d bytes, want %d", pb.res.Holes, 3*dedup.ChunkSize)
	}
	if len(pb.res.Devices) != 2 || pb.res.Devices[0] != pa.res.Blob && pb.res.Devices[1] != pa.res.Blob {
		t.Errorf("b's devices %v, want a's blob %s and its own", pb.res.Devices, pa.res.Blob)
	}
	// The same image against the same index: the same bytes.
	again := t.TempDir()
	idx2 := dedup.NewMapIndex()
	idx2.Add(pa.res.Blob, pa.res.BlobBlocks, pa.res.New)
	pb2 := pack(t, imgB, again, idx2)
	m1, _ := os.ReadFile(pb.meta)
	m2, _ := os.ReadFile(pb2.meta)
	if pb2.res.Blob != pb.res.Blob || !bytes.Equal(m1, m2) {
		t.Errorf("packing b again gave blob %s and a metadata image %s; first %s and %s", pb2.res.Blob, digest.FromBytes(m2), pb.res.Blob, digest.FromBytes(m1))
	}
	// b again, with b's blob indexed too: nothing new.
	pb3 := pack(t, imgB, t.TempDir(), idx)
	if pb3.res.Blob != "" || pb3.res.Shared != pb3.res.Logical-pb3.res.Holes {
		t.Errorf("packing b a second time wrote blob %q, shared %d of %d", pb3.res.Blob, pb3.res.Shared, pb3.res.Logical)
	}
}

// TestPackSparse packs a 1 GiB file of 8 bytes: its zeros are holes,
// and the one chunk that holds the 8 bytes is stored.
func TestPackSparse(t *testing.T) {
	layertest.RequireRoot(t)
	src := t.TempDir()
	f, err := os.Create(filepath.Join(src, "huge"))
	must(t, err)
	const size, at = 1 << 30, 512<<20 + 4096
	must(t, f.Truncate(size))
	_, err = f.WriteAt([]byte("far away"), at)
	must(t, err)
	f.Close()
	img := canonical(t, src)
	dir := t.TempDir()
	start := time.Now()
	p := pack(t, img, dir, dedup.NewMapIndex())
	if d := time.Since(start); d > 60*time.Second {
		t.Errorf("packing took %v", d)
	}
	if p.res.BlobBlocks != dedup.ChunkSize/4096 || p.res.Holes != size-dedup.ChunkSize {
		t.Errorf("the blob has %d blocks and the holes are %d bytes, for one chunk of data", p.res.BlobBlocks, p.res.Holes)
	}
	g, err := os.Open(filepath.Join(mounted(t, p, dir), "huge"))
	must(t, err)
	defer g.Close()
	buf := make([]byte, 16)
	_, err = g.ReadAt(buf, at-8)
	must(t, err)
	if string(buf) != "\x00\x00\x00\x00\x00\x00\x00\x00far away" {
		t.Errorf("read %q", buf)
	}
}

func treeBytes(t *testing.T, dir string) int64 {
	var n int64
	must(t, filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			n += fi.Size()
		}
		return err
	}))
	return n
}

func TestEntriesRoundTrip(t *testing.T) {
	es := []dedup.Entry{{Sum: sha256.Sum256([]byte("a")), Block: 0, Blocks: 16}, {Sum: sha256.Sum256([]byte("b")), Block: 16, Blocks: 1}}
	got, err := dedup.DecodeEntries(dedup.EncodeEntries(es), 17)
	must(t, err)
	if len(got) != 2 || got[1] != es[1] {
		t.Fatalf("got %v", got)
	}
	for _, c := range []struct {
		b      []byte
		blocks uint64
	}{
		{dedup.EncodeEntries(es)[:39], 17}, // not whole
		{dedup.EncodeEntries(es), 16},      // past the blob
		{dedup.EncodeEntries([]dedup.Entry{{Blocks: 0}}), 16},
		{dedup.EncodeEntries([]dedup.Entry{{Blocks: 17}}), 100}, // longer than a chunk
	} {
		if _, err := dedup.DecodeEntries(c.b, c.blocks); err == nil {
			t.Errorf("DecodeEntries(%d bytes, %d blocks) accepted", len(c.b), c.blocks)
		}
	}
}

func FuzzDecodeEntries(f *testing.F) {
	f.Add(dedup.EncodeEntries([]dedup.Entry{{Block: 3, Blocks: 2}}), uint64(5))
	f.Fuzz(func(t *testing.T, b []byte, blocks uint64) {
		es, err := dedup.DecodeEntries(b, blocks)
		if err != nil {
			return
		}
		if !bytes.Equal(dedup.EncodeEntries(es), b) {
			t.Fatal("decode then encode changed the bytes")
		}
	})
}

// TestPackBoundsDevices packs a layer that holds the files of more
// layers than a mount takes devices: it reads MaxDevices-1 of their
// blobs and stores the rest again, and mounts.
func TestPackBoundsDevices(t *testing.T) {
	layertest.RequireRoot(t)
	dir := t.TempDir()
	idx := dedup.NewMapIndex()
	all := t.TempDir()
	const n = dedup.MaxDevices + 6
	for i := range n {
		src := t.TempDir()
		body := bytes.Repeat([]byte{byte(i), byte(i >> 8), 'x'}, 3000)
		must(t, os.WriteFile(filepath.Join(src, "f"), body, 0o644))
		must(t, os.WriteFile(filepath.Join(all, fmt.Sprintf("f%03d", i)), body, 0o644))
		pack(t, canonical(t, src), dir, idx)
	}
	want := layertest.ScanDir(t, all)
	p := pack(t, canonical(t, all), dir, idx)
	if len(p.res.Devices) != dedup.MaxDevices {
		t.Errorf("the layer reads %d blobs, want %d", len(p.res.Devices), dedup.MaxDevices)
	}
	if p.res.Shared != (dedup.MaxDevices-1)*9000 {
		t.Errorf("shared %d bytes, want %d files' worth", p.res.Shared, dedup.MaxDevices-1)
	}
	same(t, "the layer of many", want, layertest.ScanDir(t, mounted(t, p, dir)))
}

// TestPackRefusesCompressed: a compressed layer is not packed (its
// chunks would hold compressed bytes the kernel reads as file data), and
// nothing is written for it; dsec layer dedup keeps it whole.
func TestPackRefusesCompressed(t *testing.T) {
	tarball := filepath.Join(t.TempDir(), "z.tar")
	must(t, os.WriteFile(tarball, layertest.Tar(layertest.File{Name: "text", Body: strings.Repeat("compressible ", 20000)}), 0o644))
	s, err := store.Open(filepath.Join(t.TempDir(), "store"))
	must(t, err)
	ref, _ := layer.ParseRef("z:1")
	info, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: tarball, Kind: layer.KindBase, Ref: ref, Compress: true})
	must(t, err)
	if info.Compressed != 1 {
		t.Fatalf("the layer has %d compressed files, want 1", info.Compressed)
	}
	in, err := os.Open(s.BlobPath(info.Digest))
	must(t, err)
	defer in.Close()
	var meta, blob bytes.Buffer
	if _, err := dedup.Pack(in, nopWriterAt{&meta}, &blob, dedup.NewMapIndex()); !errors.Is(err, dedup.ErrCompressed) {
		t.Fatalf("pack of a compressed layer: %v, want ErrCompressed", err)
	}
	if meta.Len()+blob.Len() > 0 {
		t.Errorf("a refused pack wrote %d bytes", meta.Len()+blob.Len())
	}
	if _, err := s.Pack(context.Background(), info.Digest); !errors.Is(err, dedup.ErrCompressed) || s.Packed(info.Digest) {
		t.Errorf("the store's pack of a compressed layer: %v (packed %v)", err, s.Packed(info.Digest))
	}
}

type nopWriterAt struct{ *bytes.Buffer }

func (nopWriterAt) WriteAt([]byte, int64) (int, error) { return 0, errors.New("not written") }
