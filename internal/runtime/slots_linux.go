package runtime

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// hostSlots is a host-wide table of n numbered slots (NAT subnets, user
// namespace id ranges) shared by every worker on the host: one file per
// taken slot under dir, naming its owner (a sandbox's directory). dir is
// under /run, gone at boot with whatever held the slots.
type hostSlots struct {
	dir string
	n   int
}

// lock serialises taking and giving back slots across workers.
func (h hostSlots) lock() (func(), error) {
	if err := os.MkdirAll(h.dir, 0o700); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(h.dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		return nil, err
	}
	return func() { f.Close() }, nil
}

// take records the lowest free slot as owner's and returns it; -1 when
// every slot is taken. The caller holds the lock.
func (h hostSlots) take(owner string) (int, error) {
	for i := range h.n {
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

// owned lists the slots owner holds.
func (h hostSlots) owned(owner string) []int {
	held, _ := filepath.Glob(filepath.Join(h.dir, "[0-9]*"))
	var out []int
	for _, p := range held {
		if b, err := os.ReadFile(p); err == nil && string(b) == owner {
			i, _ := strconv.Atoi(filepath.Base(p))
			out = append(out, i)
		}
	}
	return out
}

// giveBack calls release for every slot owner holds, under the lock.
func (h hostSlots) giveBack(owner string, release func(i int) error) error {
	if h.empty() {
		return nil
	}
	unlock, err := h.lock()
	if err != nil {
		return err
	}
	defer unlock()
	var errs []error
	for _, i := range h.owned(owner) {
		errs = append(errs, release(i))
	}
	return errors.Join(errs...)
}

// free gives slot i back.
func (h hostSlots) free(i int) error {
	if err := os.Remove(h.path(i)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// empty reports whether no slot is taken.
func (h hostSlots) empty() bool {
	held, _ := filepath.Glob(filepath.Join(h.dir, "[0-9]*"))
	return len(held) == 0
}

func (h hostSlots) path(i int) string { return filepath.Join(h.dir, strconv.Itoa(i)) }
