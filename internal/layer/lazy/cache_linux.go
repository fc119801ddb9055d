package lazy

import (
	"io"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

var errEOF = io.EOF

// punchHole frees a range of the cache file.
func punchHole(f *os.File, off, n int64) {
	_ = unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
}

// hostUsage is the disk space the host cache's images take.
func hostUsage(cacheRoot string) int64 {
	ents, _ := os.ReadDir(cacheRoot)
	var n int64
	for _, e := range ents {
		var st syscall.Stat_t
		if syscall.Stat(filepath.Join(cacheRoot, e.Name(), "image"), &st) == nil {
			n += st.Blocks * 512
		}
	}
	return n
}

// dropIdleCache empties the oldest cache of a layer that no fetcher
// serves (its fetcher lock is free), and reports whether it found one.
func dropIdleCache(cacheRoot, self string) bool {
	ents, _ := os.ReadDir(cacheRoot)
	var oldest string
	var oldestTime int64
	for _, e := range ents {
		dir := filepath.Join(cacheRoot, e.Name())
		var st syscall.Stat_t
		if dir == self || syscall.Stat(filepath.Join(dir, "image"), &st) != nil || st.Blocks == 0 {
			continue
		}
		if oldest == "" || st.Mtim.Sec < oldestTime {
			oldest, oldestTime = dir, st.Mtim.Sec
		}
	}
	if oldest == "" {
		return false
	}
	lock, err := os.OpenFile(filepath.Join(oldest, "fetcher.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return false
	}
	defer lock.Close()
	if syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) != nil {
		return false // served: its fetcher manages it
	}
	// Present map first, so a crash in between leaves no claim to data.
	os.Remove(filepath.Join(oldest, "present"))
	os.Remove(filepath.Join(oldest, "image"))
	return true
}
