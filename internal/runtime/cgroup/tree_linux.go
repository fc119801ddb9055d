package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// A host's groups are a Tree: the parent they are made under, and that
// parent's own limits, which bound every sandbox together.

// DefaultParent is the group under which a host's sandboxes' groups are
// made, unless its Tree names another.
const DefaultParent = "dsec"

// Tree is where one host's sandbox groups are: under its parent in every
// hierarchy (an idle group's CPU controller under IdleParent, which on
// a unified host is under the parent itself), with the limits of that
// parent (LimitParent). Two Trees of different parents share nothing
// (a parent named as another's idle parent, or its worker's group,
// aside); a nil Tree is DefaultParent's, unlimited.
type Tree struct {
	parent string
	m      func() manager // the host's layout for parent, found at first use

	// The limits of the parent: every sandbox together (LimitParent).
	mu      sync.Mutex
	limits  Limits
	limited map[string]uint64 // the parent's directory -> the inode given limits
}

// NewTree is the tree of the groups under parent ("": DefaultParent).
func NewTree(parent string) *Tree {
	if parent == "" {
		parent = DefaultParent
	}
	return &Tree{parent: parent, m: sync.OnceValue(func() manager { return managerFor(parent) }), limited: map[string]uint64{}}
}

// Parent names t's parent group.
func (t *Tree) Parent() string {
	if t == nil {
		return DefaultParent
	}
	return t.parent
}

// IdleParent is t's idle parent, as a path under the root of the CPU
// controller's hierarchy: Parent with IdleSuffix on a hybrid host,
// Parent/IdleGroup on a unified one.
func (t *Tree) IdleParent() string { return t.manager().idleParent() }

// manager is t's layout, found once at its first use (a nil Tree's at
// each call).
func (t *Tree) manager() manager {
	if t == nil {
		return managerFor(DefaultParent)
	}
	return t.m()
}

// LimitParent bounds every sandbox of the host together: Parent's
// memory and pids limits, so that what dsec's groups use together
// never reaches the host's own processes, the worker or its fetchers
// (which run outside Parent). The limits apply now to Parent as it
// is and whenever it is made again. Zero leaves a limit off.
func (t *Tree) LimitParent(l Limits) error {
	t.mu.Lock()
	t.limits = Limits{MemoryBytes: l.MemoryBytes, Pids: l.Pids}
	clear(t.limited)
	t.mu.Unlock()
	m := t.manager()
	var errs []error
	for _, d := range m.parentDirs() {
		if _, err := os.Stat(d); err == nil {
			errs = append(errs, t.limitParent(m, d))
		}
	}
	return errors.Join(errs...)
}

// ParentLimits are the limits LimitParent set.
func (t *Tree) ParentLimits() Limits {
	if t == nil {
		return Limits{}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.limits
}

// limitAncestors writes Parent's limits into those of Parent's
// directories that take them and hold the group directory d.
func (t *Tree) limitAncestors(m manager, d string) error {
	for _, p := range m.parentDirs() {
		if strings.HasPrefix(d, p+"/") {
			if err := t.limitParent(m, p); err != nil {
				return err
			}
		}
	}
	return nil
}

// limitParent writes Parent's limits into dir if it is one of Parent's
// directories that takes them.
//
// The limits are written once per directory: a create finds them there
// with a stat, until the directory (gone with its last group) is made
// again, with another inode.
func (t *Tree) limitParent(m manager, dir string) error {
	if t == nil {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	l := t.limits
	if l.MemoryBytes == 0 && l.Pids == 0 {
		return nil
	}
	var st syscall.Stat_t
	if err := syscall.Stat(dir, &st); err != nil {
		return fmt.Errorf("cgroup: %s: %w", dir, err)
	}
	if ino, ok := t.limited[dir]; ok && ino == st.Ino {
		return nil
	}
	memory, pids := m.parentFiles(dir)
	if memory != "" && l.MemoryBytes > 0 {
		var err error
		if memory == "memory.limit_in_bytes" { // with swap accounting, swap too
			err = limitMemoryV1(dir, l.MemoryBytes)
		} else {
			err = write(dir, memory, strconv.FormatInt(l.MemoryBytes, 10))
		}
		if err != nil {
			return err
		}
	}
	if pids != "" && l.Pids > 0 {
		if err := write(dir, pids, strconv.FormatInt(l.Pids, 10)); err != nil {
			return err
		}
	}
	t.limited[dir] = st.Ino
	return nil
}

// ParentPressure is the share of time (percent, over the last 10 s) in
// which some task under Parent stalled on memory: PSI's "some avg10" of
// its cgroup2 directory (on hybrid hosts too: PSI needs no controller).
func (t *Tree) ParentPressure() (float64, error) {
	return Pressure(filepath.Join(t.manager().parentV2(), "memory.pressure"))
}

// ParentOOMKills counts the processes the kernel killed under Parent,
// for Parent's limit or a sandbox's own, in the groups there now (v1
// counts a kill in the victim's group only; v2's memory.events counts
// the subtree's).
func (t *Tree) ParentOOMKills() int { return t.manager().parentOOMKills() }

// List names the groups whose names start with prefix and end with
// suffix, in any hierarchy, idle ones too (under the idle parent).
func (t *Tree) List(prefix, suffix string) ([]string, error) {
	parent := t.Parent()
	parents := []string{filepath.Join(Root, parent), filepath.Join(Root, "unified", parent),
		filepath.Join(Root, t.IdleParent()), filepath.Join(Root, "cpu", t.IdleParent()),
		filepath.Join(Root, parent+IdleSuffix)} // (a unified host's idle groups an earlier build made)
	for _, c := range append(slices.Clip(v1Controllers), escapable()...) {
		parents = append(parents, filepath.Join(Root, c, parent))
	}
	seen := map[string]bool{}
	var out []string
	for _, p := range parents {
		ents, err := os.ReadDir(p)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, err
		}
		for _, e := range ents {
			if n := e.Name(); e.IsDir() && n != IdleGroup && strings.HasPrefix(n, prefix) && strings.HasSuffix(n, suffix) && !seen[n] {
				seen[n] = true
				out = append(out, n)
			}
		}
	}
	return out, nil
}

// RemoveLeftover removes what directories of group name remain when Open
// cannot find it (its cgroup2 directory gone, a v1 one left behind by a
// worker before Remove kept the cgroup2 directory for a second try).
// They must hold no process.
func (t *Tree) RemoveLeftover(name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	var errs []error
	for _, g := range t.layouts(name) {
		for _, d := range append(g.dirs(), g.escaped()...) {
			if err := rmdir(d); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}
