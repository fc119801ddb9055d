package erofs_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	goerofs "github.com/erofs/go-erofs"
	"github.com/pierrec/lz4/v4"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/mount"
)

// TestCompress: files streamed with SetCompress read back byte for byte
// through the kernel and through fsck.erofs' own decompressor, whatever
// their size and however well they compress (text, random bytes, the
// two mixed inside one extent or across extents, a 4 KiB boundary
// either side, a last extent of one byte), and the image is smaller
// than the same files uncompressed.
func TestCompress(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	random := func(n int) string {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		return string(b)
	}
	text := func(n int) string {
		return strings.Repeat("the quick brown fox jumps over the lazy dog 0123456789\n", n/55+1)[:n]
	}
	files := map[string]string{
		"small":           text(100),
		"block":           text(4096),
		"block+1":         text(4097),
		"text-200k":       text(200 << 10),
		"random-100k":     random(100 << 10),
		"extent":          text(64 << 10),
		"extent+1":        text(64<<10 + 1),
		"mixed":           text(30<<10) + random(40<<10) + text(100<<10) + random(5000),
		"random-then-txt": random(64<<10) + text(64<<10) + random(1),
		"zeros-1m":        strings.Repeat("\x00", 1<<20+5),
		"sparse-64m":      text(5000) + strings.Repeat("\x00", 64<<20) + text(70000),
		"d/nested/lib.so": text(300<<10) + random(3<<10),
		"replaced":        random(10000) + text(80000),
	}
	build := func(compress bool) (string, int64) {
		p := filepath.Join(t.TempDir(), "img.erofs")
		f, err := os.Create(p)
		must(t, err)
		defer f.Close()
		w, err := erofs.NewWriter(f)
		must(t, err)
		w.SetCompress(compress)
		for _, name := range sortedKeys(files) {
			if name != "replaced" {
				file(t, w, name, files[name])
			}
		}
		// Xattrs of two sizes before the map (its 8-byte alignment), a
		// hard link, and a file replaced later in the stream.
		for i, name := range []string{"text-200k", "mixed"} {
			must(t, w.SetXattr(name, "user.k", bytes.Repeat([]byte("v"), 1+4*i)))
		}
		must(t, w.Link("link-to-text", "text-200k"))
		must(t, w.Create("replaced", erofs.Attr{Mode: 0o644}, 90000, strings.NewReader(text(90000))))
		must(t, w.Remove("replaced"))
		file(t, w, "replaced", files["replaced"])
		st, err := w.Finish()
		must(t, err)
		return p, st.Size
	}
	img, size := build(true)
	_, plain := build(false)
	// The sparse file's zeros were holes uncompressed, and are one shared
	// pcluster compressed.
	if size > plain*6/10 || size > 2<<20 {
		t.Errorf("compressed image is %d bytes, uncompressed %d: want well under, and the zeros in one block", size, plain)
	}
	t.Logf("compressed %d bytes, uncompressed %d (%.2fx)", size, plain, float64(size)/float64(plain))

	out := t.TempDir()
	if b, err := exec.Command("fsck.erofs", "--extract="+filepath.Join(out, "x"), img).CombinedOutput(); err != nil {
		t.Fatalf("fsck.erofs: %v\n%s", err, b)
	}
	same(t, "fsck.erofs", filepath.Join(out, "x"), files)
	f, err := os.Open(img)
	must(t, err)
	defer f.Close()
	for name, want := range files {
		if got, err := readCompressed(f, name); err != nil || string(got) != want {
			t.Errorf("the format's decoder reads %s as %d bytes (%v), want %d", name, len(got), err, len(want))
		}
	}

	if !canMount(t) {
		return
	}
	mnt := t.TempDir()
	must(t, mount.EROFS(img).Mount(mnt))
	defer mount.Unmount(mnt)
	same(t, "the kernel", mnt, files)
	same(t, "the kernel", mnt, map[string]string{"link-to-text": files["text-200k"]})
	buf := make([]byte, 16)
	if n, err := unix.Getxattr(filepath.Join(mnt, "mixed"), "user.k", buf); err != nil || string(buf[:n]) != "vvvvv" {
		t.Errorf("the kernel reads mixed's xattr as %q (%v)", buf[:n], err)
	}
	// A read in the middle of an extent, as a page fault makes it.
	m, err := os.Open(filepath.Join(mnt, "mixed"))
	must(t, err)
	defer m.Close()
	b := make([]byte, 10000)
	if _, err := m.ReadAt(b, 70<<10+123); err != nil || !bytes.Equal(b, []byte(files["mixed"][70<<10+123:][:10000])) {
		t.Errorf("the kernel's read inside an extent differs (%v)", err)
	}
	var st unix.Stat_t
	must(t, unix.Stat(filepath.Join(mnt, "text-200k"), &st))
	if st.Blocks*512 >= 200<<10 {
		t.Errorf("text-200k takes %d bytes of blocks, want its compressed size", st.Blocks*512)
	}
}

func same(t *testing.T, who, dir string, files map[string]string) {
	t.Helper()
	for name, want := range files {
		got, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Errorf("%s: %v", who, err)
			continue
		}
		if !bytes.Equal(got, []byte(want)) {
			i := 0
			for i < min(len(got), len(want)) && got[i] == want[i] {
				i++
			}
			t.Errorf("%s reads %s as %d bytes, want %d: they differ from byte %d", who, name, len(got), len(want), i)
		}
	}
}

