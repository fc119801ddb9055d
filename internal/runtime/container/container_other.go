//go:build !linux

package container

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/containerd/errdefs"
)

// Sandbox is a running sandbox (Linux only).
type Sandbox struct{}

var errNotLinux = fmt.Errorf("sandboxes need Linux namespaces: %w", errdefs.ErrNotImplemented)

// ErrSandboxDied says the sandbox's init is gone.
var ErrSandboxDied = errors.New("sandbox died")

// Create is not supported off Linux.
func Create(spec Spec) (*Sandbox, error) { return nil, errNotLinux }

// Pid is not supported off Linux.
func (s *Sandbox) Pid() int { return 0 }

// Exec is not supported off Linux.
func (s *Sandbox) Exec(ctx context.Context, args, env []string, cwd string, stdin, stdout, stderr *os.File) (int, error) {
	return -1, errNotLinux
}

// Destroy is not supported off Linux.
func (s *Sandbox) Destroy() error { return errNotLinux }

// MaybeInit does nothing off Linux.
func MaybeInit() {}
