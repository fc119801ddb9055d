//go:build !linux

package journal

import "os"

// datasync syncs f (fdatasync is Linux's).
func datasync(f *os.File) error { return f.Sync() }
