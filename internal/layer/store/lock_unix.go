//go:build unix

package store

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
)

const (
	lockIndex = ".index.lock"
	lockGC    = ".lock"
)

// lock takes an flock on a lock file of the layout and returns its
// release. The kernel drops it if the process dies.
func (s *Store) lock(name string, exclusive bool) (func(), error) {
	f, err := os.OpenFile(filepath.Join(s.dir, name), os.O_CREATE|os.O_RDWR|syscall.O_CLOEXEC, 0o644)
	if err != nil {
		return nil, fmt.Errorf("lock store: %w", err)
	}
	how := syscall.LOCK_SH
	if exclusive {
		how = syscall.LOCK_EX
	}
	for {
		err = syscall.Flock(int(f.Fd()), how)
		if err != syscall.EINTR {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("lock store: %w", err)
	}
	return func() { f.Close() }, nil
}
