package runtime

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/layer/lazy"
	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/runtime/disk"
	"github.com/dsec-project/dsec/internal/runtime/driver"
)

// A sandbox's lifecycle once made: pause and resume, stop and start,
// removal.

// Pause freezes every process of a running sandbox where it is, its
// memory kept (what the kernel can take of it, its page cache, taken
// back now), until Resume: it uses no CPU meanwhile and runs no exec.
// A paused sandbox stays so across worker restarts.
func (sb *Sandbox) Pause() error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.pause()
}

// pause is Pause; sb.mu is held.
func (sb *Sandbox) pause() error {
	switch {
	case sb.Status != Running || sb.g == nil:
		return fmt.Errorf("sandbox %s is %s: only a running sandbox pauses: %w", sb.Name, sb.Status, errdefs.ErrFailedPrecondition)
	case sb.Paused && sb.Hinted: // frozen by a hint: paused now, until resumed
		sb.Hinted = false
		return sb.save()
	case sb.Paused:
		return fmt.Errorf("sandbox %s is paused already: %w", sb.Name, ErrPaused)
	}
	if err := sb.g.Freeze(); err != nil {
		return fmt.Errorf("pause sandbox %s: %w", sb.Name, err)
	}
	sb.Paused, sb.PausedAt = true, time.Now().UTC()
	if err := sb.save(); err != nil {
		sb.Paused = false
		sb.g.Thaw()
		return err
	}
	if err := sb.g.Reclaim(); err == nil {
		sb.reclaimed = time.Now().UTC()
	}
	return nil
}

// IdleReport is what an idle hint did: the memory charged to the
// sandbox before and after.
type IdleReport struct {
	Before, After int64
	Paused        bool
}

// Hint takes the caller's hint that the sandbox waits (for a model's
// next turn) about expected: one expected to wait at least minWait is
// paused, its page cache and (with swap, a compressed tier) cold memory
// given back to the host, until its next exec resumes it (Run). A
// shorter wait is not worth the resume: nothing is done.
func (sb *Sandbox) Hint(ctx context.Context, expected, minWait time.Duration) (IdleReport, error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	var r IdleReport
	if sb.Status != Running || sb.g == nil {
		return r, fmt.Errorf("sandbox %s is %s: an idle hint is for a running sandbox: %w", sb.Name, sb.Status, errdefs.ErrFailedPrecondition)
	}
	r.Before, _ = sb.g.MemoryCharged()
	if sb.Paused || expected < minWait {
		// (Paused already, or too short a wait to be worth a resume.
		// Commands running, an agent's server or interpreter, freeze
		// with the rest.)
		r.After, r.Paused = r.Before, sb.Paused
		return r, nil
	}
	sb.squeeze(ctx)
	if err := sb.pause(); err != nil {
		sb.unsqueeze(ctx)
		return r, err
	}
	sb.Hinted = true
	if err := sb.save(); err != nil {
		return r, err
	}
	r.After, _ = sb.g.MemoryCharged()
	r.Paused = true
	return r, nil
}

// squeeze has a guest's balloon take what the guest does not use (its
// caches, its free memory), before it is frozen; sb.mu is held. A
// container, or a guest that does not answer in time, is left as it is.
func (sb *Sandbox) squeeze(ctx context.Context) {
	b, ok := sb.c.(driver.Ballooner)
	m, ok2 := sb.c.(driver.MemoryReporter)
	if !ok || !ok2 {
		return
	}
	mem, err := m.Memory(ctx)
	if err != nil {
		return
	}
	used := mem.Total - mem.Available
	target := used + max(used/8, 32<<20)
	if target >= mem.Total {
		return
	}
	if b.Balloon(ctx, target) != nil {
		return
	}
	sb.Ballooned = true
	// The guest gives its pages up as it runs (slowly on a loaded host,
	// or under TCG): wait while it does, up to a bound, and not past 2 s
	// in which it gave up nothing.
	last, moved := cmp.Or(mem.Actual, mem.Total), time.Now() // the measure the loop reads
	for start := time.Now(); time.Since(start) < 20*time.Second && time.Since(moved) < 2*time.Second; time.Sleep(100 * time.Millisecond) {
		now, err := m.Memory(ctx)
		if err != nil {
			continue
		}
		has := now.Actual
		if has <= 0 { // an older shim: the guest's own figure, polled every 2 s
			has = now.Total
		}
		if has <= target+16<<20 {
			return
		}
		if has < last {
			last, moved = has, time.Now()
		}
	}
}

// unsqueeze gives a guest its memory back; sb.mu is held.
func (sb *Sandbox) unsqueeze(ctx context.Context) {
	if !sb.Ballooned {
		return
	}
	if b, ok := sb.c.(driver.Ballooner); ok && b.Balloon(ctx, 0) == nil {
		sb.Ballooned = false
	}
}

// wake resumes a sandbox an idle hint paused, for an exec.
func (sb *Sandbox) wake(ctx context.Context) error {
	sb.mu.Lock()
	idle := sb.Paused && sb.Hinted
	sb.mu.Unlock()
	if !idle {
		return nil
	}
	if err := sb.Resume(ctx); err != nil && !errors.Is(err, errdefs.ErrFailedPrecondition) {
		return err
	}
	return nil
}

// wakeGuest resumes a sandbox an idle hint paused whose guest holds its
// files (a microVM's), for what reads them; a container's are read as
// they are, frozen.
func (sb *Sandbox) wakeGuest(ctx context.Context) error {
	if _, guest := sb.d.(driver.UpperHolder); !guest {
		return nil
	}
	return sb.wake(ctx)
}

