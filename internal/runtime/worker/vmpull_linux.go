package worker

import (
	"context"
	"fmt"
	"syscall"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/runtime/vm"
)

// A worker with a shared remote boots the VM images and full VMs'
// snapshots it holds there but not in its store (another worker built,
// imported or published them): the first create that names one pulls
// it into the store, as dsec vm image pull does, and the creates that
// name it meanwhile wait for that pull (single flight). Its disks are
// left in the remote where their window tables are with them (a dsec of
// this release made them): the guest's reads fetch what they read,
// lazily, as a layer's do (vms.ResolveBase); the record, the tables and
// a memory snapshot's saved guest are pulled. An image without tables
// is pulled whole.

// tenantVMPull bounds what a tenant's create pulls: a VM image's disk
// chain and saved guest, in bytes.
const tenantVMPull = 64 << 30

// remoteVM is the VM image tag on the worker's shared remote; ok is
// false when it has no remote, or the remote holds no VM image of that
// tag (or cannot say).
func (w *worker) remoteVM(ctx context.Context, tag string) (img *vm.Remote, ok bool) {
	if w.host.Remote == nil {
		return nil, false
	}
	r, err := layer.ParseRef(tag)
	if err != nil {
		return nil, false
	}
	img, err = vm.Describe(ctx, w.host.Remote, r)
	return img, err == nil
}

// pullVM makes the VM image tag (a resolved ref, as the sandbox is made
// of) held in the store: pulled from the shared remote when the store
// holds nothing of that tag and the remote holds a VM image of it; a
// tag neither holds is not found. A tenant's pull is bounded
// (tenantVMPull), what failed is told its admin, and what a tag outside
// its namespace names once pulled must still be no snapshot (the
// remote's tag may have moved since its name was resolved).
func (w *worker) pullVM(ctx context.Context, tag string) error {
	s := w.host.Store
	if w.host.Remote == nil || s == nil || layer.IsDigest(tag) {
		return nil
	}
	if _, err := s.Resolve(ctx, tag); err == nil { // a VM image, or a layer the backend refuses
		return nil
	}
	r, err := layer.ParseRef(tag)
	if err != nil {
		return nil
	}
	sc := w.scopeOf(ctx)
	img, err := vm.Describe(ctx, w.host.Remote, r)
	switch {
	case errdefs.IsNotFound(err) || errdefs.IsInvalidArgument(err): // (a layer's tag there, say)
		return fmt.Errorf("no VM image %s in the store or the worker's shared remote (dsec vm image ls lists the store's; dsec vm image build makes one): %w",
			sc.show(tag), errdefs.ErrNotFound)
	case err != nil && sc.admin():
		return fmt.Errorf("VM image %s: the shared remote: %w", tag, err)
	case err != nil:
		w.log.Warn("a tenant's create could not read a VM image from the shared remote", "image", r.String(), "err", err)
		return fmt.Errorf("VM image %s could not be read from the worker's shared remote: ask the worker's admin (its log says why): %w", sc.show(tag), errdefs.ErrUnavailable)
	}
	lazily := img.Image.Lazy()
	if !sc.admin() && img.Bytes > tenantVMPull {
		return fmt.Errorf("VM image %s is %d GiB, more than a tenant's create pulls (%d GiB): ask the worker's admin to dsec vm image pull it: %w",
			sc.show(tag), img.Bytes>>30, tenantVMPull>>30, errdefs.ErrResourceExhausted)
	}
	if err := w.cfg.Admission.checkDisk(w.cfg.Root); err != nil {
		return err
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(w.cfg.Root, &st); err == nil && !lazily && int64(st.Bavail)*int64(st.Bsize) < img.Bytes {
		return fmt.Errorf("VM image %s (%d MiB) does not fit in the %d MiB free under %s: free space (dsec layer gc, remove sandboxes): %w",
			sc.show(tag), img.Bytes>>20, int64(st.Bavail)*int64(st.Bsize)>>20, w.cfg.Root, errdefs.ErrResourceExhausted)
	}
	pull := w.vmPulls.DoChan(r.String(), func() (any, error) {
		if _, err := s.Resolve(context.Background(), r.String()); err == nil { // the flight before took it
			return nil, nil
		}
		// Bounded as an image import is, and as it outlives the create
		// that started it: another may be waiting on it.
		pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), importTimeout)
		defer cancel()
		select {
		case w.imports <- struct{}{}:
		case <-pctx.Done():
			return nil, pctx.Err()
		}
		defer func() { <-w.imports }()
		t0 := time.Now()
		copyVM := func(ctx context.Context, src remote.Target, dst *remote.Dir, r layer.Ref, p remote.Progress) (*remote.Result, error) {
			return vm.Copy(ctx, src, dst, r, false, p)
		}
		if lazily {
			copyVM = vm.CopyLazily
		}
		res, err := copyVM(pctx, w.host.Remote, remote.Local(s), r, nil)
		if err != nil && !errdefs.IsAlreadyExists(err) { // (another pull or build tagged it meanwhile)
			return nil, err
		}
		if err == nil {
			copied, _, bytes := res.Totals()
			w.log.Info("pulled VM image", "image", r.String(), "from", w.host.Remote, "lazily", lazily, "blobs", copied, "bytes", bytes, "took", time.Since(t0))
		}
		return nil, nil
	})
	select {
	case res := <-pull:
		err = res.Err
	case <-ctx.Done(): // the pull goes on for those who wait on it
		return ctx.Err()
	}
	if err != nil {
		if sc.admin() {
			return err
		}
		w.log.Warn("a tenant's create could not pull a VM image from the shared remote", "image", r.String(), "err", err)
		return fmt.Errorf("VM image %s could not be pulled from the worker's shared remote: ask the worker's admin (its log says why): %w", sc.show(tag), errdefs.ErrUnavailable)
	}
	if !sc.admin() && !sc.owns(r.String()) {
		if got, err := vm.Lookup(ctx, s, r.String()); err != nil || got.Sandbox != "" {
			return errNoRef(sc.show(tag))
		}
	}
	return nil
}
