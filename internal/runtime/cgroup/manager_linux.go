package cgroup

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// manager is how a host lays its groups out and drives them, as runc's
// fs and fs2 managers are: hybrid (the v1 controllers beside a cgroup2
// hierarchy at Root/unified, these hosts' layout) or unified (cgroup2
// only). A Tree holds the host's, for its parent; a Group carries it.
type manager interface {
	// layout places group name: its cgroup2 directory, and on hybrid
	// hosts one per v1 controller; an idle group's CPU controller (on
	// unified hosts, all of it) under the idle parent.
	layout(name string, idle bool) *Group
	// idleParent is the idle parent's path under cpuRoot: IdleSuffix's
	// sibling of the parent (hybrid) or IdleGroup under it (unified).
	idleParent() string
	// cpuRoot is the root of the CPU controller's hierarchy.
	cpuRoot() string
	// prepare readies the parents before a group is made.
	prepare(g *Group)
	// settle readies them again once its directory is made, if a
	// parent made again meanwhile (after another group's Remove took
	// it away) left the group without its controllers.
	settle(g *Group)
	// legacyIdle is where an earlier build put idle group name, if
	// elsewhere (nil): still opened, listed and removed.
	legacyIdle(name string) *Group
	// limit writes l's memory, CPU and pids limits (zero: left as is).
	limit(g *Group, l Limits) error
	// weight is the file and value for a CPU weight on v2's scale.
	weight(w int64) (file string, v int64)
	// limits reads the memory and pids limits back (0: none).
	limits(g *Group) (memory, pids int64)
	// peak is the most memory the group was ever charged.
	peak(g *Group) int64
	// oomKills counts the group's processes the OOM killer took.
	oomKills(g *Group) int
	// pidsHits counts the forks its pids limit refused.
	pidsHits(g *Group) int
	// charged is the memory charged to it now, page cache included.
	charged(g *Group) (int64, error)
	// reclaim takes back what memory of it the kernel can.
	reclaim(g *Group) error
	// parentDirs are Parent's directories that hold a memory or pids
	// limit; parentFiles the files of dir that take them ("" none).
	parentDirs() []string
	parentFiles(dir string) (memory, pids string)
	// parentV2 is Parent's cgroup2 directory (PSI lives there on
	// either layout).
	parentV2() string
	// parentOOMKills counts the OOM kills under Parent.
	parentOOMKills() int
}

// managerFor is this host's layout for the groups under parent.
func managerFor(parent string) manager {
	if pureV2() {
		return unified{parent}
	}
	return hybrid{parent}
}

// hybrid: v1 memory, cpu, pids, freezer and devices controllers, and a
// cgroup2 hierarchy for freezing, killing, BPF and PSI.
type hybrid struct{ parent string }

func (h hybrid) layout(name string, idle bool) *Group {
	cpuParent := h.parent
	if idle {
		cpuParent = h.idleParent()
	}
	g := &Group{name: name, parent: h.parent, v1: map[string]string{}, m: h, v2: filepath.Join(Root, "unified", h.parent, name), idle: idle}
	for _, c := range v1Controllers {
		if c != "devices" || v1Mounted()[c] {
			g.v1[c] = filepath.Join(Root, c, h.parent, name)
		}
	}
	g.v1["cpu"] = filepath.Join(Root, "cpu", cpuParent, name)
	for _, c := range escapes() {
		g.v1[c] = filepath.Join(Root, c, h.parent, name)
	}
	return g
}

func (h hybrid) idleParent() string { return h.parent + IdleSuffix }

func (hybrid) cpuRoot() string { return filepath.Join(Root, "cpu") }

func (hybrid) prepare(*Group) {}

func (hybrid) settle(*Group) {}

func (hybrid) legacyIdle(string) *Group { return nil }

func (hybrid) limit(g *Group, l Limits) error {
	if l.MemoryBytes > 0 {
		if err := limitMemoryV1(g.v1["memory"], l.MemoryBytes); err != nil {
			return err
		}
		// v1 charges TCP buffers to a group only once it has a TCP
		// limit (v2 charges them to memory.current): without one, a
		// sandbox's unread connections take the host's tcp_mem.
		_ = write(g.v1["memory"], "memory.kmem.tcp.limit_in_bytes", strconv.FormatInt(l.MemoryBytes, 10))
	}
	if l.CPUMilli > 0 {
		if err := write(g.v1["cpu"], "cpu.cfs_period_us", "100000"); err != nil {
			return err
		}
		if err := write(g.v1["cpu"], "cpu.cfs_quota_us", strconv.FormatInt(l.CPUMilli*100, 10)); err != nil {
			return err
		}
	}
	if l.Pids > 0 {
		if err := write(g.v1["pids"], "pids.max", strconv.FormatInt(l.Pids, 10)); err != nil {
			return err
		}
	}
	return nil
}

