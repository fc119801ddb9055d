package worker

import (
	"github.com/containerd/errdefs"
	"time"

	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/disk"
)

// adopt takes over the sandboxes an earlier worker left.
func (w *worker) adopt() error {
	names, err := runtime.List(w.cfg.Root)
	if err != nil {
		return err
	}
	var live []string   // the IDs of what may still stand on layers
	var groups []string // the groups of the sandboxes kept
	var uppers []string // the uppers of the sandboxes kept
	unknown := false    // a sandbox whose group is unknown
	for _, name := range names {
		sb, err := w.host.Load(name)
		if errdefs.IsNotFound(err) {
			w.log.Info("removed a sandbox a worker died creating", "sandbox", name)
			continue
		}
		if err != nil {
			live, unknown = append(live, runtime.IDOf(w.cfg.Root, name)), true
			w.log.Error("cannot adopt sandbox", "sandbox", name, "err", err)
			continue
		}
		st := sb.Current()
		groups = append(groups, st.CgroupName)
		if st.Pool != "" { // a warm sandbox (or one a call had): made again
			if err := sb.Remove(); err != nil {
				live, uppers = append(live, st.ID), append(uppers, st.UpperFS)
				w.log.Error("cannot remove a pool's sandbox", "sandbox", name, "err", err)
			}
			continue
		}
		live, uppers = append(live, st.ID), append(uppers, st.UpperFS)
		w.log.Info("adopted sandbox", "sandbox", name, "status", st.Status)
		e := &entry{sb: sb, req: request{CPU: st.CPURequest, Memory: st.MemoryRequest}, owner: st.Owner, spec: specOf(st)}
		if st.Status == runtime.Running {
			w.gate.hold(e.req)
			e.held = true
		}
		w.sandboxes[name] = e
	}
	if err := w.host.SweepUnnamed(); err != nil {
		w.log.Error("cannot remove the primed or half-made sandboxes of a worker that died", "err", err)
	}
	if err := w.host.Lowers().Sweep(live); err != nil {
		w.log.Error("cannot release the layers of sandboxes a worker died making", "err", err)
	}
	if err := w.host.SweepSpares(groups, unknown); err != nil {
		w.log.Error("cannot remove the spare inits of a worker that died", "err", err)
	}
	if !unknown {
		if err := disk.SweepUppers(w.cfg.Root, uppers); err != nil {
			w.log.Error("cannot remove the uppers of sandboxes a worker died making", "err", err)
		}
	}
	if n, b := w.host.Store.SweepPartials(stalePartial); n > 0 {
		w.log.Info("removed what interrupted pulls kept, untouched for a day", "pulls", n, "bytes", b)
	}
	return nil
}

// stalePartial is how long what an interrupted pull kept waits for a
// pull to take it up before a worker that starts removes it.
const stalePartial = 24 * time.Hour

// release lets go of every sandbox; they run on.
func (w *worker) release() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, e := range w.sandboxes {
		if e.sb != nil {
			e.sb.Close()
		}
	}
}
