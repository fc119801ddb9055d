package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/tenant"
)

// The remote API. Besides its unix socket, whose file permissions are
// its guard (the admin's), a worker may listen on TCP (Config.Listen):
// the same API, every request carrying a token (package auth) as
// "Authorization: Bearer dsec_...". Off loopback it takes TLS only
// (Config.TLS; with ClientCA, only clients with a certificate that CA
// signed). No token, or a wrong or expired one, is 401 and nothing
// else. A token of scope sandboxes sees and acts on the sandboxes it
// created and the snapshots taken of them (and branches them): another
// token's is not found, as if it did not exist; what only the admin
// does (pools, stored policies, squash, shutdown) is refused, 403.

// Requests over TCP and from the E2B front are bounded at once: per
// token (Config.MaxRequestsPerToken, api.max_requests_per_token), so
// that one tenant's streams cannot take every slot, and in all
// (Config.MaxRequests, api.max_requests). A stream of an exec's output
// holds one while it runs. Past either bound a request is answered busy
// (429) at once.
const (
	defaultMaxRequests         = 4096
	defaultMaxRequestsPerToken = 1024
)

// limiter counts the requests being served, by token and in all.
type limiter struct {
	max, perToken int

	mu    sync.Mutex
	all   int
	token map[string]int
}

func newLimiter(max, perToken int) *limiter {
	if max <= 0 {
		max = defaultMaxRequests
	}
	if perToken <= 0 {
		perToken = defaultMaxRequestsPerToken
	}
	return &limiter{max: max, perToken: min(perToken, max), token: map[string]int{}}
}

// take holds a slot for a request of token id, or says why there is
// none. The last eighth of all slots are kept for admin tokens: tenants
// that fill theirs leave the admin a way in.
func (l *limiter) take(id string, admin bool) (release func(), err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	all := l.max
	if !admin {
		all -= l.max / 8
	}
	switch {
	case l.token[id] >= l.perToken:
		return nil, fmt.Errorf("this token has %d requests under way, its bound: retry later: %w", l.perToken, errdefs.ErrResourceExhausted)
	case l.all >= all:
		return nil, fmt.Errorf("the worker serves %d requests over TCP already: retry later: %w", l.all, errdefs.ErrResourceExhausted)
	}
	l.all++
	l.token[id]++
	return sync.OnceFunc(func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.all--
		if l.token[id]--; l.token[id] == 0 {
			delete(l.token, id)
		}
	}), nil
}

type tokenKey struct{}

// tokenOf is the token a request came with (nil: over the unix socket).
func tokenOf(ctx context.Context) *auth.Token {
	t, _ := ctx.Value(tokenKey{}).(*auth.Token)
	return t
}

// ownerOf is what a sandbox or snapshot ctx's request makes records as
// its owner: its token's id, "" over the unix socket.
func ownerOf(ctx context.Context) string {
	if t := tokenOf(ctx); t != nil {
		return t.ID
	}
	return ""
}

// mayUse says whether ctx's caller may see and act on what owner owns:
// the admin (the unix socket, an admin token) on everything, a
// sandboxes token on its own.
func mayUse(ctx context.Context, owner string) bool {
	t := tokenOf(ctx)
	return t == nil || t.Scope == auth.Admin || t.ID == owner
}

// adminOnly refuses h to a token that is not the admin's.
func adminOnly(what string, h http.HandlerFunc) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		if t := tokenOf(r.Context()); t != nil && t.Scope != auth.Admin {
			fail(rw, fmt.Errorf("a token of scope %s cannot %s: use an admin token: %w", t.Scope, what, errdefs.ErrPermissionDenied))
			return
		}
		h(rw, r)
	}
}

// authed is next behind the tokens: a request without a valid one is
// answered 401 and nothing more, before its body is read; the rest take
// a slot of l's. An admin token's request on behalf of another token
// (a gateway's, auth.OnBehalfHeader) is served as that token's; its
// create marked as an E2B template's (e2b.HeaderTemplate) takes the spec
// as the admin's, as one from this worker's own front.
func (w *worker) authed(next http.Handler, l *limiter) http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if api.VNCSandbox(r.Method, r.URL.Path) != "" { // a VNC grant's token opens it, and nothing else (vnc_linux.go)
			w.vncSocket(rw, r)
			return
		}
		secret, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		t, err := w.tokens.Check(secret, time.Now())
		if err != nil {
			unauthorized(rw, r)
			return
		}
		if h := r.Header.Get(auth.OnBehalfHeader); h != "" {
			if t.Scope != auth.Admin {
				unread(rw, r)
				fail(rw, fmt.Errorf("a token of scope %s cannot act on behalf of another (%s): %w", t.Scope, auth.OnBehalfHeader, errdefs.ErrPermissionDenied))
				return
			}
			if t, err = auth.ParseOnBehalf(h); err != nil {
				unread(rw, r)
				fail(rw, err)
				return
			}
			r = r.WithContext(context.WithValue(r.Context(), gatewayKey{}, true))
			if r.Header.Get(e2b.HeaderTemplate) != "" {
				// The gateway's E2B front's template: the admin's spec,
				// made for its caller (as this worker's own front does).
				r = r.WithContext(withTrusted(r.Context()))
			}
		}
		if t.Scope != auth.Admin && r.Header.Get(auth.OnBehalfHeader) == "" {
			r.Header.Del(e2b.HeaderRecord) // (an admin's alone to send)
		}
		w.serveAs(rw, r, next, l, &t)
	})
}

