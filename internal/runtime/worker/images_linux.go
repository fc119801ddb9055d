package worker

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer/image"
	"github.com/dsec-project/dsec/internal/runtime/lower"
)

// withImage stacks the layers of the image a create names under its
// own and takes the image's environment and working directory as
// defaults. An image the store lacks is imported first (unless the
// spec's pull is never; with always, its tag is resolved again at every
// create): before the admission gate, so an import holds no other
// create back, and once for concurrent creates on one image
// (image.Import).
//
// A tenant's create imports without the worker's credentials (the
// admin's private images are the admin's to import) and never from a
// registry on the worker's own host or a private network (the worker
// would fetch from where only it can reach); an image the admin
// imported, it uses as it uses the admin's layers.
func (w *worker) withImage(ctx context.Context, spec *api.SandboxSpec) error {
	if spec.Image == "" {
		return nil
	}
	if spec.Snapshot != "" {
		return fmt.Errorf("a sandbox starts on a snapshot or on an image, not both: %w", errdefs.ErrInvalidArgument)
	}
	if err := api.CheckPull(spec.Pull); err != nil { // before it decides anything
		return err
	}
	ref, err := image.ParseReference(spec.Image)
	if err != nil {
		return err
	}
	// always: the tag is resolved at the registry whatever is held (the
	// import fetches nothing while it names the record held, here or, by
	// the record taken from it, on the remote).
	var img *image.Image
	platform := w.cfg.Registries.Target()
	other := ""
	if spec.Pull == api.PullAlways {
		if _, err := w.record(ctx, ref); err != nil && !errdefs.IsNotFound(err) {
			return err
		}
	} else {
		if img, err = w.heldImage(ctx, ref); err != nil && !errdefs.IsNotFound(err) {
			return err
		}
		// An image held for another platform (pulled with --platform)
		// is not this host's: missing, as docker run takes it.
		if img != nil && img.Platform != platform.String() {
			img, other = nil, img.Platform
		}
	}
	if img == nil {
		if spec.Pull == api.PullNever && other != "" {
			return fmt.Errorf("image %s is held for %s, not for this host's %s, and its pull is never: pull it for this host (dsec image pull %s --platform %s): %w",
				ref, other, platform, ref, platform, errdefs.ErrNotFound)
		}
		if spec.Pull == api.PullNever {
			return fmt.Errorf("image %s is not in the store or the shared remote, and its pull is never: import it first (dsec image pull %s), or let the create fetch it (pull missing, the default): %w",
				ref, ref, errdefs.ErrNotFound)
		}
		if img, err = w.importImage(ctx, ref); err != nil {
			return err
		}
	}
	spec.Layers = append(spec.Layers, img.Refs()...)
	spec.Image = img.Reference
	spec.Env = mergeEnv(img.Config.Env, spec.Env)
	if spec.Workdir == "" {
		spec.Workdir = img.Config.WorkingDir
	}
	if spec.User == "" {
		spec.User = img.Config.User
	}
	return nil
}

// heldImage is ref's image as the store holds it or, when another host
// imported it and pushed it to the shared remote, as the remote does:
// its record comes here, its layers stay there (mounted lazily). Not
// found: neither holds it whole.
func (w *worker) heldImage(ctx context.Context, ref image.Reference) (*image.Image, error) {
	img, err := w.record(ctx, ref)
	if err != nil {
		return nil, err
	}
	if !w.whole(ctx, img) {
		return nil, fmt.Errorf("%s: a layer of the image left the store: %w", ref, errdefs.ErrNotFound)
	}
	return img, nil
}

// record is ref's image record as the store holds it, taken from the
// shared remote first if only the remote does.
func (w *worker) record(ctx context.Context, ref image.Reference) (*image.Image, error) {
	img, err := image.Lookup(ctx, w.host.Store, ref)
	if errdefs.IsNotFound(err) && w.host.Remote != nil {
		if img, err = image.Fetch(ctx, w.host.Remote, w.host.Store, ref); err == nil {
			w.log.Info("took the image's record from the remote", "image", img.Reference, "remote", w.host.Remote)
		}
	}
	return img, err
}

// whole says whether every layer of img is as imported, in the store
// or on the remote (a layer rm, or a pull that moved another tag, may
// have taken one).
func (w *worker) whole(ctx context.Context, img *image.Image) bool {
	for _, l := range img.Layers {
		f, err := lower.Resolve(ctx, "", w.host.Source(), l.Ref, "")
		if err != nil || f.Digest != l.Digest.String() {
			return false
		}
	}
	return true
}

// What a tenant's import may take: it fetches and writes for the
// worker, before any quota of its own counts.
var tenantImport = image.Limits{Compressed: 8 << 30, Bytes: 32 << 30, Entries: 2 << 20}

// importTimeout bounds an import a create waits for.
const importTimeout = 30 * time.Minute

// importImage pulls an image a create names.
func (w *worker) importImage(ctx context.Context, ref image.Reference) (*image.Image, error) {
	o := w.cfg.Registries
	tenant := !w.scopeOf(ctx).admin()
	if tenant {
		if err := publicRegistry(ref); err != nil {
			return nil, err
		}
		o.Anonymous, o.PublicOnly, o.Username, o.Password = true, true, "", ""
		o.Limits, o.NoResume = tenantImport, true
	}
	if err := w.cfg.Admission.checkDisk(w.cfg.Root); err != nil {
		return nil, err
	}
	o.Progress, o.Whole = nil, w.whole
	t0 := time.Now()
	// The pull outlives a create that gives up, bounded: another create
	// may be waiting on it (single flight), and what it fetched is kept.
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), importTimeout)
	defer cancel()
	select {
	case w.imports <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	img, err := image.Import(pctx, w.host.Store, ref, o)
	<-w.imports
	if tenant && errdefs.IsPermissionDenied(err) && !strings.Contains(err.Error(), "public") {
		return nil, fmt.Errorf("image %s is not in the store, and its registry refuses an anonymous pull: ask the worker's admin to dsec image pull it: %w", ref, errdefs.ErrPermissionDenied)
	}
	if err != nil {
		return nil, err
	}
	if img.Joined {
		w.log.Info("joined another create's import of the image", "image", img.Reference, "took", time.Since(t0))
		return img, nil
	}
	w.log.Info("imported image", "image", img.Reference, "from", img.From, "layers", len(img.Layers), "fetched", img.Fetched,
		"reused", img.Reused, "resumed_bytes", img.Resumed, "took", time.Since(t0))
	return img, nil
}

// publicRegistry refuses, for a tenant, a registry named by an address
// on the worker's host (the pull's dialer refuses every address that is
// not public, whatever name resolves to it: this is the early word).
func publicRegistry(ref image.Reference) error {
	if ref.Loopback() {
		return fmt.Errorf("image %s is not in the store, and a token imports only from public registries: ask the worker's admin to dsec image pull it: %w",
			ref, errdefs.ErrPermissionDenied)
	}
	return nil
}

// mergeEnv is base with over's variables set over it.
func mergeEnv(base, over []string) []string {
	if len(base) == 0 {
		return over
	}
	out := make([]string, 0, len(base)+len(over))
	set := map[string]bool{}
	for _, kv := range over {
		k, _, _ := strings.Cut(kv, "=")
		set[k] = true
	}
	for _, kv := range base {
		if k, _, _ := strings.Cut(kv, "="); !set[k] {
			out = append(out, kv)
		}
	}
	return append(out, over...)
}
