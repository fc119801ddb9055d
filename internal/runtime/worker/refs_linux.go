package worker

import (
	"context"
	"fmt"
	"slices"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/runtime/lower"
	"github.com/dsec-project/dsec/internal/runtime/vm"
	"github.com/dsec-project/dsec/internal/tenant"
)

// What a request may name in the store. The admin (the unix socket, an
// admin token) names any tag or digest. A token of scope sandboxes (a
// tenant) names the layers the admin built or pulled (any tag outside
// the tenants' namespaces whose layer is not a snapshot) and its own
// snapshots, by their tags in its namespace (package tenant) or by
// digest; everything else, another tenant's snapshot, an admin's
// snapshot, a tag or digest that names nothing, gets one answer,
// errNoRef's, which says nothing of whether it exists. Every ref a
// tenant sends that comes to name a layer (a create's layers and
// snapshot, a branch's, a call's) is resolved here, once, into the
// store's tag or full digest the sandbox is then made of.

// scope is what the caller of a request may name.
type scope struct {
	w  *worker
	ns tenant.Namespace // "": the admin
}

func (w *worker) scopeOf(ctx context.Context) scope {
	if t := tokenOf(ctx); t != nil && t.Scope != auth.Admin {
		return scope{w: w, ns: tenant.Of(t.ID)}
	}
	return scope{w: w}
}

func (s scope) admin() bool { return s.ns == "" }

// errNoRef is a tenant's answer for every ref it may not or cannot
// name, whatever the reason.
func errNoRef(ref string) error {
	return fmt.Errorf("no layer or snapshot %s: %w", ref, errdefs.ErrNotFound)
}

// layer resolves a ref the caller names among a sandbox's layers into
// the ref the sandbox is made of: the tenant's own snapshot's tag, the
// admin's layer's, or a layer's full digest.
func (s scope) layer(ctx context.Context, ref string) (string, error) {
	if s.admin() {
		return ref, nil
	}
	if layer.IsDigest(ref) {
		return s.digest(ctx, ref, false)
	}
	r, err := layer.ParseRef(ref)
	if err != nil {
		return "", err
	}
	own, err := s.ns.Tag(r.String())
	if err != nil { // another's namespace
		return "", errNoRef(ref)
	}
	// The local store first, its own tag (a layer snapshot, or a VM
	// snapshot a vm sandbox boots) before the admin's: a create on the
	// admin's layers asks the remote nothing more than before.
	if _, err := layer.Resolve(ctx, s.w.host.Store, own); err == nil {
		return own, nil
	}
	if _, err := vm.Lookup(ctx, s.w.host.Store, own); err == nil {
		return own, nil
	}
	if img, err := vm.Lookup(ctx, s.w.host.Store, r.String()); err == nil && own != r.String() {
		if img.Sandbox != "" { // the admin's snapshot, or a tenant's under another name
			return "", errNoRef(ref)
		}
		return r.String(), nil
	}
	if i, err := layer.Resolve(ctx, s.w.host.Store, r.String()); err == nil && own != r.String() {
		if i.Kind == layer.KindSnapshot { // the admin's, or a tenant's pushed under another name
			return "", errNoRef(ref)
		}
		return r.String(), nil
	}
	if _, err := s.find(ctx, own); err == nil {
		return own, nil
	} else if !errdefs.IsNotFound(err) {
		// Not a layer on the remote: its full VM's snapshot, published
		// by a worker, which a create then pulls (pullVM).
		if _, ok := s.w.remoteVM(ctx, own); ok {
			return own, nil
		}
		return "", err
	}
	if own == r.String() { // its own namespace, named whole
		return "", errNoRef(ref)
	}
	f, err := s.find(ctx, r.String())
	switch {
	case errdefs.IsNotFound(err):
		return "", errNoRef(ref)
	case err != nil:
		if rec, ok := s.w.remoteVM(ctx, r.String()); ok { // a VM image there
			if rec.Sandbox != "" { // the admin's snapshot, or a tenant's pushed under another name
				return "", errNoRef(ref)
			}
			return r.String(), nil
		}
		// Not in the local store, and the remote failed: how it failed
		// would tell a tenant what the local store holds.
		s.w.log.Warn("a tenant's layer is not in the local store, and the remote failed", "ref", ref, "err", err)
		return "", errNoRef(ref)
	case f.Kind == layer.KindSnapshot: // the admin's, or a tenant's pushed under another name
		return "", errNoRef(ref)
	}
	return r.String(), nil
}