// gatewayKey marks a request an admin's token made on behalf of another
// (a gateway's, for its client).
type gatewayKey struct{}

// vouched says whether r came with the admin's token: over the socket,
// the admin's own, or a gateway's on behalf of its client.
func vouched(r *http.Request) bool {
	t := tokenOf(r.Context())
	via, _ := r.Context().Value(gatewayKey{}).(bool)
	return t == nil || t.Scope == auth.Admin || via
}

func unauthorized(rw http.ResponseWriter, r *http.Request) {
	rw.Header().Set("WWW-Authenticate", `Bearer realm="dsec"`)
	unread(rw, r)
	answer(rw, http.StatusUnauthorized, api.Error{Class: api.ClassUnauthorized, Message: "unauthorized"})
}

// unread marks r's answer as one given without reading its body: over
// HTTP/1 its connection closes after it, else the server would read
// what is left of the body first (a client that never sends it would
// hold it for good).
func unread(rw http.ResponseWriter, r *http.Request) {
	if r.ProtoMajor == 1 {
		rw.Header().Set("Connection", "close")
	}
}

// serveAs serves r as t's (nil: the admin's), in a slot of l's (nil:
// the caller holds one).
func (w *worker) serveAs(rw http.ResponseWriter, r *http.Request, next http.Handler, l *limiter, t *auth.Token) {
	if l != nil {
		release, err := l.take(t.ID, t.Scope == auth.Admin)
		if err != nil {
			unread(rw, r)
			fail(rw, err)
			return
		}
		defer release()
	}
	ctx := r.Context()
	if t != nil {
		ctx = context.WithValue(ctx, tokenKey{}, t)
	}
	next.ServeHTTP(rw, r.WithContext(ctx))
}

// The E2B front reaches the worker in process (e2b_linux.go), having
// checked the caller's key itself; it says whose authority a request
// carries (e2b.HeaderActAs), and whether its spec is a template's
// (e2b.HeaderTemplate), in headers only a connection made in this
// process can send.

// actAs serves the front's requests with the authority they name: the
// admin's, or the token's of that ID (a removed token's: its own
// sandboxes only, as scope sandboxes). The front holds their slots
// (holdFor), from before it reads a request.
func (w *worker) actAs(next http.Handler) http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		id := r.Header.Get(e2b.HeaderActAs)
		var t *auth.Token
		switch {
		case id == "":
			unauthorized(rw, r)
			return
		case id != e2b.ActAsAdmin:
			tok, ok := w.tokens.Lookup(id)
			if !ok {
				tok = auth.Token{ID: id, Scope: auth.Sandboxes}
			}
			if h := r.Header.Get(e2b.HeaderActAsToken); h != "" {
				// A gateway's client's, as the gateway vouched for it
				// on the request the front relays (e2bRelayed).
				if v, err := auth.ParseOnBehalf(h); err == nil && v.ID == id {
					tok = v
				}
			}
			t = &tok
		}
		if name := r.Header.Get(e2b.HeaderTemplate); name != "" {
			if _, ok := w.cfg.E2B.Templates[name]; ok {
				r = r.WithContext(withTrusted(r.Context()))
			}
		}
		w.serveAs(rw, r, next, nil, t)
	})
}

// migrateOwners moves the snapshots an older worker recorded as a
// token's of scope sandboxes in <root>/owners.json (their tags among
// everyone's) into that token's namespace, tenants/ID/NAME:STEP, and
// removes the file. What stands on one finds it by its image (its
// digest), as on a moved tag. An entry of an admin token, of a token
// gone, or whose tag now names what is not a snapshot (a layer built
// under the tag since) leaves the tag where it is: the admin's.
func migrateOwners(ctx context.Context, root string, s *store.Store, tokens *auth.Store) error {
	path := filepath.Join(root, "owners.json")
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var owners map[string]string // NAME:STEP: token id
	if err := json.Unmarshal(b, &owners); err != nil {
		return fmt.Errorf("%s: %v: remove it (its snapshots then stay the admin's): %w", path, err, errdefs.ErrDataLoss)
	}
	for _, ref := range slices.Sorted(maps.Keys(owners)) {
		if t, ok := tokens.Lookup(owners[ref]); !ok || t.Scope != auth.Sandboxes || tenant.Reserved(ref) {
			continue
		}
		i, err := layer.Resolve(ctx, s, ref)
		if errdefs.IsNotFound(err) || err == nil && i.Kind != layer.KindSnapshot {
			continue
		}
		if err != nil {
			return err
		}
		d, err := s.Resolve(ctx, ref)
		if err != nil {
			return err
		}
		if err := s.Tag(ctx, string(tenant.Of(owners[ref]))+ref, d, false); err != nil {
			return fmt.Errorf("move snapshot %s into its token's namespace: %w", ref, err)
		}
		if _, err := s.Untag(ctx, ref); err != nil {
			return err
		}
	}
	return os.Remove(path)
}

// canonical is ref as the store names it.
func canonical(ref string) string {
	if r, err := layer.ParseRef(ref); err == nil {
		return r.String()
	}
	return ref
}

func errNoSnapshot(ref string) error {
	return fmt.Errorf("no snapshot %s (dsec snap ls lists them): %w", canonical(ref), errdefs.ErrNotFound)
}
