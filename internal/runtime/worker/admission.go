package worker

import (
	"context"
	"fmt"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"

	"github.com/dsec-project/dsec/internal/runtime/cgroup"
)

// Admission bounds what a worker runs: the requests of its running
// sandboxes against the host times the overcommit ratios, and how many
// sandboxes it makes at once. A creation beyond either waits in a FIFO
// queue (its sandbox shows as queued) until capacity frees or
// QueueTimeout passes.
type Admission struct {
	CPUOvercommit    float64       // admitted CPU requests per host CPU (default 50)
	MemoryOvercommit float64       // admitted memory requests per byte of host memory beyond the reserve (default 1)
	HostReserve      int64         // memory kept for the host (default 1 GiB)
	MaxCreating      int           // sandboxes made at once (default 4)
	QueueTimeout     time.Duration // longest wait in the queue (default 1 minute)
	// Spares: sandbox inits kept started ahead of need, each in its
	// cgroup; a latency-class create takes one instead of starting its
	// own (default 2; negative: none).
	Spares int
	// Primed: sandboxes kept made ahead on the layers of the last
	// create, with the defaults of everything else; a create that asks
	// for just that takes one (default 1; negative: none).
	Primed int
	// DiskFloor: a create is refused while the file system of the root
	// has less free space than this (default 1 GiB; negative: none),
	// or fewer free inodes than InodeFloor (default 10000).
	DiskFloor  int64
	InodeFloor int64
	// UppersSize is the size of the file system all sandboxes without a
	// disk quota of their own write to, together (default: the root's
	// file system's free space less 1 GiB when it is first made; an
	// existing one is resized to it when given). Creates are refused
	// while it has less than DiskFloor free, too.
	UppersSize int64
	// WorkerMemoryMin and WorkerMemoryLow protect the worker's and its
	// fetchers' memory on a host whose memory controller is on cgroup2:
	// the worker moves into a group of its own beside the sandboxes'
	// (cgroup.WorkerGroup), with memory.min and memory.low set (defaults
	// 128 MiB and 512 MiB; negative: off, both: the worker stays in the
	// group it was started in). They come out of HostReserve: the
	// defaults are cut to fit it, a setting beyond it is refused.
	WorkerMemoryMin, WorkerMemoryLow int64
}

// maxSpares bounds Admission.Spares: each spare is a process and a
// cgroup; a burst beyond them starts its own inits.
const maxSpares = 256

// maxPrimed bounds Admission.Primed: each is a sandbox's mounts and
// init, and all are made again when a create asks for other layers.
const maxPrimed = 16

// withDefaults fills what is zero.
func (a Admission) withDefaults() Admission {
	if a.CPUOvercommit == 0 {
		a.CPUOvercommit = 50
	}
	if a.MemoryOvercommit == 0 {
		a.MemoryOvercommit = 1
	}
	if a.HostReserve == 0 {
		a.HostReserve = 1 << 30
	}
	if a.MaxCreating == 0 {
		a.MaxCreating = 4
	}
	if a.QueueTimeout == 0 {
		a.QueueTimeout = time.Minute
	}
	if a.Spares == 0 {
		a.Spares = 2
	}
	if a.Primed == 0 {
		a.Primed = 1
	}
	if a.DiskFloor == 0 {
		a.DiskFloor = 1 << 30
	}
	if a.InodeFloor == 0 {
		a.InodeFloor = 10000
	}
	// The protection's defaults fit within the reserve, and low holds
	// an explicit min.
	if a.WorkerMemoryLow == 0 {
		a.WorkerMemoryLow = min(max(512<<20, a.WorkerMemoryMin), a.HostReserve)
	}
	if a.WorkerMemoryMin == 0 {
		a.WorkerMemoryMin = min(128<<20, a.HostReserve)
		if a.WorkerMemoryLow > 0 {
			a.WorkerMemoryMin = min(a.WorkerMemoryMin, a.WorkerMemoryLow)
		}
	}
	return a
}

// protection is the worker's memory protection (cgroup.Protect); ok is
// false when both are off.
func (a Admission) protection() (p cgroup.Protection, ok bool) {
	a = a.withDefaults()
	return cgroup.Protection{Min: max(a.WorkerMemoryMin, 0), Low: max(a.WorkerMemoryLow, 0)}, a.WorkerMemoryMin > 0 || a.WorkerMemoryLow > 0
}

