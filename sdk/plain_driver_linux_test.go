package sdk_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/driver/containers"
)

// plainDriver is a third backend, for tests only, written outside
// package runtime against the exported seam alone (package driver): the
// proof that a backend is a package of its own plus its registration.
// A sandbox is an init of package container on its root, in a group
// of its own, and nothing more: no spare inits, no user namespace, no
// network of its own (network mode nat is refused), no saved guests.
// The worker and the runtime know nothing of it but its name.
type plainDriver struct{}

var (
	_ driver.Driver     = plainDriver{}
	_ driver.FileOpener = plainDriver{}
)

func (plainDriver) Name() string     { return "plain" }
func (plainDriver) Available() error { return container.Backend{}.Available() }

func (plainDriver) Start(_ context.Context, s driver.StartSpec) (out driver.Started, err error) {
	if s.UserNS || s.NAT || s.Restore != nil {
		return out, fmt.Errorf("the plain backend runs no user namespace, network or saved guest: %w", errdefs.ErrNotImplemented)
	}
	rootfs := filepath.Join(s.Dir, "rootfs")
	for _, m := range s.RootFS {
		if err := m.Mount(rootfs); err != nil {
			return out, err
		}
	}
	g, devices, err := driver.NewGroup(s.Groups, s.Group, s.Limits)
	if err != nil {
		return out, err
	}
	out.Group = g
	if err := devices(); err != nil {
		return out, err
	}
	if err := policy.ApplyNetwork(g.Path(), nil, s.Allowlist); err != nil {
		return out, err
	}
	logf, err := os.OpenFile(filepath.Join(s.Dir, "init.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return out, err
	}
	defer logf.Close()
	c, err := container.Create(container.Spec{Root: rootfs, Hostname: s.Hostname, Socket: filepath.Join(s.Dir, "init.sock"),
		Restrictions: s.Restrict, Setup: g.Add, Stderr: logf, Idle: s.Limits.Idle})
	if err != nil {
		return out, err
	}
	out.Instance, out.Pid = c, c.Pid()
	_, err = c.Protect(s.ReadOnly, s.Hidden)
	return out, err
}

func (plainDriver) Attach(_ context.Context, h driver.Handle) (out driver.Started, err error) {
	out.Group, _ = h.Groups.Open(h.Group)
	if h.Paused {
		return out, nil
	}
	if c, err := container.Attach(filepath.Join(h.Dir, "init.sock"), h.Pid); err == nil {
		out.Instance, out.Pid = c, h.Pid
	}
	return out, nil
}

func (plainDriver) Teardown(_ context.Context, h driver.Handle) []error {
	if err := mount.Unmount(filepath.Join(h.Dir, "rootfs")); err != nil && !mount.IsNotMounted(err) {
		return []error{err}
	}
	return nil
}

func (plainDriver) Files(h driver.Handle) (backend.Files, error) {
	return containers.HostFiles(filepath.Join(h.Dir, "rootfs"), nil)
}
