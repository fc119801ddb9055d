package runtime

import (
	"errors"
	"fmt"
	"os"
	goruntime "runtime"
	"strconv"
	"strings"
)

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
