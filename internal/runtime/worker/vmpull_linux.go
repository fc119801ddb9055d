package worker

import (
	"context"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/runtime/vm"
)

// A worker with a shared remote boots the VM images and full VMs'
// snapshots it holds there but not in its store (another worker built,
// imported or published them): the first create that names one pulls
// it whole into the store, as dsec vm image pull does, and the creates
// that name it meanwhile wait for that pull (single flight). A VM's
// disk is not mounted lazily from the remote, as a layer is: it is
// pulled before the VM boots.

// remoteVM is the record of the VM image tag on the worker's shared
// remote; ok is false when it has no remote, or the remote holds no VM
// image of that tag (or cannot say).
func (w *worker) remoteVM(ctx context.Context, tag string) (rec *vm.Record, ok bool) {
	if w.host.Remote == nil {
		return nil, false
	}
	r, err := layer.ParseRef(tag)
	if err != nil {
		return nil, false
	}
	rec, err = vm.Describe(ctx, w.host.Remote, r)
	return rec, err == nil
}

// pullVM makes the VM image tag (a resolved ref, as the sandbox is made
// of) held in the store: pulled from the shared remote when the store
// holds nothing of that tag and the remote holds a VM image of it.
// Otherwise it does nothing, and the backend says what tag is not.
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
	if _, ok := w.remoteVM(ctx, r.String()); !ok {
		return nil
	}
	if err := w.cfg.Admission.checkDisk(w.cfg.Root); err != nil {
		return err
	}
	_, err, _ = w.vmPulls.Do(r.String(), func() (any, error) {
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
		res, err := vm.Copy(pctx, w.host.Remote, remote.Local(s), r, false, nil)
		if err != nil {
			return nil, err
		}
		copied, _, bytes := res.Totals()
		w.log.Info("pulled VM image", "image", r.String(), "from", w.host.Remote, "blobs", copied, "bytes", bytes, "took", time.Since(t0))
		return nil, nil
	})
	if errdefs.IsAlreadyExists(err) { // another pull or build tagged it meanwhile
		return nil
	}
	return err
}
