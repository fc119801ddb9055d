package store

import (
	"io/fs"
	"syscall"
)

func keyOf(fi fs.FileInfo) (fileKey, bool) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fileKey{}, false
	}
	return fileKey{ino: uint64(st.Ino), size: uint64(st.Size), ctime: st.Ctim}, true
}
