package dedup

import (
	"bytes"
	"crypto/sha256"
	"math/rand"
	"testing"

	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/layer/erofs"
)

// TestWindows: a window table is the sha256 of each WindowSize bytes in
// order, the last one short, however the bytes are written.
func TestWindows(t *testing.T) {
	for _, n := range []int{0, 1, WindowSize - 1, WindowSize, WindowSize + 1, 5*WindowSize + 4096} {
		b := make([]byte, n)
		rand.New(rand.NewSource(int64(n))).Read(b)
		var want []byte
		for off := 0; off < n; off += WindowSize {
			sum := sha256.Sum256(b[off:min(off+WindowSize, n)])
			want = append(want, sum[:]...)
		}
		var w Windows
		for rest, k := b, 1; len(rest) > 0; k = k*3 + 7 { // writes of ragged sizes
			m := min(k, len(rest))
			w.Write(rest[:m])
			rest = rest[m:]
		}
		if got := w.Table(); !bytes.Equal(got, want) {
			t.Errorf("%d bytes written in pieces: a table of %d bytes, want %d", n, len(got), len(want))
		}
		if got, err := WindowTable(bytes.NewReader(b)); err != nil || !bytes.Equal(got, want) {
			t.Errorf("%d bytes read: a table of %d bytes, want %d (%v)", n, len(got), len(want), err)
		}
	}
}

// TestHotIn: the hot region of an image, found in one chunk blob.
func TestHotIn(t *testing.T) {
	const bs = erofs.BlockSize
	a, b := digest.FromString("a"), digest.FromString("b")
	ext := []Extent{
		{At: 1, Blocks: 4, Blob: a, Block: 10}, // image blocks 1-4: a's 10-13
		{At: 5, Blocks: 2, Blob: b, Block: 0},  // 5-6: b's 0-1
		{At: 7, Blocks: 3, Blob: a, Block: 14}, // 7-9: a's 14-16
		{At: 10, Blocks: 1, Blob: a, Block: 90},
	}
	for _, tc := range []struct {
		name string
		hot  erofs.Region
		blob digest.Digest
		want erofs.Region
	}{
		{"all of a's first run", erofs.Region{Offset: 1 * bs, Size: 4 * bs}, a, erofs.Region{Offset: 10 * bs, Size: 4 * bs}},
		{"part of a block", erofs.Region{Offset: 2*bs + 100, Size: 200}, a, erofs.Region{Offset: 11*bs + 100, Size: 200}},
		{"a across b's run: together in a", erofs.Region{Offset: 1 * bs, Size: 9 * bs}, a, erofs.Region{Offset: 10 * bs, Size: 7 * bs}},
		{"b's part of it", erofs.Region{Offset: 1 * bs, Size: 9 * bs}, b, erofs.Region{Offset: 0, Size: 2 * bs}},
		{"scattered in a: none", erofs.Region{Offset: 9 * bs, Size: 2 * bs}, a, erofs.Region{}},
		{"none in b", erofs.Region{Offset: 1 * bs, Size: 2 * bs}, b, erofs.Region{}},
		{"no hot region", erofs.Region{}, a, erofs.Region{}},
	} {
		if got := HotIn(ext, tc.hot, tc.blob); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
}
