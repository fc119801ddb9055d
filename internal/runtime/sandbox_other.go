//go:build !linux

package runtime

import (
	"context"
	"fmt"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/layer/store"
)

// Options describe a sandbox to create.
type Options struct {
	Name   string
	Layers []string
}

// Sandbox is a created sandbox (Linux only).
type Sandbox struct{}

var errNotLinux = fmt.Errorf("sandboxes need Linux: %w", errdefs.ErrNotImplemented)

// Create is not supported off Linux.
func Create(ctx context.Context, root string, s *store.Store, o Options) (*Sandbox, error) {
	return nil, errNotLinux
}

// Load is not supported off Linux.
func Load(root, name string) (*Sandbox, error) { return nil, errNotLinux }