// Hold freezes a running sandbox's processes where they are, as Pause
// does, without pausing it: its state says running, an exec waits, and
// Unhold lets it go on. The worker holds batch sandboxes while the host
// is short of memory; a stop and start lets go of a hold too.
func (sb *Sandbox) Hold() error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.Status != Running || sb.g == nil {
		return fmt.Errorf("sandbox %s is %s: only a running sandbox is held: %w", sb.Name, sb.Status, errdefs.ErrFailedPrecondition)
	}
	return sb.g.Freeze()
}

// Unhold lets a held sandbox run on; a paused one stays frozen.
func (sb *Sandbox) Unhold() error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.Paused || sb.g == nil {
		return nil
	}
	return sb.g.Thaw()
}

// Held says whether the sandbox's processes are frozen (held or
// paused); live whether it runs, with a group to freeze.
func (sb *Sandbox) Held() (held, live bool) {
	sb.mu.Lock()
	g := sb.g
	sb.mu.Unlock()
	if g == nil {
		return false, false
	}
	return g.Frozen(), true
}

// PauseWarm pauses a sandbox made ahead of need (primed, or a FnCall
// pool's) if its backend's wait so (a microVM's guest); others run on.
func (sb *Sandbox) PauseWarm() error {
	if _, ok := sb.d.(driver.WarmPauser); !ok {
		return nil
	}
	return sb.Pause()
}

// ResumeWarm resumes a sandbox PauseWarm paused, as it is taken (a
// warm one is never evicted).
func (sb *Sandbox) ResumeWarm() error {
	sb.mu.Lock()
	paused := sb.Paused
	sb.mu.Unlock()
	if !paused {
		return nil
	}
	return sb.Resume(context.Background())
}

// ErrPaused says a sandbox is paused (errdefs.ErrFailedPrecondition).
var ErrPaused = fmt.Errorf("paused: %w", errdefs.ErrFailedPrecondition)

// Resume lets a paused sandbox's processes run on: an evicted one's
// guest is restored from its directory first.
func (sb *Sandbox) Resume(ctx context.Context) error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if !sb.Paused {
		return fmt.Errorf("sandbox %s is not paused: %w", sb.Name, errdefs.ErrFailedPrecondition)
	}
	if sb.Saved != nil {
		return sb.resumeSaved(ctx)
	}
	if sb.g != nil {
		if err := sb.g.Thaw(); err != nil {
			return fmt.Errorf("resume sandbox %s: %w", sb.Name, err)
		}
	}
	sb.Paused, sb.Hinted = false, false
	if sb.c == nil { // paused when this worker found it: attached now
		if err := sb.attach(ctx); err != nil {
			return fmt.Errorf("sandbox %s: %w", sb.Name, err)
		}
		if sb.c == nil {
			sb.Status = Dead
		}
		sb.journal().Recover(sb.c)
	}
	sb.unsqueeze(ctx)
	return sb.save()
}

// Stop kills every process of the sandbox and unmounts its root; its
// files (the upper) stay for Start.
func (sb *Sandbox) Stop() error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.Status == Stopped {
		return nil
	}
	if err := sb.teardown(false); err != nil {
		return err
	}
	sb.dropSaved() // its disk is as the guest froze it: it starts on that
	sb.Status, sb.Pid, sb.Paused, sb.Hinted = Stopped, 0, false, false
	return sb.save()
}

// Start starts a stopped (or dead) sandbox again on its files.
func (sb *Sandbox) Start(ctx context.Context) (err error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.Status == Running {
		return fmt.Errorf("sandbox %s is already running: %w", sb.Name, errdefs.ErrFailedPrecondition)
	}
	if sb.Status == Dead {
		if err := sb.teardown(false); err != nil {
			return err
		}
	}
	if err := sb.start(ctx); err != nil {
		sb.teardown(false)
		sb.Status, sb.Pid = Stopped, 0
		sb.save()
		return err
	}
	return nil
}

// Remove stops every process of the sandbox and removes its mounts,
// cgroup, files and state.
func (sb *Sandbox) Remove() error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.teardown(true)
}

// teardown kills the processes, removes the cgroup, unmounts the root
// and the layers, and with all removes the directory too.
func (sb *Sandbox) teardown(all bool) error {
	var errs []error
	if sb.d == nil {
		return fmt.Errorf("sandbox %s: unknown backend %q: a newer dsec's to take down: %w", sb.Name, sb.Backend, errdefs.ErrNotImplemented)
	}
	sb.dropPrestarted()
	if sb.Paused && sb.g != nil { // killed running: a frozen task may not die
		sb.g.Thaw()
	}
	errs = sb.teardownInstance(!all)
	if err := sb.host.Lowers().Release(sb.lowerUser()); err != nil {
		errs = append(errs, err)
	}
	// Sandboxes made before layer mounts were shared mounted their own.
	old, _ := filepath.Glob(filepath.Join(sb.dir, "layers", "*"))
	for _, m := range old {
		if err := lazy.Unmount(m); err != nil && !mount.IsNotMounted(err) {
			errs = append(errs, err)
		}
	}
	if err := os.RemoveAll(filepath.Join(sb.work(), "work")); err != nil {
		errs = append(errs, err)
	}
	if all && len(errs) == 0 {
		if err := disk.Unmount(sb.dir); err != nil {
			errs = append(errs, err)
		}
		if sb.UpperFS != "" {
			if err := disk.RemoveUpper(sb.root(), sb.UpperFS); err != nil {
				errs = append(errs, err)
			} else {
				sb.UpperFS = "" // a second removal mounts nothing
			}
		}
	}
	if all && len(errs) == 0 {
		if err := os.RemoveAll(sb.dir); err != nil {
			errs = append(errs, err)
		} else if sb.Name != "" { // the name is free once all is gone
			if err := dropName(sb.root(), sb.Name, sb.ID); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}
