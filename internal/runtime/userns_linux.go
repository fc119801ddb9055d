package runtime

import "github.com/dsec-project/dsec/internal/runtime/idmap"

// AsRoot runs fn as far as files go (fsuid and fsgid) as the sandbox's
// root: what fn creates through RootFS is the sandbox root's, as if the
// sandbox made it (idmap.AsRoot).
func (sb *Sandbox) AsRoot(fn func() error) error { return idmap.AsRoot(sb.Current().IDs, fn) }
