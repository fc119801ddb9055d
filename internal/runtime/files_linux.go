package runtime

import (
	"fmt"

	"github.com/containerd/errdefs"
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/driver"
)

// Files opens the files of a running sandbox as its processes resolve
// them, for a copy in or out: its backend's ability (driver.FileOpener).
func (sb *Sandbox) Files() (backend.Files, error) {
	st := sb.Current()
	if st.Status != Running {
		return nil, fmt.Errorf("sandbox %s is %s: start it first: %w", st.Name, st.Status, errdefs.ErrFailedPrecondition)
	}
	f, ok := sb.d.(driver.FileOpener)
	if !ok {
		return nil, fmt.Errorf("the %s backend cannot copy files in or out of a sandbox: %w", sb.backendName(), errdefs.ErrNotImplemented)
	}
	sb.mu.Lock()
	h := sb.handle()
	sb.mu.Unlock()
	return f.Files(h)
}
