//go:build !linux

package store

import "os"

func startWriteback(f *os.File, off, n int64) {}

// detach: nothing is mounted where only Linux mounts.
func detach(string) {}

func removeUnmounted(path string) bool { return os.RemoveAll(path) == nil }
