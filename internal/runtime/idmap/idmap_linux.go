// Package idmap hands each sandbox with a user namespace a range of
// host ids of its own, host-wide.
package idmap

import (
	"fmt"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/hostslot"
)

// A sandbox with a user namespace gets 65536 host ids of its own, from
// 2^31 up: far above the ids of host users and of the subordinate ranges
// /etc/subuid hands out, and short of (uid_t)-1.
const (
	idBase = 1 << 31
	idSize = 1 << 16
)

var idSlots = hostslot.Table{Dir: "/run/dsec/userns", N: (1<<32-idBase)/idSize - 1}

// Take takes a free range of host ids for owner (the one it holds
// already, if any).
func Take(owner string) (*container.IDMap, error) {
	unlock, err := idSlots.Lock()
	if err != nil {
		return nil, err
	}
	defer unlock()
	i := -1
	if held := idSlots.Owned(owner); len(held) > 0 {
		i = held[0]
	} else if i, err = idSlots.Take(owner); err != nil {
		return nil, err
	}
	if i < 0 {
		return nil, fmt.Errorf("user namespaces: all %d id ranges of this host are taken: %w", idSlots.N, errdefs.ErrResourceExhausted)
	}
	return &container.IDMap{Host: uint32(idBase + i*idSize), Size: idSize}, nil
}

// Give gives back the ids owner holds.
func Give(owner string) error { return idSlots.GiveBack(owner, idSlots.Free) }
