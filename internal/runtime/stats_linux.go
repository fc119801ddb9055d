package runtime

import (
	"context"
	"time"

	"github.com/dsec-project/dsec/internal/runtime/driver"
)

// Stats is what a sandbox uses now, read from its control group, its
// disk and its journal, in the units the API shows.
type Stats struct {
	// Cgroup is the sandbox's group ("": not running).
	Cgroup string
	// Memory charged to the group and its bound; the pids bound is the
	// user's (the init's share left out); CPU time used.
	MemoryBytes, MemoryLimit, PidsLimit int64
	CPUSeconds                          float64
	OOMKills                            int
	Frozen                              bool
	// DiskUsed is what the sandbox wrote; Idle how long no exec ran;
	// Execs the commands its journal holds; Reclaimed when its idle
	// memory was last taken back (zero: never, in this worker).
	DiskUsed  int64
	Idle      time.Duration
	Execs     int
	Reclaimed time.Time
	// GuestMemory and GuestMemoryUsed: a running microVM's memory as its
	// guest last reported it (zero: none).
	GuestMemory, GuestMemoryUsed int64
}

// Stats reads what the sandbox uses now. A microVM's guest is asked for
// its memory within a second.
func (sb *Sandbox) Stats() Stats {
	st := sb.Current()
	out := Stats{DiskUsed: sb.DiskUsed(), Idle: sb.Idle(), Execs: sb.ExecCount(), Reclaimed: sb.Reclaimed()}
	if st.Status != Running {
		return out
	}
	if st.VM != nil && !st.Paused {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		if m := sb.GuestMemory(ctx); m != nil {
			out.GuestMemory, out.GuestMemoryUsed = m.Total, m.Total-m.Available
		}
		cancel()
	}
	if g := sb.Cgroup(); g != nil {
		out.Cgroup = g.Path()
		out.MemoryBytes, _ = g.MemoryCharged()
		out.OOMKills = g.OOMKills()
		out.MemoryLimit, out.PidsLimit = g.Limits()
		out.Frozen = g.Frozen()
		if out.PidsLimit > 0 {
			out.PidsLimit = max(out.PidsLimit-driver.InitPids, 1)
		}
		if used, err := g.CPUUsage(); err == nil {
			out.CPUSeconds = used.Seconds()
		}
	}
	return out
}
