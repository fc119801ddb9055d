// Package feature probes what the host can do, once per process, as
// cilium/ebpf's feature tests do: a Test memoises its probe, a feature
// the host lacks is an *UnsupportedError (errors.Is it
// errdefs.ErrNotImplemented), and the worker lists every test it runs
// with its answer in GET /v1/version and logs the missing ones as it
// starts. A degraded path (no core scheduling: batch work shares SMT
// siblings) is then something a user can see, not a silent no-op.
//
// The tests live with the code that needs them (package cgroup's
// Kill, package container's CoreScheduling, ...); the worker lists
// them in one place.
package feature

import (
	"fmt"
	"sync"

	"github.com/containerd/errdefs"
)

// Test is one feature, probed on first use.
type Test struct {
	// Name is the feature as the API names it ("cgroup.kill").
	Name string
	// Without says what dsec does on a host that lacks it.
	Without string
	probe   func() error
	once    sync.Once
	err     error
}

// New is a test of name, whose probe returns nil when the host has it
// and otherwise why not.
func New(name, without string, probe func() error) *Test {
	return &Test{Name: name, Without: without, probe: probe}
}

// Err is nil when the host has the feature, else an *UnsupportedError.
func (t *Test) Err() error {
	t.once.Do(func() {
		if err := t.probe(); err != nil {
			t.err = &UnsupportedError{Feature: t.Name, Reason: err.Error(), Without: t.Without}
		}
	})
	return t.err
}

// Have reports whether the host has the feature.
func (t *Test) Have() bool { return t.Err() == nil }

// UnsupportedError says the host lacks a feature.
type UnsupportedError struct {
	Feature, Reason, Without string
}

func (e *UnsupportedError) Error() string {
	return fmt.Sprintf("this host lacks %s: %s", e.Feature, e.Reason)
}

// Is makes an UnsupportedError errdefs.ErrNotImplemented.
func (e *UnsupportedError) Is(target error) bool { return target == errdefs.ErrNotImplemented }
