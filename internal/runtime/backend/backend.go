// Package backend is the registry of the kinds of sandbox a worker runs
// (container, microvm) and what a running sandbox is to the runtime (an
// Instance and its abilities); package driver is what a backend
// implements to be run. A sandbox's spec names its backend
// (api.SandboxSpec.Backend, default the first registered); the worker
// finds it here, once, and refuses a name it does not know with the names
// it does. Warm pools and one-off calls (FnCall, dsec run --rm) are ways
// of using a backend, not backends: they are not registered.
//
// The registry is explicit: the drivers a worker runs are built in one
// place (runtime.NewDrivers), as restic's backend/all and gVisor's
// platform registry do, so what a binary runs is read in one line.
package backend

import (
	"fmt"
	"strings"

	"github.com/containerd/errdefs"
)

// Backend is a kind of sandbox.
type Backend interface {
	// Name is what api.SandboxSpec.Backend says to pick it.
	Name() string
	// Available says why this host cannot run it, as an error of class
	// not implemented (nil: it can): a binary, device or kernel feature
	// it needs and the host lacks.
	Available() error
}

// Registry holds the backends a worker runs, the default first.
type Registry struct {
	list []Backend
}

// NewRegistry registers bs; the first is the default. A name given twice
// or empty is a programming error: it panics.
func NewRegistry(bs ...Backend) *Registry {
	r := &Registry{}
	for _, b := range bs {
		if b.Name() == "" {
			panic("backend: a backend without a name")
		}
		if _, err := r.Lookup(b.Name()); err == nil {
			panic("backend: " + b.Name() + " registered twice")
		}
		r.list = append(r.list, b)
	}
	return r
}

// Lookup finds the backend named name ("" is the default). An unknown
// name is the caller's error (invalid argument), one this host cannot run
// is not implemented here, and both say what to do.
func (r *Registry) Lookup(name string) (Backend, error) {
	if name == "" && len(r.list) > 0 {
		name = r.list[0].Name()
	}
	for _, b := range r.list {
		if b.Name() == name {
			return b, nil
		}
	}
	return nil, fmt.Errorf("unknown backend %q: this worker runs %s: %w", name, strings.Join(r.Names(), ", "), errdefs.ErrInvalidArgument)
}

// Usable is Lookup, and then whether the backend runs on this host.
func (r *Registry) Usable(name string) (Backend, error) {
	b, err := r.Lookup(name)
	if err != nil {
		return nil, err
	}
	if err := b.Available(); err != nil {
		return nil, fmt.Errorf("backend %s cannot run on this host: %w", b.Name(), err)
	}
	return b, nil
}

// Names lists the registered backends, the default first.
func (r *Registry) Names() []string {
	out := make([]string, len(r.list))
	for i, b := range r.list {
		out[i] = b.Name()
	}
	return out
}