// checkDisk refuses a create while the root's file system is nearly
// full (of bytes or inodes): what the sandboxes there write, their
// journals and the store would fail next, the host's other users too.
func (a Admission) checkDisk(root string) error {
	a = a.withDefaults()
	var st syscall.Statfs_t
	if err := syscall.Statfs(root, &st); err != nil {
		return err
	}
	free, inodes := int64(st.Bavail)*int64(st.Bsize), int64(st.Ffree)
	if a.DiskFloor > 0 && free < a.DiskFloor {
		return fmt.Errorf("the file system of %s has %d MiB free, below admission.disk_floor (%d MiB): free space (dsec layer gc, remove sandboxes) or lower the floor: %w",
			root, free>>20, a.DiskFloor>>20, errdefs.ErrResourceExhausted)
	}
	// Some file systems (btrfs) report no inode counts: nothing to bound.
	if a.InodeFloor > 0 && st.Files > 0 && inodes < a.InodeFloor {
		return fmt.Errorf("the file system of %s has %d inodes free, below admission.inode_floor (%d): remove files (sandboxes, layers) or lower the floor: %w",
			root, inodes, a.InodeFloor, errdefs.ErrResourceExhausted)
	}
	return nil
}

// checkUppers refuses a create while the file system the sandboxes
// write to, size bytes with free of them free, is nearly full.
func (a Admission) checkUppers(dir string, size, free int64) error {
	if a = a.withDefaults(); a.DiskFloor > 0 && size > 0 && free < a.DiskFloor {
		return fmt.Errorf("the file system the sandboxes write to (%s, %d MiB) has %d MiB free, below admission.disk_floor (%d MiB): remove sandboxes or lower the floor: %w",
			dir, size>>20, free>>20, a.DiskFloor>>20, errdefs.ErrResourceExhausted)
	}
	return nil
}

// Validate reports a setting that makes no sense.
func (a Admission) Validate() error {
	if a.CPUOvercommit < 0 || a.MemoryOvercommit < 0 || a.HostReserve < 0 || a.MaxCreating < 0 || a.QueueTimeout < 0 || a.UppersSize < 0 {
		return fmt.Errorf("admission settings must not be negative (%+v): %w", a, errdefs.ErrInvalidArgument)
	}
	if a.Primed > maxPrimed {
		return fmt.Errorf("admission.primed %d: keep at most %d sandboxes made ahead: %w", a.Primed, maxPrimed, errdefs.ErrInvalidArgument)
	}
	if d := a.withDefaults(); d.WorkerMemoryMin > 0 && d.WorkerMemoryLow > 0 && d.WorkerMemoryMin > d.WorkerMemoryLow {
		return fmt.Errorf("admission.worker_memory_min (%d MiB) is more than admission.worker_memory_low (%d MiB): the low protection includes the min; raise low or lower min: %w",
			d.WorkerMemoryMin>>20, d.WorkerMemoryLow>>20, errdefs.ErrInvalidArgument)
	} else if p := max(d.WorkerMemoryMin, d.WorkerMemoryLow); p > d.HostReserve {
		return fmt.Errorf("the worker's protected memory (%d MiB, admission.worker_memory_min/low) is more than admission.host_reserve (%d MiB), which it comes out of: lower it or raise the reserve: %w",
			p>>20, d.HostReserve>>20, errdefs.ErrInvalidArgument)
	}
	if a.Spares > maxSpares {
		return fmt.Errorf("admission.spares %d: keep at most %d inits ahead of need: %w", a.Spares, maxSpares, errdefs.ErrInvalidArgument)
	}
	return nil
}

// request is what a sandbox reserves while it runs.
type request struct {
	CPU    float64
	Memory int64
}

// gate admits creations in order. Capacity is reserved from admission
// until release; a creation slot from admission until created.
type gate struct {
	cfg    Admission
	cpuCap float64 // CPUs of requests
	memCap int64   // bytes of requests

	mu       sync.Mutex
	used     request
	creating int
	queue    []*waiter
}

type waiter struct {
	req   request
	since time.Time     // when it was queued
	ready chan struct{} // closed when admitted
}

// starving says whether the head of the queue has waited so long (half
// the queue's timeout) that nothing may pass it any more; g.mu is held.
// Until then a request that fits goes ahead of one that does not yet:
// one big request never holds up the small ones behind it (issue 29,
// item 12), and is not starved by them either.
func (g *gate) starving() bool {
	return len(g.queue) > 0 && time.Since(g.queue[0].since) > g.cfg.QueueTimeout/2
}

