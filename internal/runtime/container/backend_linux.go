package container

import (
	"fmt"

	"github.com/containerd/errdefs"
)

// Backend is the container backend's entry in a worker's registry
// (package backend): sandboxes made of namespaces and cgroups on the
// host's kernel, each with an init of this package as its pid 1.
type Backend struct{}

// Name is "container".
func (Backend) Name() string { return "container" }

// Available says whether the sandboxes' init binary is found.
func (Backend) Available() error {
	if _, err := InitBinary(); err != nil {
		return fmt.Errorf("%w: %w", err, errdefs.ErrNotImplemented)
	}
	return nil
}
