// Package shim is what every driver whose guests run through the vmm
// shim (a microVM's, a full VM's) does alike on the worker's side: the
// shim's sockets are in the sandbox's directory. It is apart from
// package vmm so that the shim, which dsec-init runs, does not link the
// drivers' packages (layers, policies, networks) it never uses.
package shim

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/vmm"
)

// Attach finds the sandbox's group and, unless it is paused, its guest's
// shim (driver.Driver's Attach).
func Attach(h driver.Handle) driver.Started {
	var out driver.Started
	out.Group, _ = h.Groups.Open(h.Group)
	if out.Group != nil && out.Group.Frozen() && !h.Paused { // a worker died packing it
		out.Group.Thaw()
	}
	if h.Paused {
		return out
	}
	if vm, err := vmm.AttachVM(filepath.Join(h.Dir, "init.sock"), filepath.Join(h.Dir, "files.sock"), h.Pid); err == nil {
		out.Instance, out.Pid = vm, h.Pid
	}
	return out
}

// Teardown removes the sockets of the guest's shim (driver.Driver's
// Teardown).
func Teardown(h driver.Handle) []error {
	var errs []error
	for _, s := range []string{"init.sock", "files.sock"} {
		if err := os.Remove(filepath.Join(h.Dir, s)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errs
}

// Files opens the running guest's files through its agent's file
// server (driver.FileOpener).
func Files(h driver.Handle) (backend.Files, error) {
	vm, _ := h.Instance.(*vmm.VM)
	if vm == nil {
		return nil, fmt.Errorf("sandbox %s has no running guest: start it first: %w", h.Name, errdefs.ErrFailedPrecondition)
	}
	return vm.Files()
}
