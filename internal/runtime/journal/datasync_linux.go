package journal

import (
	"os"

	"golang.org/x/sys/unix"
)

// datasync syncs f's data and what reading it back needs (its size),
// not its other metadata.
func datasync(f *os.File) error { return unix.Fdatasync(int(f.Fd())) }