func sortedKeys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// FuzzCompress: whatever a file holds, a compressed image of it reads
// back byte for byte through a decoder of the on-disk format written
// here apart from the writer (readCompressed). (TestCompress holds the
// writer to the kernel and fsck.erofs; here they would slow the fuzzing
// a hundredfold.)
func FuzzCompress(f *testing.F) {
	f.Add([]byte("x"), uint32(70000), uint32(3))
	f.Add(bytes.Repeat([]byte("abcd"), 5000), uint32(200000), uint32(65536))
	f.Add([]byte{0, 0, 0, 1}, uint32(4097), uint32(1))
	f.Fuzz(func(t *testing.T, seed []byte, size, period uint32) {
		if len(seed) == 0 {
			return
		}
		size %= 1 << 18
		period = period%(1<<17) + 1
		// A file of size bytes from the seed, repeated with a twist every
		// period bytes: runs that compress, and runs that do not.
		body := make([]byte, size)
		for i := range body {
			body[i] = seed[i%len(seed)] ^ byte(uint32(i)/period)
		}
		img, err := os.Create(filepath.Join(t.TempDir(), "img.erofs"))
		must(t, err)
		defer img.Close()
		w, err := erofs.NewWriter(img)
		must(t, err)
		w.SetCompress(true)
		must(t, w.Create("f", erofs.Attr{Mode: 0o644}, int64(len(body)), bytes.NewReader(body)))
		must(t, w.Create("g", erofs.Attr{Mode: 0o644}, int64(len(seed)), bytes.NewReader(seed)))
		_, err = w.Finish()
		must(t, err)
		for name, want := range map[string][]byte{"f": body, "g": seed} {
			got, err := readCompressed(img, name)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("%s reads back as %d bytes, want %d", name, len(got), len(want))
			}
		}
	})
}

// readCompressed reads the regular file name in the root of img as the
// kernel would, from the format alone: its inode through go-erofs (the
// metadata view), then a flat file's blocks, or a compressed file's
// lcluster indexes and LZ4 pclusters (zero padding skipped).
func readCompressed(img *os.File, name string) ([]byte, error) {
	fsys, err := goerofs.Open(erofs.MetadataView(img))
	if err != nil {
		return nil, err
	}
	info, err := fs.Stat(fsys, name)
	if err != nil {
		return nil, err
	}
	st := info.Sys().(*goerofs.Stat)
	le := binary.LittleEndian
	sb := make([]byte, 128)
	if _, err := img.ReadAt(sb, 1024); err != nil {
		return nil, err
	}
	iloc := int64(le.Uint32(sb[40:]))*erofs.BlockSize + st.Ino*32
	ib := make([]byte, 64)
	if _, err := img.ReadAt(ib, iloc); err != nil {
		return nil, err
	}
	layout := le.Uint16(ib[0:]) >> 1 & 7
	xattrs := 0
	if n := int(le.Uint16(ib[2:])); n > 0 {
		xattrs = 12 + (n-1)*4
	}
	size := le.Uint64(ib[8:])
	out := make([]byte, 0, size)
	switch layout {
	case 0: // flat: blocks from i_u
		out = out[:size]
		_, err := img.ReadAt(out, int64(le.Uint32(ib[16:]))*erofs.BlockSize)
		return out, err
	case 1: // compressed, full indexes
	default:
		return nil, fmt.Errorf("layout %d", layout)
	}
	nl := (size + erofs.BlockSize - 1) / erofs.BlockSize
	idx := make([]byte, 8*nl)
	at := (iloc+64+int64(xattrs)+7)/8*8 + 16
	if _, err := img.ReadAt(idx, at); err != nil {
		return nil, err
	}
	for lcn := uint64(0); lcn < nl; {
		x := idx[lcn*8:]
		switch le.Uint16(x[0:]) & 3 {
		case 0: // plain: one block as it is
			b := make([]byte, min(erofs.BlockSize, size-lcn*erofs.BlockSize))
			if _, err := img.ReadAt(b, int64(le.Uint32(x[4:]))*erofs.BlockSize); err != nil {
				return nil, err
			}
			out = append(out, b...)
			lcn++
		case 1: // a head: its extent runs to the next head, its pcluster's blocks in the first non-head
			if lcn+1 >= nl || le.Uint16(idx[(lcn+1)*8:])&3 != 2 {
				return nil, fmt.Errorf("lcluster %d: a head with no CBLKCNT after it", lcn)
			}
			d0 := le.Uint16(idx[(lcn+1)*8+4:])
			if d0&(1<<11) == 0 {
				return nil, fmt.Errorf("lcluster %d: no CBLKCNT", lcn+1)
			}
			next := lcn + 1 + uint64(le.Uint16(idx[(lcn+1)*8+6:]))
			pc := make([]byte, int(d0&^(1<<11))*erofs.BlockSize)
			if _, err := img.ReadAt(pc, int64(le.Uint32(x[4:]))*erofs.BlockSize); err != nil {
				return nil, err
			}
			pc = bytes.TrimLeft(pc, "\x00")
			n := min(next*erofs.BlockSize, size) - lcn*erofs.BlockSize
			dec := make([]byte, n)
			if m, err := lz4.UncompressBlock(pc, dec); err != nil || uint64(m) != n {
				return nil, fmt.Errorf("lcluster %d: decompressed %d of %d bytes: %v", lcn, m, n, err)
			}
			for i := lcn + 1; i < next; i++ { // each non-head points back to its head, on to the next
				y := idx[i*8:]
				if le.Uint16(y[0:])&3 != 2 || i > lcn+1 && uint64(le.Uint16(y[4:])) != i-lcn || uint64(le.Uint16(y[6:])) != next-i {
					return nil, fmt.Errorf("lcluster %d: deltas %d, %d in an extent from %d to %d", i, le.Uint16(y[4:]), le.Uint16(y[6:]), lcn, next)
				}
			}
			out = append(out, dec...)
			lcn = next
		default:
			return nil, fmt.Errorf("lcluster %d: type %d where a head belongs", lcn, le.Uint16(x[0:])&3)
		}
	}
	return out, nil
}
