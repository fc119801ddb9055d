// Package hostslot is a host-wide table of numbered slots (NAT subnets,
// user namespace id ranges) that every worker on the host shares.
package hostslot

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// Table is a host-wide table of N numbered slots shared by every worker
// on the host: one file per taken slot under Dir, naming its owner (a
// sandbox's directory). Dir is under /run, gone at boot with whatever
// held the slots.
type Table struct {
	Dir string
	N   int
}

// Lock serialises taking and giving back slots across workers.
func (h Table) Lock() (func(), error) {
	if err := os.MkdirAll(h.Dir, 0o700); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(h.Dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		return nil, err
	}
	return func() { f.Close() }, nil
}

// Take records the lowest free slot as owner's and returns it; -1 when
// every slot is taken. The caller holds the lock.
func (h Table) Take(owner string) (int, error) {
	for i := range h.N {
		f, err := os.OpenFile(h.path(i), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if errors.Is(err, os.ErrExist) {
			continue
		}
		if err != nil {
			return -1, err
		}
		_, err = f.WriteString(owner)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(h.path(i))
			return -1, err
		}
		return i, nil
	}
	return -1, nil
}

// Owned lists the slots owner holds.
func (h Table) Owned(owner string) []int {
	held, _ := filepath.Glob(filepath.Join(h.Dir, "[0-9]*"))
	var out []int
	for _, p := range held {
		if b, err := os.ReadFile(p); err == nil && string(b) == owner {
			i, _ := strconv.Atoi(filepath.Base(p))
			out = append(out, i)
		}
	}
	return out
}

// GiveBack calls release for every slot owner holds, under the lock.
func (h Table) GiveBack(owner string, release func(i int) error) error {
	if h.Empty() {
		return nil
	}
	unlock, err := h.Lock()
	if err != nil {
		return err
	}
	defer unlock()
	var errs []error
	for _, i := range h.Owned(owner) {
		errs = append(errs, release(i))
	}
	return errors.Join(errs...)
}

// Free gives slot i back.
func (h Table) Free(i int) error {
	if err := os.Remove(h.path(i)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// Empty reports whether no slot is taken.
func (h Table) Empty() bool {
	held, _ := filepath.Glob(filepath.Join(h.Dir, "[0-9]*"))
	return len(held) == 0
}

func (h Table) path(i int) string { return filepath.Join(h.Dir, strconv.Itoa(i)) }
