//go:build unix

package store

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/dsec-project/dsec/internal/durable"
)

const (
	lockIndex = ".index.lock"
	lockGC    = ".lock"
)

// lock takes an flock on a lock file of the layout and returns its
// release. The kernel drops it if the process dies.
func (s *Store) lock(name string, exclusive bool) (func(), error) {
	release, err := durable.Lock(filepath.Join(s.dir, name), exclusive)
	if err != nil {
		return nil, fmt.Errorf("lock store: %w", err)
	}
	return release, nil
}

// Exclusive takes the store's lock named name (locks/NAME), waiting
// while another process or caller holds it, or until ctx ends: work that
// two processes would otherwise both do on the same store (converting
// one registry layer) is done by one, the other finding it done. The
// kernel drops the lock if its holder dies.
func (s *Store) Exclusive(ctx context.Context, name string) (release func(), err error) {
	dir := filepath.Join(s.dir, "locks")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(dir, name), os.O_CREATE|os.O_RDWR|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if err != syscall.EWOULDBLOCK && err != syscall.EINTR {
			f.Close()
			return nil, fmt.Errorf("lock store: %w", err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// sweepLocks removes the Exclusive lock files nobody holds. A caller
// that opened one just before waits on a file no longer named: at worst
// it does its work beside the next caller's, which finds it done or
// does the same.
func (s *Store) sweepLocks() {
	dir := filepath.Join(s.dir, "locks")
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		f, err := os.OpenFile(p, os.O_RDWR|syscall.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil {
			os.Remove(p)
		}
		f.Close()
	}
}