// limitMemoryV1 sets a v1 memory group's limit to n, and its limit of
// memory and swap together too where the kernel accounts swap (without
// swap accounting memory.memsw.limit_in_bytes is missing: nothing more
// to bound). v1 holds memsw >= limit at every write and refuses one that
// would break it (EINVAL), so a raise writes memsw first and a lowering
// the limit first: in one fixed order, a worker that lowered the
// sandboxes' parent left the next one unable to raise it, and every
// create failed.
func limitMemoryV1(dir string, n int64) error {
	const limit, memsw = "memory.limit_in_bytes", "memory.memsw.limit_in_bytes"
	v := strconv.FormatInt(n, 10)
	if _, err := os.Stat(filepath.Join(dir, memsw)); errors.Is(err, os.ErrNotExist) {
		return writeReclaiming(dir, limit, v)
	}
	cur, err := readInt(dir, limit)
	if err != nil {
		return fmt.Errorf("cgroup: %w", err)
	}
	order := []string{limit, memsw}
	if n > cur {
		order = []string{memsw, limit}
	}
	for _, f := range order {
		if err := writeReclaiming(dir, f, v); err != nil {
			return err
		}
	}
	return nil
}

// writeReclaiming writes a v1 memory limit: one below the group's usage
// has the kernel reclaim first, and it answers EBUSY when that did not
// get below it in its few tries (page cache dirty or under writeback on
// a busy host: a spare's group lowered to 32 MiB failed a create so), so
// it is written again, a second at most, before that is the answer.
func writeReclaiming(dir, file, v string) error {
	var err error
	for wait := time.Millisecond; ; wait *= 2 {
		if err = write(dir, file, v); !errors.Is(err, unix.EBUSY) || wait > 256*time.Millisecond {
			break
		}
		time.Sleep(wait)
	}
	if errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("%w (the group uses %d bytes, and the kernel reclaimed too little of them)", err, readBytes(dir, "memory.usage_in_bytes"))
	}
	return err
}

func (hybrid) weight(w int64) (string, int64) { return "cpu.shares", max(2, w*1024/100) }

func (hybrid) limits(g *Group) (int64, int64) {
	return readBytes(g.v1["memory"], "memory.limit_in_bytes"), readBytes(g.v1["pids"], "pids.max")
}

func (hybrid) peak(g *Group) int64 { return readBytes(g.v1["memory"], "memory.max_usage_in_bytes") }

func (hybrid) oomKills(g *Group) int { return oomKills(g.v1["memory"], "memory.oom_control") }

func (hybrid) pidsHits(g *Group) int { return counter(g.v1["pids"], "pids.events", "max") }

func (hybrid) charged(g *Group) (int64, error) {
	return readInt(g.v1["memory"], "memory.usage_in_bytes")
}

// reclaim is memory.force_empty, which needs no limit.
func (hybrid) reclaim(g *Group) error { return write(g.v1["memory"], "memory.force_empty", "0") }

func (h hybrid) parentDirs() []string {
	return []string{filepath.Join(Root, "memory", h.parent), filepath.Join(Root, "pids", h.parent)}
}

func (h hybrid) parentFiles(dir string) (string, string) {
	switch dir {
	case filepath.Join(Root, "memory", h.parent):
		return "memory.limit_in_bytes", ""
	case filepath.Join(Root, "pids", h.parent):
		return "", "pids.max"
	}
	return "", ""
}

func (h hybrid) parentV2() string { return filepath.Join(Root, "unified", h.parent) }

// parentOOMKills adds up the groups' counts: v1 counts a kill in the
// victim's group only.
func (h hybrid) parentOOMKills() int {
	dir := filepath.Join(Root, "memory", h.parent)
	n := oomKills(dir, "memory.oom_control")
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if e.IsDir() {
			n += oomKills(filepath.Join(dir, e.Name()), "memory.oom_control")
		}
	}
	return n
}

// unified: every controller on the cgroup2 hierarchy at Root.
type unified struct{ parent string }

func (h unified) layout(name string, idle bool) *Group {
	parent := h.parent
	if idle {
		parent = h.idleParent()
	}
	return &Group{name: name, parent: h.parent, v1: map[string]string{}, m: h, v2: filepath.Join(Root, parent, name), idle: idle}
}

