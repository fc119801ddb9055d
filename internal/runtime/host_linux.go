package runtime

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	goruntime "runtime"
	"strconv"
	"strings"
	"sync"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/lazy"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/lower"
)

// Host is what a worker runs its sandboxes with, one per root and passed
// by pointer: where their layers come from (the local store, or for
// those missing there the shared Remote, lazily, by fetchers started
// with Fetcher), the drivers that run them, the layers mounted for them,
// the groups they run in, the sandboxes primed ahead of need and the
// default disk bound. Two Hosts share no state: a test may run two in
// one process, each with its root and cgroup parent.
//
// Its fields are set before its first use and not changed after.
type Host struct {
	// Root is the worker's root: sandboxes, layers mounted, uppers.
	Root     string
	Store    *store.Store
	Remote   remote.Target
	Insecure bool
	Fetcher  lazy.Start
	Cache    lazy.Tuning // cache.max_bytes, cache.read_ahead_kb
	// Drivers run the backends, their sandboxes' groups under
	// Drivers.Groups (nil: the built-in drivers, nothing made ahead
	// of need, under the default parent).
	Drivers *Drivers
	// Primed are sandboxes made ahead on the last create's layers; nil:
	// none.
	Primed *Primed
	// DiskBound is the bound of a sandbox that asks for none (see
	// Spec.DiskBound); 0: its upper is a directory of the root's own
	// file system, bounded by nothing (library use).
	DiskBound int64

	once   sync.Once
	lowers *lower.Mounts
}

// init makes what h holds beyond its fields, once.
func (h *Host) init() {
	h.once.Do(func() {
		h.lowers = lower.New(h.Root)
		if h.Drivers == nil {
			h.Drivers = NewDrivers(DriverConfig{Root: h.Root})
		}
	})
}

// Lowers are the layers h has mounted for its sandboxes.
func (h *Host) Lowers() *lower.Mounts {
	h.init()
	return h.lowers
}

// Groups is the tree of h's sandboxes' groups.
func (h *Host) Groups() *cgroup.Tree {
	h.init()
	return h.Drivers.Groups()
}

// Source is where h finds layers.
func (h *Host) Source() lower.Source {
	return lower.Source{Store: h.Store, Remote: h.Remote, Insecure: h.Insecure, Fetcher: h.Fetcher, Cache: h.Cache}
}

// baseSource is where h's backends find their own bases (a full VM's
// disk): the store, and a disk it lacks read lazily from the shared
// remote by a fetcher, as a layer is (lazy.ServeFile).
func (h *Host) baseSource() driver.BaseSource {
	src := driver.BaseSource{Store: h.Store}
	if h.Remote == nil {
		return src
	}
	src.Serve = func(ctx context.Context, ref string, blob ocispec.Descriptor, w layer.Windows, table []byte) (string, io.Closer, error) {
		spec := lazy.Spec{Ref: ref, Digest: blob.Digest, Size: blob.Size, Windows: w, Remote: h.Remote.String(),
			Insecure: h.Insecure, MaxBytes: h.Cache.MaxBytes, Raw: true}
		p, hold, err := lazy.ServeFile(ctx, h.Root, spec, table, h.Fetcher)
		if err != nil {
			return "", nil, err
		}
		return p, hold, nil
	}
	return src
}

// HostCapacity is what admission divides: the CPUs this process may run
// on and the host's memory.
func HostCapacity() (cpus int, mem int64, err error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				return 0, 0, fmt.Errorf("/proc/meminfo: %q: %w", line, err)
			}
			return goruntime.NumCPU(), kb << 10, nil
		}
	}
	return 0, 0, errors.New("/proc/meminfo has no MemTotal")
}

func numCPU() int { return goruntime.NumCPU() }

// hostMemory is the host's memory (0: unknown, which bounds nothing).
func hostMemory() int64 {
	_, mem, err := HostCapacity()
	if err != nil || mem <= 0 {
		return 1 << 62
	}
	return mem
}
