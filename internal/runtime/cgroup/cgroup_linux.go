// Package cgroup gives each sandbox a control group: memory, cpu and pids
// limits, freeze and thaw, kill-all and OOM reporting, on the hybrid
// layout these hosts have (v1 controllers plus a cgroup2 hierarchy at
// /sys/fs/cgroup/unified with cgroup.freeze, cgroup.kill and BPF attach
// points) and on pure cgroup v2 hosts.
package cgroup

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Root is where cgroup file systems are mounted.
var Root = "/sys/fs/cgroup"

// IdleSuffix names a hybrid host's idle parent after its parent
// ("dsec-batch" for DefaultParent's). The idle parent holds the CPU
// groups of idle (batch) sandboxes: on a hybrid host, a sibling of the
// parent in the CPU controller's hierarchy, marked cpu.idle, so that at
// the top of that hierarchy, where the host's own tasks and the latency
// sandboxes' parent compete, any of them that wakes up preempts the
// whole of the batch work at once; their memory stays under the parent,
// in the memory controller's hierarchy of its own. Each Tree has its
// own: a test's tree shares nothing with a worker's.
const IdleSuffix = "-batch"

// IdleGroup names the idle parent on a unified host: a child of the
// parent ("dsec/batch"), marked cpu.idle. One hierarchy holds every
// controller there, and only a group under the parent is under its
// memory bound: so batch sandboxes stay inside the bound on every
// sandbox together, and give way to the latency sandboxes beside them,
// but not to the host's own tasks, which compete with the parent as a
// whole. No group takes this name.
const IdleGroup = "batch"

// Limits are a sandbox's resource limits; zero means none.
type Limits struct {
	MemoryBytes int64
	CPUMilli    int64 // 1000 = one CPU
	Pids        int64
	// Weight is the group's CPU weight on cgroup v2's scale (1-10000,
	// 100 the kernel's default; cpu.shares = Weight*1024/100 on v1).
	Weight int64 `json:",omitempty"`
	// Idle runs the group as SCHED_IDLE (cpu.idle): it gets only the CPU
	// nothing else wants. Fixed when the group is made.
	Idle bool `json:",omitempty"`
}

// Group is one sandbox's cgroup, in every hierarchy it spans.
type Group struct {
	name   string
	parent string            // its Tree's
	v1     map[string]string // controller -> directory (hybrid hosts)
	v2     string            // the cgroup2 directory (both layouts)
	m      manager           // the host's layout: hybrid or unified
	idle   bool              // its CPU group is under an idle parent
}

var v1Controllers = []string{"memory", "cpu", "pids", "freezer", "devices"}

// v1Mounted says whether a v1 controller's hierarchy is mounted (the
// devices controller is not on every hybrid host).
var v1Mounted = sync.OnceValue(func() map[string]bool {
	m := map[string]bool{}
	for _, c := range v1Controllers {
		var st syscall.Statfs_t
		if err := syscall.Statfs(filepath.Join(Root, c), &st); err == nil && st.Type == cgroupSuperMagic {
			m[c] = true
		}
	}
	return m
})

const cgroupSuperMagic = 0x27e0eb

// escapes are the host's v1 hierarchies that hold none of the
// controllers dsec bounds sandboxes with (cpuacct, cpuset, blkio,
// name=systemd, ...) and where this process is not in the root group.
// A sandbox's group is made in each of them too, so that none of its
// processes stays in a group of its worker's: a kubelet deleting the
// worker's pod kills every process left in any hierarchy of the pod's
// groups, and a service manager may stop every process of the
// worker's. (Where the worker is in the root group, as on a host's
// shell, they stay there: nothing to leave, and nothing to pay.)
var escapes = sync.OnceValue(func() []string {
	self, _ := os.ReadFile("/proc/self/cgroup")
	mounts, _ := os.ReadFile("/proc/self/mountinfo")
	var out []string
	for _, line := range strings.Split(string(self), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 || f[1] == "" || f[2] == "/" {
			continue // cgroup2's line, or the root group
		}
		ctrls := strings.Split(f[1], ",")
		if slices.ContainsFunc(ctrls, func(c string) bool { return slices.Contains(v1Controllers, c) }) {
			continue // bounded there already
		}
		if dir := v1Mount(string(mounts), ctrls); dir != "" && !slices.Contains(out, dir) {
			out = append(out, dir)
		}
	}
	slices.Sort(out)
	return out
})

