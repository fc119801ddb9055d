package initproto

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/feature"
)

// The features of sandboxes' inits a worker reports (package feature).
var (
	// CoreSched is core scheduling: batch sandboxes' commands never
	// share a core's SMT siblings with another sandbox's tasks.
	CoreSched = feature.New("core scheduling", "a batch sandbox's commands may run on the SMT sibling of another sandbox's task", func() error {
		// Reading the calling thread's cookie fails with EINVAL without
		// CONFIG_SCHED_CORE, ENODEV without SMT.
		var cookie uint64
		if err := unix.Prctl(unix.PR_SCHED_CORE, 0 /* PR_SCHED_CORE_GET */, 0, 0 /* PIDTYPE_PID */, uintptr(unsafe.Pointer(&cookie))); err != nil {
			if errors.Is(err, unix.ENODEV) {
				return errors.New("the CPUs have no SMT siblings to keep apart")
			}
			return fmt.Errorf("CONFIG_SCHED_CORE unset (PR_SCHED_CORE: %w)", err)
		}
		return nil
	})
	// Landlock confines writes (a policy's files.readWrite).
	Landlock = feature.New("landlock", "a policy with files.readWrite is refused", func() error {
		abi, _, errno := unix.Syscall(unix.SYS_LANDLOCK_CREATE_RULESET, 0, 0, unix.LANDLOCK_CREATE_RULESET_VERSION)
		if errno != 0 {
			return fmt.Errorf("landlock_create_ruleset: %w", errno)
		}
		if abi < 1 {
			return fmt.Errorf("Landlock ABI %d", abi)
		}
		return nil
	})
	// MemoryMerge is KSM merging of a process's pages (a sandbox's
	// --merge-memory).
	MemoryMerge = feature.New("ksm memory merge", "a sandbox asking to merge its memory (merge_memory) fails to start", func() error {
		if _, err := unix.PrctlRetInt(unix.PR_GET_MEMORY_MERGE, 0, 0, 0, 0); err != nil {
			return fmt.Errorf("PR_GET_MEMORY_MERGE: %w", err)
		}
		return nil
	})
	// UserNamespaces are what a sandbox's --userns needs.
	UserNamespaces = feature.New("user namespaces", "a sandbox asking for a user namespace (userns) fails to start", func() error {
		b, err := os.ReadFile("/proc/sys/user/max_user_namespaces")
		if err != nil {
			return err
		}
		if strings.TrimSpace(string(b)) == "0" {
			return errors.New("user.max_user_namespaces is 0")
		}
		return nil
	})
)
