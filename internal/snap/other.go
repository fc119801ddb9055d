//go:build !linux

package snap

import (
	"context"
	"fmt"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// Squash needs Linux: it mounts the chain's EROFS images.
func Squash(context.Context, *store.Store, string, layer.Ref, string) (*layer.Info, int, error) {
	return nil, 0, fmt.Errorf("snap squash mounts EROFS images: it needs Linux: %w", errdefs.ErrNotImplemented)
}