func newGate(cfg Admission, cpus int, memTotal int64) *gate {
	cfg = cfg.withDefaults()
	return &gate{cfg: cfg, cpuCap: float64(cpus) * cfg.CPUOvercommit,
		memCap: int64(float64(max(memTotal-cfg.HostReserve, 0)) * cfg.MemoryOvercommit)}
}

// check refuses a request no amount of waiting would admit.
func (g *gate) check(r request) error {
	if r.CPU > g.cpuCap {
		return fmt.Errorf("the sandbox requests %g CPUs but this host admits %g in all (%d CPUs x admission.cpu_overcommit %g): request less (--cpu-request) or raise the ratio: %w",
			r.CPU, g.cpuCap, int(g.cpuCap/g.cfg.CPUOvercommit), g.cfg.CPUOvercommit, errdefs.ErrOutOfRange)
	}
	if r.Memory > g.memCap {
		return fmt.Errorf("the sandbox requests %d bytes of memory but this host admits %d in all (memory beyond admission.host_reserve x admission.memory_overcommit %g): request less (--memory-request) or raise the ratio: %w",
			r.Memory, g.memCap, g.cfg.MemoryOvercommit, errdefs.ErrOutOfRange)
	}
	return nil
}

// fits says whether r can be admitted now; g.mu is held.
func (g *gate) fits(r request) bool {
	return g.creating < g.cfg.MaxCreating && g.used.CPU+r.CPU <= g.cpuCap+1e-9 && g.used.Memory+r.Memory <= g.memCap
}

// admit waits until r is admitted (queued calls queued first, if given,
// when it has to wait), reserving its capacity and a creation slot.
func (g *gate) admit(ctx context.Context, r request, queued func()) error {
	if err := g.check(r); err != nil {
		return err
	}
	g.mu.Lock()
	if !g.starving() && g.fits(r) {
		g.take(r)
		g.mu.Unlock()
		return nil
	}
	w := &waiter{req: r, since: time.Now(), ready: make(chan struct{})}
	g.queue = append(g.queue, w)
	g.mu.Unlock()
	if queued != nil {
		queued()
	}
	t := time.NewTimer(g.cfg.QueueTimeout)
	defer t.Stop()
	select {
	case <-w.ready:
		return nil
	case <-ctx.Done():
	case <-t.C:
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-w.ready: // admitted meanwhile: it is ours
		return nil
	default:
	}
	for i, q := range g.queue {
		if q == w {
			g.queue = append(g.queue[:i], g.queue[i+1:]...)
			break
		}
	}
	g.wake() // who was behind it may fit now
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return fmt.Errorf("queued for %v and the host is still at capacity (%s): retry later, remove sandboxes, or raise admission.queue_timeout: %w",
		g.cfg.QueueTimeout, g.usage(), errdefs.ErrResourceExhausted)
}

// take reserves r; g.mu is held.
func (g *gate) take(r request) {
	g.used.CPU += r.CPU
	g.used.Memory += r.Memory
	g.creating++
}

// wake admits waiters in queue order, each that fits (only the head
// once it is starving); g.mu is held.
func (g *gate) wake() {
	for i := 0; i < len(g.queue); {
		if i > 0 && g.starving() {
			return
		}
		w := g.queue[i]
		if !g.fits(w.req) {
			i++
			continue
		}
		g.queue = append(g.queue[:i], g.queue[i+1:]...)
		g.take(w.req)
		close(w.ready)
	}
}

// created frees an admitted creation's slot (its capacity stays).
func (g *gate) created() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.creating--
	g.wake()
}

// release frees a sandbox's capacity: removed, stopped, or failed to
// make (then call created too).
func (g *gate) release(r request) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.used.CPU -= r.CPU
	g.used.Memory -= r.Memory
	g.wake()
}

// hold counts a sandbox already running (one a restarted worker adopts),
// at capacity or not.
func (g *gate) hold(r request) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.used.CPU += r.CPU
	g.used.Memory += r.Memory
}

// capacity is what g admits and holds now.
func (g *gate) capacity() api.Capacity {
	g.mu.Lock()
	defer g.mu.Unlock()
	return api.Capacity{CPURequests: g.cpuCap, CPURequestsUsed: g.used.CPU, MemoryRequests: g.memCap, MemoryRequestsUsed: g.used.Memory,
		Queued: len(g.queue)}
}

// usage describes what is admitted; g.mu is held.
func (g *gate) usage() string {
	return fmt.Sprintf("CPU requests %g of %g, memory requests %d of %d bytes, %d queued, %d being made",
		g.used.CPU, g.cpuCap, g.used.Memory, g.memCap, len(g.queue), g.creating)
}