// snapshot resolves the snapshot a create or branch starts on: for a
// tenant, one of its own (by tag or digest).
func (s scope) snapshot(ctx context.Context, ref string) (string, error) {
	if s.admin() {
		return ref, nil
	}
	if layer.IsDigest(ref) {
		d, err := s.digest(ctx, ref, true)
		if errdefs.IsNotFound(err) {
			return "", errNoSnapshot(ref)
		}
		return d, err
	}
	r, err := layer.ParseRef(ref)
	if err != nil {
		return "", err
	}
	own, err := s.ns.Tag(r.String())
	if err != nil {
		return "", errNoSnapshot(ref)
	}
	if _, err := s.find(ctx, own); errdefs.IsNotFound(err) {
		return "", errNoSnapshot(ref)
	} else if err != nil {
		return "", err
	}
	return own, nil
}

// find looks a tag up where the worker's sandboxes find their layers:
// the local store, then the remote.
func (s scope) find(ctx context.Context, tag string) (*lower.Found, error) {
	return lower.Resolve(ctx, "", s.w.host.Source(), tag, "")
}

// digest finds the one layer ref names by digest among those the
// tenant may name (its own snapshots only, with snapshots) in the
// local store, as sha256:HEX.
func (s scope) digest(ctx context.Context, ref string, snapshots bool) (string, error) {
	i, err := layer.ResolveDigest(ctx, s.w.host.Store, ref, func(i *layer.Info) bool {
		return s.ns.Owns(i.Ref) || !snapshots && !tenant.Reserved(i.Ref) && i.Kind != layer.KindSnapshot
	})
	if errdefs.IsNotFound(err) {
		return "", errNoRef(ref)
	}
	if err != nil {
		return "", err
	}
	return i.Digest.String(), nil
}

// newTag is the store tag a snapshot the caller packs gets: for a
// tenant, in its namespace.
func (s scope) newTag(tag string) (layer.Ref, error) {
	r, err := layer.ParseRef(tag)
	if err != nil || s.admin() {
		return r, err
	}
	own, err := s.ns.Tag(r.String())
	if err != nil {
		return layer.Ref{}, err
	}
	return layer.ParseRef(own)
}

// snapshotTag is the store tag of a snapshot the caller names to see or
// remove it; ok is false when the caller may not (its answer is
// errNoSnapshot).
func (s scope) snapshotTag(ref string) (string, bool) {
	if s.admin() {
		return ref, true
	}
	r, err := layer.ParseRef(ref)
	if err != nil {
		return ref, false
	}
	own, err := s.ns.Tag(r.String())
	return own, err == nil
}

// owns says whether the caller may see the snapshot tagged tag.
func (s scope) owns(tag string) bool { return s.admin() || s.ns.Owns(tag) }

// show is a store ref as the caller sees it: a tenant's own without
// its namespace.
func (s scope) show(ref string) string {
	if s.admin() {
		return ref
	}
	return s.ns.Show(ref)
}

func (s scope) showAll(refs []string) []string {
	if s.admin() || refs == nil {
		return refs
	}
	out := make([]string, len(refs))
	for i, r := range refs {
		out[i] = s.show(r)
	}
	return out
}

// showSandbox is a sandbox's description as the caller sees it.
func (s scope) showSandbox(sb api.Sandbox) api.Sandbox {
	sb.Layers, sb.Snapshot = s.showAll(sb.Layers), s.show(sb.Snapshot)
	return sb
}

// showSnapshot is a snapshot as the caller sees it.
func (s scope) showSnapshot(sn api.Snapshot) api.Snapshot {
	sn.Name, sn.Parent, sn.Layers = s.show(sn.Name), s.show(sn.Parent), s.showAll(sn.Layers)
	return sn
}

// resolveSpec resolves the layers and snapshot of a create the caller
// asks for, in place (a template's or a pool's, the admin's, are not
// the caller's: trusted).
func (s scope) resolveSpec(ctx context.Context, spec *api.SandboxSpec) error {
	if s.admin() {
		return nil
	}
	layers := slices.Clone(spec.Layers)
	for i, ref := range layers {
		r, err := s.layer(ctx, ref)
		if err != nil {
			return err
		}
		layers[i] = r
	}
	if spec.Snapshot != "" {
		r, err := s.snapshot(ctx, spec.Snapshot)
		if err != nil {
			return err
		}
		spec.Snapshot = r
	}
	spec.Layers = layers
	return nil
}
