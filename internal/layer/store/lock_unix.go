//go:build unix

package store

import (
	"fmt"
	"path/filepath"

	"github.com/dsec-project/dsec/internal/durable"
)

const (
	lockIndex = ".index.lock"
	lockGC    = ".lock"
)

// lock takes an flock on a lock file of the layout and returns its
// release. The kernel drops it if the process dies.
func (s *Store) lock(name string, exclusive bool) (func(), error) {
	release, err := durable.Lock(filepath.Join(s.dir, name), exclusive)
	if err != nil {
		return nil, fmt.Errorf("lock store: %w", err)
	}
	return release, nil
}
