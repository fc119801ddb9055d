package lazy

import (
	"io"
	"os"

	"golang.org/x/sys/unix"
)

var errEOF = io.EOF

// punchHole frees a range of the cache file.
func punchHole(f *os.File, off, n int64) {
	_ = unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
}
