//go:build unix

package store

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"

	"github.com/opencontainers/go-digest"
)

// Leases keep blobs from collection while their holder lives, as
// containerd's leases do: a create holds one on the layers it resolved
// until its sandbox's state names them, a squash on the chain it folds.
// GC keeps what live leases name, and a snapshot a lease names is in
// use (Leased). A lease is a file under leases/ that its holder keeps
// locked (shared) and appends digests to; a lease whose lock is free
// was a dead holder's, and goes. No process-wide lock is needed: the
// kernel drops a dead holder's lock, and each lease is its holder's.

// A Lease is held blobs (Store.Lease); Release lets them go.
type Lease struct {
	mu   sync.Mutex
	f    *os.File
	path string
}

// Lease starts a lease named id (a name unique among live leases:
// callers add a random part) that holds nothing yet.
func (s *Store) Lease(id string) (*Lease, error) {
	dir := filepath.Join(s.dir, "leases")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	if id == "" || strings.ContainsAny(id, "/\x00") || id[0] == '.' {
		return nil, fmt.Errorf("lease name %q: give a file name", id)
	}
	// Locked before it is in place: a lease unlocked under its name is
	// a dead holder's.
	p, tmp := filepath.Join(dir, id), filepath.Join(dir, ".new-"+id)
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY|os.O_APPEND|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("lease %s: %w", id, err)
	}
	if err = flock(f, syscall.LOCK_SH); err == nil {
		if _, err = os.Lstat(p); err == nil {
			err = fs.ErrExist
		} else if errors.Is(err, fs.ErrNotExist) {
			err = os.Rename(tmp, p)
		}
	}
	if err != nil {
		f.Close()
		os.Remove(tmp)
		return nil, fmt.Errorf("lease %s: %w", id, err)
	}
	return &Lease{f: f, path: p}, nil
}

// Add holds ds too. Under the store's writer lock (Writer), a GC after
// it keeps them; without it, one that runs meanwhile may collect a blob
// no tag reached.
func (l *Lease) Add(ds ...digest.Digest) error {
	if l == nil || len(ds) == 0 {
		return nil
	}
	var b strings.Builder
	for _, d := range ds {
		if err := d.Validate(); err != nil {
			return fmt.Errorf("lease: %w", err)
		}
		b.WriteString(d.String() + "\n")
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return errors.New("lease: released")
	}
	_, err := l.f.WriteString(b.String()) // O_APPEND: whole lines, in order
	return err
}

// Release lets the lease's blobs go (a later GC may collect those no
// tag or other lease keeps). It may be called more than once.
func (l *Lease) Release() error {
	if l == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return nil
	}
	err := os.Remove(l.path)
	l.f.Close()
	l.f = nil
	if errors.Is(err, fs.ErrNotExist) {
		err = nil
	}
	return err
}

// Leased are the digests live leases hold, each with the names of the
// leases that hold it; the leases of dead holders are removed.
func (s *Store) Leased() (map[digest.Digest][]string, error) {
	dir := filepath.Join(s.dir, "leases")
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	out := map[digest.Digest][]string{}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".") {
			continue // being made (or a holder died making it: a few bytes)
		}
		p := filepath.Join(dir, e.Name())
		f, err := os.Open(p)
		if err != nil {
			continue // released meanwhile
		}
		// A lock taken here exclusively is a lock no holder has: its
		// holder died (or released it, removing the file next).
		if flockNB(f, syscall.LOCK_EX) == nil {
			os.Remove(p)
			f.Close()
			continue
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			// A line being appended may be cut: what does not parse is
			// skipped (the holder's Add under Writer is never cut).
			if d, err := digest.Parse(sc.Text()); err == nil {
				out[d] = append(out[d], e.Name())
			}
		}
		f.Close()
	}
	return out, nil
}

func flock(f *os.File, how int) error {
	for {
		err := syscall.Flock(int(f.Fd()), how)
		if err != syscall.EINTR {
			return err
		}
	}
}

func flockNB(f *os.File, how int) error { return flock(f, how|syscall.LOCK_NB) }