// escapable are the v1 hierarchies a group may have escaped to (those
// that hold none of dsec's controllers), whatever this process's place
// in them: where a group made by a worker elsewhere (in a pod) may have
// directories to remove.
var escapable = sync.OnceValue(func() []string {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !ok || len(f) < 5 || len(g) < 3 || g[0] != "cgroup" || filepath.Dir(f[4]) != Root {
			continue
		}
		opts := strings.Split(g[2], ",")
		if !slices.ContainsFunc(opts, func(o string) bool { return slices.Contains(v1Controllers, o) }) && !slices.Contains(out, filepath.Base(f[4])) {
			out = append(out, filepath.Base(f[4]))
		}
	}
	return out
})

// v1Mount is the directory under Root (its base name) where the v1
// hierarchy of ctrls is mounted, as mountinfo says; "" if none.
func v1Mount(mountinfo string, ctrls []string) string {
	for _, line := range strings.Split(mountinfo, "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !ok || len(f) < 5 || len(g) < 3 || g[0] != "cgroup" || filepath.Dir(f[4]) != Root {
			continue
		}
		opts := strings.Split(g[2], ",")
		if !slices.ContainsFunc(ctrls, func(c string) bool { return !slices.Contains(opts, c) }) {
			return filepath.Base(f[4])
		}
	}
	return ""
}

// Hierarchies are the directories of every cgroup hierarchy mounted
// under Root: each v1 one and the cgroup2 one.
func Hierarchies() []string {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if ok && len(f) >= 5 && len(g) >= 1 && (g[0] == "cgroup" || g[0] == "cgroup2") &&
			(f[4] == Root || filepath.Dir(f[4]) == Root) && !slices.Contains(out, f[4]) {
			out = append(out, f[4])
		}
	}
	return out
}

// Join moves this process into group name (made if missing) in every
// hierarchy: as a container runtime places a container (a test's pod).
func Join(name string) error {
	for _, h := range Hierarchies() {
		d := filepath.Join(h, name)
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
		if filepath.Base(h) == "cpuset" {
			if err := fillCpuset(d, ""); err != nil {
				return err
			}
		}
		if err := write(d, "cgroup.procs", strconv.Itoa(os.Getpid())); err != nil {
			return err
		}
	}
	return nil
}

// ownCpuset is this process's v1 cpuset group, "" if none or the root:
// a sandbox that leaves it (escapes) keeps its CPUs and memory nodes (a
// pod's CPU manager's pinning).
var ownCpuset = sync.OnceValue(func() string {
	self, _ := os.ReadFile("/proc/self/cgroup")
	for _, line := range strings.Split(string(self), "\n") {
		if f := strings.SplitN(line, ":", 3); len(f) == 3 && slices.Contains(strings.Split(f[1], ","), "cpuset") && f[2] != "/" {
			return filepath.Join(Root, "cpuset", f[2])
		}
	}
	return ""
})

// fillCpuset gives a new v1 cpuset group the CPUs and memory nodes of
// from ("": its parent's): one starts with none, and takes no process so.
func fillCpuset(dir, from string) error {
	if from == "" {
		from = filepath.Dir(dir)
	}
	for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			return fmt.Errorf("cgroup: %w", err)
		}
		if strings.TrimSpace(string(b)) != "" {
			continue
		}
		p, err := os.ReadFile(filepath.Join(from, f))
		if err != nil {
			return fmt.Errorf("cgroup: %w", err)
		}
		if err := write(dir, f, strings.TrimSpace(string(p))); err != nil {
			return err
		}
	}
	return nil
}

