package gateway

import (
	"context"
	"fmt"
	"net/http"
	"net/url"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
)

// An E2B front on a gateway (e2b.Options.Fleet) keeps no state: a
// sandbox's is its worker's front's, and every request about one
// sandbox goes there, to the worker's route e2bPrefix.

// e2bPrefix is the worker's route to its E2B front, for its gateways
// (admin only).
const e2bPrefix = "/" + api.Version + "/e2b"

// failKey holds, on a relayed request, how an E2B front answers a
// failure.
type failKey struct{}

// Relay sends r, an E2B request about sandbox name, to the E2B front of
// the worker that holds it, with the authority of the token of id
// (e2b.ActAsAdmin: the admin's), streaming both ways; fail answers what
// keeps it from getting there, in the front's form.
func (g *Gateway) Relay(rw http.ResponseWriter, r *http.Request, name, id string, fail func(error)) {
	t := g.actingAs(id)
	ctx := context.WithValue(context.WithValue(r.Context(), tokenKey{}, t), failKey{}, fail)
	n, err := g.holderOf(ctx, name, t)
	if err != nil {
		fail(err)
		return
	}
	out := r.WithContext(ctx)
	u := *r.URL
	u.Path, u.RawPath = e2bPrefix+r.URL.Path, ""
	out.URL = &u
	out.Header = r.Header.Clone()
	out.Header.Del("X-Api-Key") // (the gateway's key: checked here, never the worker's to see)
	g.relayTo(n, rw, out)
}

// Owner is whom a request with sandbox name's access token acts as:
// the gateway's token that owns it, or e2b.ActAsAdmin for one the
// admin made (the worker names its admin token, or none, as its owner);
// a sandbox another owns (a token removed since, or a worker's own
// tenant) is refused.
func (g *Gateway) Owner(ctx context.Context, name string) (string, error) {
	admin := &auth.Token{Scope: auth.Admin}
	n, err := g.holderOf(ctx, name, admin)
	if err != nil {
		return "", err
	}
	owner, found := "", false
	n.mu.Lock()
	for _, s := range n.held {
		if s.Name == name {
			owner, found = s.Owner, true
		}
	}
	adminID := n.info.TokenID
	n.mu.Unlock()
	if !found {
		var sb api.Sandbox
		if err := n.get(ctx, "/"+api.Version+"/sandboxes/"+url.PathEscape(name), admin, &sb); err != nil {
			if errdefs.IsNotFound(err) {
				return "", fmt.Errorf("no sandbox %s: %w", name, errdefs.ErrNotFound)
			}
			return "", err
		}
		owner = sb.Owner
	}
	if _, ok := g.cfg.Tokens.Lookup(owner); ok {
		return owner, nil
	}
	if owner == "" || owner == adminID {
		return e2b.ActAsAdmin, nil
	}
	return "", fmt.Errorf("sandbox %s is owned by no token of this gateway's: %w", name, errdefs.ErrUnauthenticated)
}
