package runtime

import (
	"fmt"
	goruntime "runtime"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/runtime/container"
)

// A sandbox with a user namespace gets 65536 host ids of its own, from
// 2^31 up: far above the ids of host users and of the subordinate ranges
// /etc/subuid hands out, and short of (uid_t)-1.
const (
	idBase = 1 << 31
	idSize = 1 << 16
)

var idSlots = hostSlots{dir: "/run/dsec/userns", n: (1<<32-idBase)/idSize - 1}

// takeIDs takes a free range of host ids for owner (the one it holds
// already, if any).
func takeIDs(owner string) (*container.IDMap, error) {
	unlock, err := idSlots.lock()
	if err != nil {
		return nil, err
	}
	defer unlock()
	i := -1
	if held := idSlots.owned(owner); len(held) > 0 {
		i = held[0]
	} else if i, err = idSlots.take(owner); err != nil {
		return nil, err
	}
	if i < 0 {
		return nil, fmt.Errorf("user namespaces: all %d id ranges of this host are taken: %w", idSlots.n, errdefs.ErrResourceExhausted)
	}
	return &container.IDMap{Host: uint32(idBase + i*idSize), Size: idSize}, nil
}

// giveIDs gives back the ids owner holds.
func giveIDs(owner string) error { return idSlots.giveBack(owner, idSlots.free) }

// AsRoot runs fn as far as files go (fsuid and fsgid) as the sandbox's
// root: what fn creates through RootFS is the sandbox root's, as if the
// sandbox made it. The host's root is no one in a user namespace's
// sandbox, and its files there could not even be stored.
func (sb *Sandbox) AsRoot(fn func() error) error {
	st := sb.Snapshot()
	if st.IDs == nil {
		return fn()
	}
	goruntime.LockOSThread()
	defer goruntime.UnlockOSThread()
	id := int(st.IDs.Host)
	if err := unix.Setfsgid(id); err != nil {
		return err
	}
	defer unix.Setfsgid(0)
	if err := unix.Setfsuid(id); err != nil {
		return err
	}
	defer unix.Setfsuid(0)
	return fn()
}