// pureV2 reports whether the host has only the unified hierarchy.
func pureV2() bool {
	_, err := os.Stat(filepath.Join(Root, "cgroup.controllers"))
	return err == nil
}

func write(dir, file, value string) error {
	if err := os.WriteFile(filepath.Join(dir, file), []byte(value), 0o644); err != nil {
		return fmt.Errorf("cgroup: write %s to %s: %w", value, filepath.Join(dir, file), err)
	}
	return nil
}

// New makes the group name with limits. A name already in use is an
// error; Remove takes it away.
func (t *Tree) New(name string, l Limits) (*Group, error) { return t.newGroup(t.manager(), name, l) }

// newGroup is New on m's layout.
func (t *Tree) newGroup(m manager, name string, l Limits) (*Group, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	g := m.layout(name, l.Idle)
	for _, d := range g.dirs() {
		var err error
		for try := 0; try < 3; try++ { // a Remove may take the parent away meanwhile
			if err = os.MkdirAll(filepath.Dir(d), 0o755); err != nil {
				err = fmt.Errorf("cgroup: %w", err)
				continue
			}
			if d == g.v2 {
				g.m.prepare(g) // the parent's limit files come with its controllers
			}
			// Before the group is in it: no sandbox is ever under an
			// unbounded parent (it goes with its last group, and comes
			// back without its limits). On a unified host an idle
			// group's parent is the idle parent, under the parent.
			if err = t.limitAncestors(m, d); errors.Is(err, os.ErrNotExist) {
				continue // gone again meanwhile
			} else if err != nil {
				break
			}
			cpuset := strings.HasPrefix(d, filepath.Join(Root, "cpuset")+"/")
			if cpuset {
				if err = fillCpuset(filepath.Dir(d), ""); err != nil {
					break
				}
			}
			if err = os.Mkdir(d, 0o755); !errors.Is(err, os.ErrNotExist) {
				switch {
				case err != nil:
					err = fmt.Errorf("cgroup: %w", err)
				case cpuset:
					err = fillCpuset(d, ownCpuset())
				case d == g.v2:
					g.m.settle(g)
				}
				break
			}
			err = fmt.Errorf("cgroup: %w", err)
		}
		if err != nil { // (each says it is the cgroup's)
			g.Remove()
			return nil, err
		}
	}
	// The idle parent is marked once it holds the group (a parent
	// goes with its last group, so it may be new).
	if l.Idle {
		if err := write(filepath.Dir(g.cpuDir()), "cpu.idle", "1"); err != nil {
			g.Remove()
			return nil, err
		}
	}
	if err := g.limit(l); err != nil {
		g.Remove()
		return nil, err
	}
	return g, nil
}

// ReachedLimit says whether the group's memory ever came within 1 MiB
// of its own limit (false with none): an OOM kill in a group that never
// did was for a bound above it, the host's. (The kernel's failure
// counts do not say: v1 keeps them on the counter that failed, and
// not for every charge.)
func (g *Group) ReachedLimit() bool {
	limit, _ := g.Limits()
	return limit > 0 && g.m.peak(g) >= limit-1<<20
}

// readBytes reads a byte count or limit a cgroup file holds (0 for
// none: "max", v1's page-rounded maximum, or no file).
func readBytes(dir, file string) int64 {
	b, _ := os.ReadFile(filepath.Join(dir, file))
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || n >= 1<<62 {
		return 0
	}
	return n
}

// counter reads the count after key in a flat-keyed cgroup file
// (memory.events, memory.oom_control, pids.events; 0 without it).
func counter(dir, file, key string) int {
	b, _ := os.ReadFile(filepath.Join(dir, file))
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, key+" "); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}

