package dedup

import (
	"bytes"
	"crypto/sha256"
	"math/rand"
	"testing"
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
