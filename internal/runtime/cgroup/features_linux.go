package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/dsec-project/dsec/internal/feature"
)

// The cgroup features a worker reports (package feature).
var (
	// Kill is cgroup.kill (Linux 5.14): every process of a group killed
	// at once.
	Kill = feature.New("cgroup.kill", "a group is frozen, its processes killed one by one, then thawed", func() error {
		return since("cgroup.kill", 5, 14)
	})
	// Freeze is the cgroup2 freezer (Linux 5.2).
	Freeze = feature.New("cgroup.freeze", "groups are frozen by the v1 freezer", func() error {
		return since("cgroup.freeze", 5, 2)
	})
	// MemoryV2 is the memory controller on the cgroup2 hierarchy: what
	// memory.low and memory.min protection (of the worker and its
	// fetchers against the sandboxes) needs.
	MemoryV2 = feature.New("cgroup2 memory", "memory is bounded by the v1 controller, and the worker's own memory is not protected (memory.min, memory.low)", func() error {
		dir := Root
		if !pureV2() {
			dir = filepath.Join(Root, "unified")
		}
		b, err := os.ReadFile(filepath.Join(dir, "cgroup.controllers"))
		if err != nil {
			return err
		}
		if !slices.Contains(strings.Fields(string(b)), "memory") {
			return errors.New("the memory controller is on cgroup v1")
		}
		return nil
	})
)

// since says whether the kernel is at least major.minor, where the
// cgroup2 core file came in (not a configurable part: every kernel since
// has it). The files themselves are not looked for: a group of the host
// to look in may come and go while the probe runs.
func since(file string, major, minor int) error {
	maj, min := feature.KernelVersion()
	if maj > major || maj == major && min >= minor {
		return nil
	}
	return fmt.Errorf("Linux %d.%d: %s came in %d.%d", maj, min, file, major, minor)
}
