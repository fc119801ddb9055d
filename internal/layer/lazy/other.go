//go:build !linux

package lazy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/store"
)

var errEOF = io.EOF

// ErrBusy says another fetcher already serves the layer.
var ErrBusy = errors.New("a fetcher already serves this layer")

var errLinux = fmt.Errorf("lazy mounts need Linux (EROFS over FUSE): %w", errdefs.ErrNotImplemented)

// Start describes how to start a fetcher process.
type Start struct {
	Path string
	Args []string
}

// Mount is not supported off Linux.
func Mount(ctx context.Context, root string, spec Spec, table []byte, target string, start Start) error {
	return errLinux
}

// MountPacked is not supported off Linux.
func MountPacked(ctx context.Context, root string, s *store.Store, spec Spec, target string, start Start) error {
	return errLinux
}

// Unmount is not supported off Linux.
func Unmount(target string) error { return errLinux }

// Serve is not supported off Linux.
func Serve(ctx context.Context, dir string, idle time.Duration, log *slog.Logger) error {
	return errLinux
}

// Users is always 0 off Linux.
func Users(dir string) int { return 0 }

func punchHole(f *os.File, off, n int64) {}

func hostUsage(cacheRoot string) int64 { return 0 }

func dropIdleCache(cacheRoot, self string) bool { return false }

// Profile is not supported off Linux.
func Profile(root string, d digest.Digest) ([]erofs.Hot, error) { return nil, errLinux }
