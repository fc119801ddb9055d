package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// WorkerGroup is the group Protect moves the worker into: a sibling of
// t's parent at the top of the hierarchy, outside the sandboxes' tree,
// where the kernel honours its protection against every other group
// with no ancestor's share to pass it down.
func (t *Tree) WorkerGroup() string { return t.Parent() + "-worker" }

// Protect moves the calling process, all its threads, into WorkerGroup
// and protects p of its memory there; the processes it starts from then
// on (the fetchers) are born in it. It returns the group's directory.
//
// It needs the memory controller on cgroup2 (MemoryV2, a pure v2 host):
// v1 has no protection to give, and the error says so. Memory charged
// before the move stays with the group it was charged to (cgroup2 does
// not move charges), so a worker calls it first.
func (t *Tree) Protect(p Protection) (string, error) {
	if p.Min < 0 || p.Low < 0 || p.Low > 0 && p.Min > p.Low {
		return "", fmt.Errorf("cgroup: protection min %d, low %d: give sizes with min <= low", p.Min, p.Low)
	}
	if err := MemoryV2.Err(); err != nil {
		return "", err
	}
	if !pureV2() {
		return "", errors.New("the memory controller is on cgroup2 beside v1 controllers, where dsec bounds memory with v1's: no protection")
	}
	dir := filepath.Join(Root, t.WorkerGroup())
	from, err := selfV2()
	if err != nil {
		return "", err
	}
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return "", fmt.Errorf("cgroup: %w", err)
	}
	// The root hands the controller down (a host's init usually has);
	// without it the group has no memory files to write.
	_ = write(Root, "cgroup.subtree_control", "+memory")
	for file, v := range map[string]int64{"memory.min": p.Min, "memory.low": p.Low} {
		if err := write(dir, file, strconv.FormatInt(v, 10)); err != nil {
			return "", err
		}
	}
	if err := write(dir, "cgroup.procs", strconv.Itoa(os.Getpid())); err != nil {
		return "", err
	}
	protectMu.Lock()
	if d := filepath.Join(Root, from); protectedFrom == "" && d != dir {
		protectedFrom = d
	}
	protectMu.Unlock()
	return dir, nil
}

var (
	protectMu sync.Mutex
	// protectedFrom is the group the process was in before the first
	// Protect moved it (a process is in one group, whatever its Trees).
	protectedFrom string
)

// Unprotect moves the calling process, if it is in WorkerGroup, back to
// the group the first Protect took it from, and removes WorkerGroup if
// nothing is left in it (the fetchers a worker leaves running keep it,
// and their protection).
func (t *Tree) Unprotect() error {
	dir := filepath.Join(Root, t.WorkerGroup())
	protectMu.Lock()
	from := protectedFrom
	protectMu.Unlock()
	if rel, err := selfV2(); err == nil && from != "" && filepath.Join(Root, rel) == dir {
		if err := write(from, "cgroup.procs", strconv.Itoa(os.Getpid())); err != nil {
			return err
		}
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, unix.EBUSY) && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("cgroup: %w", err)
	}
	return nil
}

// Protected reads the protection of the group the calling process is in
// now, and that group's directory: nothing on a host where Protect
// cannot protect (memory not on cgroup2 alone).
func Protected() (Protection, string) {
	rel, err := selfV2()
	if err != nil || !MemoryV2.Have() || !pureV2() {
		return Protection{}, ""
	}
	dir := filepath.Join(Root, rel)
	return Protection{Min: readBytes(dir, "memory.min"), Low: readBytes(dir, "memory.low")}, dir
}

// selfV2 is the calling process's cgroup2 path ("0::/PATH" in
// /proc/self/cgroup).
func selfV2() (string, error) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rel, ok := strings.CutPrefix(line, "0::"); ok {
			return rel, nil
		}
	}
	return "", errors.New("no cgroup2 path in /proc/self/cgroup")
}
