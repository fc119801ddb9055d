//go:build !linux

package policy

import (
	"fmt"

	"github.com/containerd/errdefs"
)

// ApplyNetwork needs Linux cgroup BPF.
func ApplyNetwork(cg string, old, entries []Entry) error {
	return fmt.Errorf("network policy: %w", errdefs.ErrNotImplemented)
}

// NetworkAttached is false off Linux.
func NetworkAttached(cg string) bool { return false }

// Seccomp needs Linux.
func Seccomp(deny []string) ([]byte, error) {
	return nil, fmt.Errorf("seccomp: %w", errdefs.ErrNotImplemented)
}

// SeccompDeny needs Linux.
func SeccompDeny(names []string) ([]byte, error) {
	return nil, fmt.Errorf("seccomp: %w", errdefs.ErrNotImplemented)
}

// ReleaseNetwork has nothing to release off Linux.
func ReleaseNetwork(cg string, entries []Entry) error { return nil }

// ApplyDevices needs Linux cgroup BPF.
func ApplyDevices(cg string, extra ...Device) error {
	return fmt.Errorf("device policy: %w", errdefs.ErrNotImplemented)
}

// DevicesAttached is false off Linux.
func DevicesAttached(cg string) bool { return false }
