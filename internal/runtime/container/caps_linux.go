package container

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// DropBounding drops from this thread's bounding set every capability
// but KeptCaps: no command it forks gains another, even by exec of a
// file with capabilities.
func DropBounding() error {
	last := 40
	if b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap"); err == nil {
		last, _ = strconv.Atoi(strings.TrimSpace(string(b)))
	}
	keep := map[int]bool{}
	for _, c := range KeptCaps {
		keep[c] = true
	}
	for c := 0; c <= last; c++ {
		if !keep[c] {
			if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
				return fmt.Errorf("drop capability %d: %w", c, err)
			}
		}
	}
	return nil
}

// DropPrivileges shrinks the thread's capabilities to KeptCaps (the
// bounding set is dropBounding's) and sets no_new_privs; exec carries
// them to the command.
func DropPrivileges() error {
	var mask [2]uint32
	for _, c := range KeptCaps {
		mask[c/32] |= 1 << (c % 32)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	data := [2]unix.CapUserData{
		{Effective: mask[0], Permitted: mask[0]},
		{Effective: mask[1], Permitted: mask[1]},
	}
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("clear ambient capabilities: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	return nil
}
