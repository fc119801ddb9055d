package runtime

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/grade"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/snap"
)

// CarryOptions says what Carry takes of a sandbox for a grade.
type CarryOptions struct {
	Ref          layer.Ref // the carried layer's tag; must be new
	Rules        *grade.Rules
	MaxFileBytes int64
	Limits       snap.Limits
}

// Carried is what Carry made: the layer of what the rules took (over
// Pristine, the sandbox's own layers without its snapshots, topmost
// first), what it left out, and the sandbox's processes then.
type Carried struct {
	Layer    *layer.Info
	Pristine []layer.Lower
	Changes  []snap.Change
	More     int // changes past the report's bound
	Paths    int
	Bytes    int64
	// Processes running in the sandbox besides its init; -1: its
	// guest's own, not counted.
	Processes int
	Frozen    time.Duration
}

// Carry freezes the sandbox and packs what the carry rules take of its
// changes (what it wrote, over the snapshots it was started on, if any)
// into a layer tagged o.Ref over its pristine layers, then thaws it:
// the sandbox runs on unchanged. What the rules leave out is returned,
// to report.
func (sb *Sandbox) Carry(ctx context.Context, o CarryOptions) (*Carried, error) {
	if err := sb.wakeGuest(ctx); err != nil {
		return nil, err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	sb.noteDeath()
	if sb.Status != Running || sb.g == nil {
		return nil, fmt.Errorf("sandbox %s is %s: a grade reads a running sandbox (dsec start %s): %w", sb.Name, sb.Status, sb.Name, errdefs.ErrFailedPrecondition)
	}
	h := sb.host
	pristine, diffs, err := sb.split(ctx)
	if err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp(sb.dir, "grade-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	user := "grade-" + filepath.Base(tmp) + "-" + sb.ID
	defer h.Lowers().Release(user)
	var mnts []string // pristine, topmost first
	for _, lo := range pristine {
		m, _, err := h.Lowers().Acquire(ctx, h.Source(), lo.Ref, user, lo.Digest.String())
		if err != nil {
			return nil, fmt.Errorf("grade %s: its layer %s: %w", sb.Name, lo.Ref, err)
		}
		mnts = append(mnts, m)
	}
	base := mnts[0]
	if len(mnts) > 1 {
		base = filepath.Join(tmp, "base")
		if err := os.Mkdir(base, 0o700); err != nil {
			return nil, err
		}
		if err := mount.Overlay(mnts, "", "").Mount(base); err != nil {
			return nil, fmt.Errorf("grade %s: the view of its layers: %w", sb.Name, err)
		}
		defer mount.Unmount(base)
	}
	upper, release, err := sb.holdUpper(ctx)
	if err != nil {
		return nil, err
	}
	procs := -1
	if _, guest := sb.d.(driver.UpperHolder); !guest {
		if pids, err := sb.g.Pids(); err == nil {
			procs = max(len(pids)-1, 0)
		}
	}
	wasFrozen := sb.g.Frozen()
	if err := sb.g.Freeze(); err != nil {
		release()
		return nil, fmt.Errorf("freeze sandbox %s: %w", sb.Name, err)
	}
	frozen := time.Now()
	thaw := func() error {
		var err error
		if !wasFrozen {
			err = sb.g.Thaw()
		}
		return errors.Join(err, release())
	}
	diff := upper
	if len(diffs) > 0 {
		// The snapshots it stands on, with what it wrote over them, as
		// one diff to read.
		if diff, err = sb.fold(ctx, tmp, user, diffs, upper, base); err != nil {
			return nil, errors.Join(err, thaw())
		}
		defer mount.Unmount(diff)
	}
	out := &Carried{Pristine: pristine, Processes: procs}
	var c *snap.Carried
	info, err := layer.Build(ctx, h.Store, layer.BuildOptions{
		Kind: layer.KindSnapshot, Ref: o.Ref, SourceKind: "grade",
		Snapshot: &layer.Lineage{Lowers: pristine, Sandbox: sb.Name, Env: sb.Env, Workdir: sb.Workdir, User: sb.User},
		Walk: func(ctx context.Context, w *erofs.Writer) error {
			var err error
			c, err = snap.Carry(ctx, w, diff, snap.CarryOptions{Rules: o.Rules, Base: base, MaxFileBytes: o.MaxFileBytes, Limits: o.Limits})
			return err
		},
	})
	if c != nil {
		c.Close()
	}
	terr := thaw()
	out.Frozen = time.Since(frozen)
	if err != nil {
		return nil, fmt.Errorf("grade %s: %w", sb.Name, err)
	}
	if terr != nil {
		layer.Remove(ctx, h.Store, o.Ref.String())
		return nil, fmt.Errorf("thaw sandbox %s after reading it for a grade: %w", sb.Name, terr)
	}
	out.Layer, out.Changes, out.More, out.Paths, out.Bytes = info, c.Changes, c.More, c.Paths, c.Bytes
	return out, nil
}

// split is the sandbox's layers: those it was made of (the pristine
// ones, topmost first) and the snapshots over them (what an agent wrote
// before, bottom first).
func (sb *Sandbox) split(ctx context.Context) (pristine, diffs []layer.Lower, err error) {
	h := sb.host
	for i, ref := range sb.Layers {
		lo := layer.Lower{Ref: ref, Digest: digest.Digest(sb.Digests[i])}
		info, err := layer.Resolve(ctx, h.Store, lo.Digest.String())
		if err != nil {
			return nil, nil, fmt.Errorf("grade %s: its layer %s (%s) is not in the store: %w", sb.Name, ref, lo.Digest, err)
		}
		if info.Kind == layer.KindSnapshot {
			if len(pristine) > 0 {
				return nil, nil, fmt.Errorf("grade %s: snapshot %s lies under a layer it was not taken over: %w", sb.Name, ref, errdefs.ErrFailedPrecondition)
			}
			diffs = append(diffs, lo)
			continue
		}
		pristine = append(pristine, lo)
	}
	if len(pristine) == 0 {
		return nil, nil, fmt.Errorf("grade %s: it stands on no layer but snapshots: %w", sb.Name, errdefs.ErrFailedPrecondition)
	}
	slices.Reverse(diffs)
	return pristine, diffs, nil
}

// fold writes the snapshot diffs (bottom first) and the upper over them
// as one diff image in tmp, mounts it and returns where.
func (sb *Sandbox) fold(ctx context.Context, tmp, user string, diffs []layer.Lower, upper, base string) (string, error) {
	h := sb.host
	var mnts []string
	for _, lo := range diffs {
		m, _, err := h.Lowers().Acquire(ctx, h.Source(), lo.Ref, user, lo.Digest.String())
		if err != nil {
			return "", fmt.Errorf("grade %s: its snapshot %s: %w", sb.Name, lo.Ref, err)
		}
		mnts = append(mnts, m)
	}
	img := filepath.Join(tmp, "diff.erofs")
	f, err := os.OpenFile(img, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return "", err
	}
	defer f.Close()
	w, err := erofs.NewWriter(f)
	if err != nil {
		return "", err
	}
	var packs []*snap.Packed
	defer func() {
		for _, p := range packs {
			p.Close()
		}
	}()
	for _, d := range append(mnts, upper) {
		p, err := snap.Merge(ctx, w, d, base)
		if err != nil {
			return "", fmt.Errorf("grade %s: fold its snapshots: %w", sb.Name, err)
		}
		packs = append(packs, p)
	}
	if _, err := w.Finish(); err != nil {
		return "", fmt.Errorf("grade %s: fold its snapshots: %w", sb.Name, err)
	}
	dir := filepath.Join(tmp, "diff")
	if err := os.Mkdir(dir, 0o700); err != nil {
		return "", err
	}
	if err := mount.EROFS(img).Mount(dir); err != nil {
		return "", fmt.Errorf("grade %s: mount its changes: %w", sb.Name, err)
	}
	return dir, nil
}
