//go:build !linux

package worker

import (
	"context"
	"errors"
	"fmt"

	"github.com/containerd/errdefs"
)

// ErrRootServed says another worker serves the root.
var ErrRootServed = errors.New("a worker already serves this root")

// Driver is a backend's driver (package driver, on Linux).
type Driver any

// Serve is not supported off Linux: sandboxes need its namespaces.
func Serve(ctx context.Context, cfg Config) error {
	return fmt.Errorf("the dsec worker needs Linux: %w", errdefs.ErrNotImplemented)
}
