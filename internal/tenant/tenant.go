// Package tenant names what a token of scope sandboxes (a tenant) holds
// in a root's store. Layers and snapshots share the store's one tag
// index; a tenant's snapshots are tagged under a namespace of its own,
// tenants/ID/ (ID its token's), which no other tenant's refs reach. A
// tenant names its snapshots without the prefix (x:1 is tenants/ID/x:1
// to it) and the admin's layers as they are; the admin names a tenant's
// snapshot by its whole tag. A tenant never makes, moves or sees a tag
// outside its namespace, so it cannot squat an admin's tag, nor one
// another tenant could come to use.
//
// The package only names; what a tenant may resolve (its own snapshots,
// and the layers the admin built or pulled, never a snapshot outside its
// namespace) is decided where refs are resolved, in the worker.
package tenant

import (
	"fmt"
	"strings"

	"github.com/containerd/errdefs"
)

// Root is the first name component of every tenant's namespace.
const Root = "tenants"

// Namespace is a tenant's prefix of the store's tags: tenants/ID/.
type Namespace string

// Of is the namespace of the token id.
func Of(id string) Namespace { return Namespace(Root + "/" + id + "/") }

// Reserved says whether a tag (NAME:VERSION, or a layer name) lies in
// some tenant's namespace: only the admin makes one there by its name.
func Reserved(tag string) bool { return strings.HasPrefix(tag, Root+"/") }

// Owns says whether the store tag lies in ns.
func (ns Namespace) Owns(tag string) bool { return ns != "" && strings.HasPrefix(tag, string(ns)) }

// Tag is the store tag a tenant's own ref names: ref under ns. A ref
// that names ns itself is taken as it is; one under another tenant's
// namespace is refused, with the same answer whether that tag exists
// or not.
func (ns Namespace) Tag(ref string) (string, error) {
	switch {
	case ns.Owns(ref):
		return ref, nil
	case Reserved(ref):
		return "", fmt.Errorf("%s: a token's snapshots are named without %s/ (it is the store's namespace of tokens): give NAME:STEP: %w",
			ref, Root, errdefs.ErrInvalidArgument)
	}
	return string(ns) + ref, nil
}

// Show is a store tag as the tenant of ns sees it: its own without the
// prefix, the admin's as they are.
func (ns Namespace) Show(tag string) string {
	if ns.Owns(tag) {
		return strings.TrimPrefix(tag, string(ns))
	}
	return tag
}
