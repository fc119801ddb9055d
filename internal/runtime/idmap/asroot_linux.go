package idmap

import (
	goruntime "runtime"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/runtime/container"
)

// AsRoot runs fn as far as files go (fsuid and fsgid) as the root of a
// sandbox whose ids are m (nil: the host's, fn runs as it is): what fn
// creates through the sandbox's root is its root's, as if the sandbox
// made it. The host's root is no one in a user namespace's sandbox, and
// its files there could not even be stored.
func AsRoot(m *container.IDMap, fn func() error) error {
	if m == nil {
		return fn()
	}
	goruntime.LockOSThread()
	defer goruntime.UnlockOSThread()
	id := int(m.Host)
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