func (h unified) idleParent() string { return filepath.Join(h.parent, IdleGroup) }

// legacyIdle: a build before IdleGroup put an idle group beside the
// parent, in IdleSuffix's sibling (outside the parent's bound).
func (h unified) legacyIdle(name string) *Group {
	return &Group{name: name, parent: h.parent, v1: map[string]string{}, m: h, v2: filepath.Join(Root, h.parent+IdleSuffix, name), idle: true}
}

func (unified) cpuRoot() string { return Root }

// prepare hands the controllers down to the sandboxes' groups, through
// every group above them (the idle parent's too). A controller the host
// does not offer (or gave away to a threaded subtree) stays off: the
// group then goes without that limit, as the features report says.
func (unified) prepare(g *Group) {
	parent := filepath.Dir(g.v2)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return // New's mkdir says why
	}
	dirs := []string{Root}
	rel, _ := filepath.Rel(Root, parent)
	for _, c := range strings.Split(rel, "/") {
		dirs = append(dirs, filepath.Join(dirs[len(dirs)-1], c))
	}
	for _, c := range []string{"+memory", "+cpu", "+pids"} {
		for _, d := range dirs {
			_ = write(d, "cgroup.subtree_control", c)
		}
	}
}

// settle is prepare again where the group came without controllers
// (one read where it has them: a create's usual case).
func (h unified) settle(g *Group) {
	if b, err := os.ReadFile(filepath.Join(g.v2, "cgroup.controllers")); err == nil && len(strings.TrimSpace(string(b))) == 0 {
		h.prepare(g)
	}
}

func (unified) limit(g *Group, l Limits) error {
	if l.MemoryBytes > 0 {
		if err := write(g.v2, "memory.max", strconv.FormatInt(l.MemoryBytes, 10)); err != nil {
			return err
		}
		// No swap for the group (the file is missing without swap).
		_ = write(g.v2, "memory.swap.max", "0")
	}
	if l.CPUMilli > 0 {
		if err := write(g.v2, "cpu.max", fmt.Sprintf("%d 100000", l.CPUMilli*100)); err != nil {
			return err
		}
	}
	if l.Pids > 0 {
		if err := write(g.v2, "pids.max", strconv.FormatInt(l.Pids, 10)); err != nil {
			return err
		}
	}
	return nil
}

func (unified) weight(w int64) (string, int64) { return "cpu.weight", w }

func (unified) limits(g *Group) (int64, int64) {
	return readBytes(g.v2, "memory.max"), readBytes(g.v2, "pids.max")
}

func (unified) peak(g *Group) int64 { return readBytes(g.v2, "memory.peak") }

func (unified) oomKills(g *Group) int { return oomKills(g.v2, "memory.events") }

func (unified) pidsHits(g *Group) int { return counter(g.v2, "pids.events", "max") }

func (unified) charged(g *Group) (int64, error) { return readInt(g.v2, "memory.current") }

// reclaim is memory.reclaim of all the group holds, which stops short
// with EAGAIN when nothing more can go (not an error here): memory no
// reclaim can take, such as a tmpfs's files on a host without swap.
//
// The write is a plain write(2): os.File would take the EAGAIN of a
// file that polls (cgroup files do) for "not yet", and wait for a
// readiness that never comes.
func (unified) reclaim(g *Group) error {
	n, err := g.MemoryCharged()
	if err != nil {
		return err
	}
	p := filepath.Join(g.v2, "memory.reclaim")
	fd, err := unix.Open(p, unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("cgroup: %s: %w", p, err)
	}
	defer unix.Close(fd)
	for {
		_, err = unix.Write(fd, []byte(strconv.FormatInt(n, 10)))
		if err != unix.EINTR {
			break
		}
	}
	if err != nil && err != unix.EAGAIN {
		return fmt.Errorf("cgroup: write %d to %s: %w", n, p, err)
	}
	return nil
}

func (h unified) parentDirs() []string { return []string{filepath.Join(Root, h.parent)} }

func (h unified) parentFiles(dir string) (string, string) {
	if dir == filepath.Join(Root, h.parent) {
		return "memory.max", "pids.max"
	}
	return "", ""
}

func (h unified) parentV2() string { return filepath.Join(Root, h.parent) }

// parentOOMKills: v2's memory.events counts the subtree's.
func (h unified) parentOOMKills() int {
	return oomKills(filepath.Join(Root, h.parent), "memory.events")
}
