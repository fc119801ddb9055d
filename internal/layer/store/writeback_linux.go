package store

import (
	"os"

	"golang.org/x/sys/unix"
)

// startWriteback asks the kernel to start writing a range back to disk
// without waiting for it.
func startWriteback(f *os.File, off, n int64) {
	_ = unix.SyncFileRange(int(f.Fd()), off, n, unix.SYNC_FILE_RANGE_WRITE)
}

// detach unmounts what is mounted at path, lazily (nothing: no error).
func detach(path string) { unix.Unmount(path, unix.MNT_DETACH) }
