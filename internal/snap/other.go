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
func Squash(context.Context, *store.Store, string, layer.Ref, string) (*layer.Info, Squashed, error) {
	return nil, Squashed{}, fmt.Errorf("snap squash mounts EROFS images: it needs Linux: %w", errdefs.ErrNotImplemented)
}

// Squashed is what a squash folded and what the new snapshot holds.
type Squashed struct {
	Folded, Entries, Whiteouts int
	Bytes                      int64
}
