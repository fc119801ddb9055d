package gateway

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strconv"

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

// Relay sends r, an E2B request about sandbox to.Sandbox, to the E2B
// front of the worker that holds it, with the authority of the token
// of to.As (e2b.ActAsAdmin: the admin's) and its quota on that worker
// (quotaOn: a fork there makes sandboxes), streaming both ways: to the
// route of the worker's that to says (e2bPrefix/control/PATH,
// e2bPrefix/sandbox/NAME/PORT/PATH, e2bPrefix/token/NAME/PORT/PATH),
// with to.Header and to.Access set as it leaves; fail answers what
// keeps it from getting there, in the front's form.
func (g *Gateway) Relay(rw http.ResponseWriter, r *http.Request, to e2b.RelayTo, fail func(error)) {
	t := g.actingAs(to.As)
	n, err := g.holderOf(r.Context(), to.Sandbox, t)
	if err != nil {
		fail(err)
		return
	}
	tq := t
	if to.Port == 0 { // (a control route: a fork makes sandboxes)
		tq, _ = g.quotaOn(t, n) // (used up: the worker refuses what would add to it)
	}
	set := to.Header.Clone()
	if set == nil {
		set = http.Header{}
	}
	mode := "sandbox"
	if to.Access != "" {
		mode = "token"
		set.Set("X-Access-Token", to.Access)
	}
	ctx := context.WithValue(context.WithValue(r.Context(), tokenKey{}, tq), failKey{}, fail)
	out := r.WithContext(context.WithValue(ctx, relayKey{}, set))
	u := *r.URL
	u.Path, u.RawPath = e2bPrefix+"/control"+r.URL.Path, ""
	if to.Port != 0 {
		u.Path = e2bPrefix + "/" + mode + "/" + url.PathEscape(to.Sandbox) + "/" + strconv.Itoa(to.Port) + r.URL.Path
	}
	out.URL = &u
	out.Header = r.Header.Clone()
	out.Header.Del("X-Api-Key") // (the gateway's key: checked here, never the worker's to see)
	g.relayTo(n, rw, out)
}

// relayKey holds, on a request an E2B front relays, the headers set on
// it as it leaves (e2b.RelayTo.Header): after the proxy dropped what
// the client's Connection names, so no client drops them.
type relayKey struct{}

// relayHeaders are those a relay sets, a client's dropped.
var relayHeaders = []string{"X-Access-Token", "E2b-Traffic-Access-Token", e2b.HeaderUser, e2b.HeaderDomain, "X-Forwarded-Host"}

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
