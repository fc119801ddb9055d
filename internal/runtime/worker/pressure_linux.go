package worker

import (
	"context"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
)

// pressureLoop makes paused microVMs and batch sandboxes give way under
// memory pressure (PSI: the host's, or all sandboxes' together): paused
// microVMs are evicted, one each half second while it holds, their
// guests saved to disk; batch sandboxes' memory is reclaimed, then, if
// the pressure holds, they are frozen until it has passed; latency
// sandboxes are never frozen. Past that, at the host's
// bound, the kernel kills batch commands first (their oom scores).
func (w *worker) pressureLoop(ctx context.Context) {
	limit := w.cfg.Reclaim.withDefaults().Pressure
	if limit < 0 {
		return
	}
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	reclaimed, calm := false, 0
	thaw := func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		for sb := range w.frozen {
			if sb.Current().Paused { // paused since: it stays frozen
				continue
			}
			if err := sb.Unhold(); err != nil {
				w.log.Error("cannot thaw a batch sandbox", "sandbox", sb.Name, "err", err)
				continue
			}
			w.log.Info("thawed a batch sandbox: the memory pressure passed", "sandbox", sb.Name)
		}
		clear(w.frozen)
	}
	defer thaw()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		p := w.hostPressure()
		if p < limit {
			if calm++; calm >= 4 && p < limit/2 { // 2 s calm
				thaw()
				reclaimed, calm = false, 0
			}
			continue
		}
		calm = 0
		// A paused microVM's memory is the cheapest to give back: its
		// guest is saved to disk, and restored when it resumes.
		if e := w.pausedVM(); e != nil {
			e.op.Lock()
			err := w.evict(ctx, e)
			e.op.Unlock()
			if err != nil {
				w.mu.Lock()
				e.evictFailed = time.Now()
				w.mu.Unlock()
				w.log.Error("cannot evict a paused microVM under memory pressure", "sandbox", e.sb.Name, "err", err)
			}
		}
		for _, sb := range w.batchSandboxes() {
			switch held, live := sb.Held(); {
			case !live || w.pressureFrozen(sb) && held: // (a stop and start thaws it)
			case !reclaimed:
				sb.Reclaim()
			default:
				if err := sb.Hold(); err != nil {
					w.log.Error("cannot freeze a batch sandbox under memory pressure", "sandbox", sb.Name, "err", err)
					continue
				}
				w.mu.Lock()
				w.frozen[sb] = true
				w.mu.Unlock()
				w.log.Warn("froze a batch sandbox under memory pressure", "sandbox", sb.Name, "pressure", p)
			}
		}
		if !reclaimed {
			reclaimed = true
			w.log.Info("reclaimed batch sandboxes' memory under memory pressure", "pressure", p)
		}
	}
}

// pressureFrozen reports whether the pressure loop froze sb.
func (w *worker) pressureFrozen(sb *runtime.Sandbox) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.frozen[sb]
}

// hostPressure is the larger of the host's memory pressure and all
// sandboxes' together (percent of the last 10 s stalled on memory).
func (w *worker) hostPressure() float64 {
	host, _ := cgroup.Pressure("/proc/pressure/memory")
	sbs, _ := w.host.Groups().ParentPressure()
	return max(host, sbs)
}

// pausedVM is a microVM a user paused that is not evicted yet (nil:
// none), the one paused longest ago.
func (w *worker) pausedVM() *entry {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out *entry
	var at time.Time
	for _, e := range w.sandboxes {
		if e.sb == nil || e.purpose != forUser || time.Since(e.evictFailed) < time.Minute { // one that failed is let be a while
			continue
		}
		st := e.sb.Current()
		if st.Status != runtime.Running || !st.Paused || st.Saved != nil || !e.sb.Evictable() {
			continue
		}
		if t := st.PausedAt; out == nil || t.Before(at) {
			out, at = e, t
		}
	}
	return out
}

// batchSandboxes are the running sandboxes of class batch.
func (w *worker) batchSandboxes() []*runtime.Sandbox {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []*runtime.Sandbox
	for _, e := range w.sandboxes {
		if e.sb != nil {
			if st := e.sb.Current(); st.Status == runtime.Running && !st.Paused && st.Class == api.SchedBatch {
				out = append(out, e.sb)
			}
		}
	}
	return out
}
