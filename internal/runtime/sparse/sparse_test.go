package sparse

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// allocated is what f takes on its file system.
func allocated(t *testing.T, f *os.File) int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

func TestRoundTrip(t *testing.T) {
	dir := t.TempDir()
	src, err := os.Create(filepath.Join(dir, "src"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	const size = 64<<20 + 1234 // an odd end
	if err := src.Truncate(size); err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(1, 2))
	want := make([]byte, size)
	put := func(off int, n int) {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(r.IntN(255) + 1)
		}
		copy(want[off:], b)
		if _, err := src.WriteAt(b, int64(off)); err != nil {
			t.Fatal(err)
		}
	}
	put(0, 10)                        // a page of data and zeros
	put(3*PageSize+17, 5*PageSize)    // unaligned, across pages
	put(1<<20-100, 300)               // across a chunk's end
	put(8<<20, 3<<20)                 // longer than a chunk
	put(size-50, 50)                  // the odd end
	zeros := make([]byte, 2*PageSize) // written zeros: data, but left out
	if _, err := src.WriteAt(zeros, 20<<20); err != nil {
		t.Fatal(err)
	}
	var img bytes.Buffer
	st, err := Write(&img, src)
	if err != nil {
		t.Fatal(err)
	}
	if st.Size != size {
		t.Fatalf("size %d, want %d", st.Size, size)
	}
	if st.Data > 4<<20 || int64(img.Len()) > st.Data+16*int64(st.Extents)+16 {
		t.Fatalf("an image of %d bytes (%d of data, %d extents) for ~3.2 MiB of data", img.Len(), st.Data, st.Extents)
	}
	dst, err := os.Create(filepath.Join(dir, "dst"))
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	rst, err := Read(dst, bytes.NewReader(img.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	if rst != st {
		t.Fatalf("read %+v, wrote %+v", rst, st)
	}
	got, err := os.ReadFile(dst.Name())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the file read back differs")
	}
	if a := allocated(t, dst); a > 5<<20 {
		t.Fatalf("the file read back takes %d bytes: its zeros are not holes", a)
	}
}

func TestEmpty(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	f.Truncate(1 << 30)
	var img bytes.Buffer
	st, err := Write(&img, f)
	if err != nil || st.Data != 0 || img.Len() != 16 {
		t.Fatalf("a file of holes: %+v, %d bytes, %v", st, img.Len(), err)
	}
}

func image(size uint64, ext ...uint64) []byte {
	b := append([]byte(Magic), binary.BigEndian.AppendUint64(nil, size)...)
	for i := 0; i+1 < len(ext); i += 2 {
		b = binary.BigEndian.AppendUint64(b, ext[i])
		b = binary.BigEndian.AppendUint64(b, ext[i+1])
		b = append(b, bytes.Repeat([]byte{7}, int(ext[i+1]))...)
	}
	return b
}

func TestCorrupt(t *testing.T) {
	for name, b := range map[string][]byte{
		"magic":      append([]byte("DSECSPR0"), make([]byte, 8)...),
		"short":      []byte(Magic),
		"huge":       image(MaxSize + 1),
		"unaligned":  image(1<<20, 100, 10),
		"past end":   image(1<<20, 1<<20-PageSize, PageSize+1),
		"empty":      image(1<<20, 0, 0),
		"overlap":    image(1<<20, 0, 2*PageSize, PageSize, 10),
		"backwards":  image(1<<20, 2*PageSize, 10, 0, 10),
		"truncated":  image(1<<20, 0, 100)[:16+16+50],
		"half entry": append(image(1<<20), 1, 2, 3),
	} {
		f, err := os.Create(filepath.Join(t.TempDir(), "f"))
		if err != nil {
			t.Fatal(err)
		}
		_, err = Read(f, bytes.NewReader(b))
		f.Close()
		if !errors.Is(err, errdefs.ErrDataLoss) {
			t.Errorf("%s: %v, want a data-loss error", name, err)
		}
	}
}

func FuzzRead(f *testing.F) {
	f.Add(image(1<<20, 0, 10, PageSize, 100))
	f.Add(image(10))
	f.Add(image(1<<20, 1<<20-PageSize, PageSize))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) >= 16 && binary.BigEndian.Uint64(b[8:]) > 64<<20 {
			return // a valid huge size is only a truncate: keep the fuzzer's files small
		}
		dst, err := os.CreateTemp(dir, "f")
		if err != nil {
			t.Fatal(err)
		}
		defer os.Remove(dst.Name())
		defer dst.Close()
		st, err := Read(dst, bytes.NewReader(b))
		if err != nil {
			return
		}
		fi, _ := dst.Stat()
		if fi.Size() != st.Size || st.Data > st.Size {
			t.Fatalf("read %+v into a file of %d bytes", st, fi.Size())
		}
		// What was read writes back to an image that reads the same.
		var img bytes.Buffer
		if _, err := Write(&img, dst); err != nil {
			t.Fatal(err)
		}
		again, _ := os.CreateTemp(dir, "g")
		defer os.Remove(again.Name())
		defer again.Close()
		if _, err := Read(again, &img); err != nil {
			t.Fatal(err)
		}
		x, _ := os.ReadFile(dst.Name())
		y, _ := os.ReadFile(again.Name())
		if !bytes.Equal(x, y) {
			t.Fatal("an image written from a read one reads differently")
		}
	})
}
