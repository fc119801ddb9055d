//go:build !linux

package container

import (
	"context"
	"fmt"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/runtime/backend"
)

// Conn is a connection to a sandbox's init (Linux only).
type Conn struct{}

var errNotLinux = fmt.Errorf("sandboxes need Linux namespaces: %w", errdefs.ErrNotImplemented)

// ErrSandboxDied says the sandbox's init is gone.
var ErrSandboxDied = backend.ErrDied

// Create is not supported off Linux.
func Create(spec Spec) (*Conn, error) { return nil, errNotLinux }

// Pid is not supported off Linux.
func (s *Conn) Pid() int { return 0 }

// Attach is not supported off Linux.
func Attach(socket string, pid int) (*Conn, error) { return nil, errNotLinux }

// Exec is not supported off Linux.
func (s *Conn) Exec(ctx context.Context, cmd Cmd) (int, error) {
	return -1, errNotLinux
}

// Result is not supported off Linux.
func (s *Conn) Result(ctx context.Context, id string) (backend.Exit, error) {
	return backend.Exit{Code: -1}, errNotLinux
}

// Close is not supported off Linux.
func (s *Conn) Close() error { return errNotLinux }

// Destroy is not supported off Linux.
func (s *Conn) Destroy() error { return errNotLinux }

// MaybeInit does nothing off Linux.
func MaybeInit() {}