// Pressure reads "some avg10" from a PSI file (/proc/pressure/memory,
// a cgroup's memory.pressure).
func Pressure(file string) (float64, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "some "); ok {
			for _, f := range strings.Fields(rest) {
				if v, ok := strings.CutPrefix(f, "avg10="); ok {
					return strconv.ParseFloat(v, 64)
				}
			}
		}
	}
	return 0, fmt.Errorf("%s: no some avg10", file)
}

// oomKills reads the oom_kill count of a memory group's file.
func oomKills(dir, file string) int { return counter(dir, file, "oom_kill") }

func checkName(name string) error {
	if name == "" || strings.ContainsAny(name, "/\x00") || name == "." || name == ".." || name == IdleGroup {
		return fmt.Errorf("cgroup: bad name %q", name)
	}
	return nil
}

// cpuDir is the directory of the group's CPU controller.
func (g *Group) cpuDir() string {
	if d, ok := g.v1["cpu"]; ok {
		return d
	}
	return g.v2
}

// Open returns the group name made earlier, for a worker that restarts.
func (t *Tree) Open(name string) (*Group, error) {
	ls := t.layouts(name)
	for _, g := range ls {
		if _, err := os.Stat(g.cpuDir()); err == nil {
			if _, err := os.Stat(g.v2); err == nil {
				return g, nil
			}
		}
	}
	// Without its CPU directory: one whose Remove stopped half-way (its
	// v1 directories go first, its cgroup2 one last).
	var err error
	for _, g := range ls {
		if _, err = os.Stat(g.v2); err == nil {
			return g, nil
		}
	}
	return nil, fmt.Errorf("cgroup %s: %w", name, err)
}

// layouts are the places group name may be: a latency group's, an idle
// one's, and on a unified host an idle one's that a build before this
// one made (in IdleSuffix's sibling of the parent, outside its bound).
func (t *Tree) layouts(name string) []*Group {
	m := t.manager()
	out := []*Group{m.layout(name, false), m.layout(name, true)}
	if g := m.legacyIdle(name); g != nil {
		out = append(out, g)
	}
	return out
}

func (g *Group) dirs() []string {
	out := []string{g.v2}
	for _, c := range append(slices.Clip(v1Controllers), escapes()...) {
		if d, ok := g.v1[c]; ok {
			out = append(out, d)
		}
	}
	return out
}

// Path is the cgroup2 directory: where BPF programs attach.
func (g *Group) Path() string { return g.v2 }

// CPUDir is the group's directory in the CPU controller's hierarchy:
// cgroup v1's cpu on a hybrid host, the cgroup2 one on a unified host.
func (g *Group) CPUDir() string { return g.cpuDir() }

func (g *Group) limit(l Limits) error {
	if err := g.m.limit(g, l); err != nil {
		return err
	}
	return g.schedule(l)
}

// schedule sets the group's CPU weight and idleness.
func (g *Group) schedule(l Limits) error {
	if l.Weight < 0 || l.Weight > 10000 {
		return fmt.Errorf("cgroup: CPU weight %d out of 1-10000", l.Weight)
	}
	if l.Weight > 0 {
		file, v := g.m.weight(l.Weight)
		if err := write(g.cpuDir(), file, strconv.FormatInt(v, 10)); err != nil {
			return err
		}
	}
	if l.Idle {
		return write(g.cpuDir(), "cpu.idle", "1")
	}
	return nil
}

