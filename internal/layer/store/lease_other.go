//go:build !unix

package store

import (
	"fmt"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
)

// A Lease is held blobs (Unix only).
type Lease struct{}

// Lease is not supported off Unix.
func (s *Store) Lease(id string) (*Lease, error) {
	return nil, fmt.Errorf("store leases: %w", errdefs.ErrNotImplemented)
}

// Add holds nothing off Unix.
func (l *Lease) Add(ds ...digest.Digest) error { return nil }

// Release releases nothing off Unix.
func (l *Lease) Release() error { return nil }

// Leased is none off Unix.
func (s *Store) Leased() (map[digest.Digest][]string, error) { return nil, nil }
