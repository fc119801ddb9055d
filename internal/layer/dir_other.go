//go:build !linux

package layer

import (
	"context"
	"fmt"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/layer/erofs"
)

// addDir needs Linux: it reads xattrs and device numbers with Linux calls.
func addDir(ctx context.Context, w *erofs.Writer, root string, p Progress) error {
	return fmt.Errorf("build from a directory: %w on this OS (use a tar stream)", errdefs.ErrNotImplemented)
}