// Add moves a process into the group, in every hierarchy. The moves run
// at once: each may wait for an RCU grace period (cgroup v1 attach takes
// the thread-group rwsem for writing), and concurrent writers share one.
func (g *Group) Add(pid int) error {
	dirs := g.dirs()
	errs := make([]error, len(dirs))
	var wg sync.WaitGroup
	for i, d := range dirs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = write(d, "cgroup.procs", strconv.Itoa(pid))
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Pids lists the processes in the group.
func (g *Group) Pids() ([]int, error) {
	f, err := os.Open(filepath.Join(g.v2, "cgroup.procs"))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []int
	s := bufio.NewScanner(f)
	for s.Scan() {
		if pid, err := strconv.Atoi(s.Text()); err == nil {
			out = append(out, pid)
		}
	}
	return out, s.Err()
}

// Freeze stops every process of the group and waits until it is frozen.
func (g *Group) Freeze() error { return g.setFrozen(true) }

// Thaw lets a frozen group run again.
func (g *Group) Thaw() error { return g.setFrozen(false) }

func (g *Group) setFrozen(on bool) error {
	if Freeze.Have() {
		v := map[bool]string{true: "1", false: "0"}[on]
		if err := write(g.v2, "cgroup.freeze", v); err != nil {
			return err
		}
		return g.wait(func() bool { return eventValue(g.v2, "frozen") == v })
	}
	v := map[bool]string{true: "FROZEN", false: "THAWED"}[on]
	if err := write(g.v1["freezer"], "freezer.state", v); err != nil {
		return err
	}
	return g.wait(func() bool {
		b, _ := os.ReadFile(filepath.Join(g.v1["freezer"], "freezer.state"))
		return strings.TrimSpace(string(b)) == v
	})
}

// Frozen reports whether the group is frozen.
func (g *Group) Frozen() bool {
	if Freeze.Have() {
		return eventValue(g.v2, "frozen") == "1"
	}
	b, _ := os.ReadFile(filepath.Join(g.v1["freezer"], "freezer.state"))
	return strings.TrimSpace(string(b)) == "FROZEN"
}

func eventValue(dir, key string) string {
	b, _ := os.ReadFile(filepath.Join(dir, "cgroup.events"))
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, key+" "); ok {
			return v
		}
	}
	return ""
}

func (g *Group) wait(done func() bool) error {
	deadline := time.Now().Add(10 * time.Second)
	for !done() {
		if time.Now().After(deadline) {
			return fmt.Errorf("cgroup %s: state change timed out", g.name)
		}
		time.Sleep(time.Millisecond)
	}
	return nil
}

// Kill kills every process of the group and waits until none is left.
func (g *Group) Kill() error {
	if Kill.Have() {
		if err := write(g.v2, "cgroup.kill", "1"); err != nil {
			return err
		}
	} else {
		// No cgroup.kill: freeze so nothing forks, kill, thaw.
		if err := g.Freeze(); err != nil {
			return err
		}
		pids, _ := g.Pids()
		for _, p := range pids {
			syscall.Kill(p, syscall.SIGKILL)
		}
		if err := g.Thaw(); err != nil {
			return err
		}
	}
	g.hasten()
	return g.wait(func() bool {
		pids, err := g.Pids()
		return err == nil && len(pids) == 0
	})
}

// hasten gives the killed processes of an idle group the CPU to exit.
// They run SCHED_IDLE in a group under an idle parent, whose share of a busy
// host is a few thousandths of a CPU: exiting took them past Kill's 10 s
// wait there, and the group could not be removed. Each is made a normal
// task, in the root group of the CPU controller (killed, it can neither
// fork nor run anything of its own there: it exits).
func (g *Group) hasten() {
	if !g.idle {
		return
	}
	root := g.m.cpuRoot()
	pids, _ := g.Pids()
	for _, pid := range pids {
		// Still the group's (its pid not reused by a host process since
		// it was listed): only this sandbox's processes are moved.
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid)); err != nil || !strings.Contains(string(b), "/"+g.name+"\n") {
			continue
		}
		tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid)) // the policy is per thread
		for _, t := range tasks {
			if tid, err := strconv.Atoi(t.Name()); err == nil {
				unix.SchedSetAttr(tid, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_NORMAL}, 0)
			}
		}
		write(root, "cgroup.procs", strconv.Itoa(pid)) // gone already: nothing to move
	}
}

// OOMKills counts the processes of the group the kernel killed for
// exceeding its memory limit.
func (g *Group) OOMKills() int { return g.m.oomKills(g) }

