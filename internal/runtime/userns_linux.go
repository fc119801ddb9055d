package runtime

import (
	goruntime "runtime"

	"golang.org/x/sys/unix"
)

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
