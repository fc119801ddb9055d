//go:build !linux

package runtime

import "github.com/dsec-project/dsec/internal/snap"

// SnapUsers: sandboxes run on Linux only, so elsewhere there are none.
func SnapUsers(string) ([]snap.User, error) { return nil, nil }
