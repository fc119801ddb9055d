package store

import (
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// startWriteback asks the kernel to start writing a range back to disk
// without waiting for it.
func startWriteback(f *os.File, off, n int64) {
	_ = unix.SyncFileRange(int(f.Fd()), off, n, unix.SYNC_FILE_RANGE_WRITE)
}

// detach unmounts what is mounted at path, lazily (nothing: no error).
func detach(path string) { unix.Unmount(path, unix.MNT_DETACH) }

// removeUnmounted removes the directory path and what it holds unless
// it, or a directory in it, is still a mount point (another file
// system's files are not removed through it).
func removeUnmounted(path string) bool {
	var st, parent unix.Stat_t
	if unix.Lstat(path, &st) != nil || unix.Lstat(filepath.Dir(path), &parent) != nil || st.Dev != parent.Dev {
		return false
	}
	ents, _ := os.ReadDir(path)
	for _, e := range ents {
		var in unix.Stat_t
		if e.IsDir() && (unix.Lstat(filepath.Join(path, e.Name()), &in) != nil || in.Dev != st.Dev) {
			return false
		}
	}
	return os.RemoveAll(path) == nil
}
