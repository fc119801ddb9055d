//go:build !unix

package store

import (
	"context"
	"fmt"

	"github.com/containerd/errdefs"
)

const (
	lockIndex = ".index.lock"
	lockGC    = ".lock"
)

func (s *Store) lock(name string, exclusive bool) (func(), error) {
	return nil, fmt.Errorf("store locking: %w", errdefs.ErrNotImplemented)
}

func (s *Store) Exclusive(context.Context, string) (func(), error) {
	return nil, fmt.Errorf("store locking: %w", errdefs.ErrNotImplemented)
}

func (s *Store) sweepLocks() {}
