//go:build !linux

package container

import (
	"fmt"

	"github.com/containerd/errdefs"
)

// Process is a started sandbox process.
type Process struct{}

// Pid is not supported off Linux.
func (p *Process) Pid() int { return 0 }

// Wait is not supported off Linux.
func (p *Process) Wait() (int, error) { return -1, errNotLinux }

var errNotLinux = fmt.Errorf("sandboxes need Linux namespaces: %w", errdefs.ErrNotImplemented)

// Start is not supported off Linux.
func Start(spec Spec) (*Process, error) { return nil, errNotLinux }

// MaybeInit does nothing off Linux.
func MaybeInit() {}