// PidsLimitHits counts the forks the pids limit refused.
func (g *Group) PidsLimitHits() int { return g.m.pidsHits(g) }

// MemoryCharged is the memory charged to the group, page cache included.
func (g *Group) MemoryCharged() (int64, error) { return g.m.charged(g) }

// readInt reads the number a cgroup file holds.
func readInt(dir, file string) (int64, error) {
	b, err := os.ReadFile(filepath.Join(dir, file))
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}

// Remove deletes the group; it must hold no process (Kill first). The
// cgroup2 directory goes last, and only when all the v1 ones have gone:
// Open finds a group by it, so a group one of whose v1 directories would
// not go yet (a killed task still exiting) can be removed again later.
func (g *Group) Remove() error {
	dirs := g.dirs()
	var errs []error
	for _, d := range append(dirs[1:], g.escaped()...) {
		if err := rmdir(d); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	if err := rmdir(dirs[0]); err != nil {
		return err
	}
	// rmdir took the idle parent with its last group; where that is the
	// parent's child (a unified host), the parent goes with it too.
	if ip := g.m.idleParent(); filepath.Dir(g.cpuDir()) == filepath.Join(g.m.cpuRoot(), ip) && filepath.Dir(ip) == g.parent {
		os.Remove(filepath.Join(g.m.cpuRoot(), g.parent))
	}
	return nil
}

// escaped are the directories of the group in the hierarchies a worker
// elsewhere may have made it in and this one does not (escapable, not
// escapes): a sandbox's made by a worker in a pod, removed by one on
// the host's shell.
func (g *Group) escaped() []string {
	if g.v1 == nil {
		return nil
	}
	var out []string
	for _, h := range escapable() {
		if _, ok := g.v1[h]; !ok {
			out = append(out, filepath.Join(Root, h, g.parent, g.name))
		}
	}
	return out
}

// rmdir removes a group's directory, and its parent with its last group.
func rmdir(d string) error {
	// A just-killed task may linger a moment: on a loaded host, a
	// SCHED_IDLE one was seen to for over 4 s (every CPU busy at normal
	// priority), so a group is given 10 s before its removal fails.
	var err error
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if err = os.Remove(d); err == nil || errors.Is(err, os.ErrNotExist) {
			os.Remove(filepath.Dir(d))
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
	}
}

// AllowDevices holds the group's v1 devices controller, where the host
// mounts one, to deny and then allow (its lines, as devices.deny and
// devices.allow take them). The cgroup2 side is a BPF program the
// caller attaches at Path.
func (g *Group) AllowDevices(deny string, allow []string) error {
	d, ok := g.v1["devices"]
	if !ok {
		return nil
	}
	if err := write(d, "devices.deny", deny); err != nil {
		return err
	}
	for _, a := range allow {
		if err := write(d, "devices.allow", a); err != nil {
			return err
		}
	}
	return nil
}

// Limits reads the group's memory and pids limits back from the
// kernel (0: none).
func (g *Group) Limits() (memory, pids int64) { return g.m.limits(g) }

// SetLimits changes the group's limits while its processes run (a zero
// field leaves that limit as it is; Idle cannot change).
func (g *Group) SetLimits(l Limits) error { return g.limit(l) }

// CPUUsage is the CPU time the group's processes used, from the cgroup2
// directory's cpu.stat (kept with or without the cpu controller).
func (g *Group) CPUUsage() (time.Duration, error) {
	b, err := os.ReadFile(filepath.Join(g.v2, "cpu.stat"))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "usage_usec "); ok {
			us, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return time.Duration(us) * time.Microsecond, err
		}
	}
	return 0, fmt.Errorf("cgroup %s: no usage_usec in cpu.stat", g.name)
}

// Reclaim takes back what memory of the group the kernel can: its page
// cache (clean pages go, dirty ones are written first) and, on v2 with
// swap, cold anonymous memory.
func (g *Group) Reclaim() error { return g.m.reclaim(g) }
