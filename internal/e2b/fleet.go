package e2b

import (
	"context"
	"crypto/hmac"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
)

// A fleet's E2B state is its workers': each worker runs a front (its
// records, the timeouts it keeps, the commands it started and their
// stdin), and a gateway's front (Options.Fleet) keeps nothing of its
// own. A create through the gateway carries its record to the worker it
// is placed on (HeaderRecord), which keeps it from before the sandbox
// runs; every request about one sandbox (its envd, its ports, and the
// control routes under /sandboxes/ID) is relayed to the front of the
// worker that holds it (Server.Relayed); a list reads each sandbox's
// state from its description (api.Sandbox.E2B). So any number of
// gateway replicas serve E2B's API alike, and one restarted loses
// nothing.

// HeaderRecord carries, on a create a gateway's front sends a worker,
// the E2B record the sandbox is made with (JSON, base64url): the
// worker's front keeps it (Server.Adopt). Only an admin's request may
// carry it: a gateway's, on behalf of its caller.
const HeaderRecord = "Dsec-E2b-Record"

// HeaderUser carries, on a request a gateway relays, the user its
// caller named (Basic auth's name, which the relay's own Authorization
// replaces).
const HeaderUser = "Dsec-E2b-User"

// HeaderDomain carries, on a request a gateway relays to a worker's
// front, the domain the gateway's front gives in its answers.
const HeaderDomain = "Dsec-E2b-Domain"

// Fleet is what a gateway's front needs of its gateway.
type Fleet interface {
	// Relay sends r, a request about sandbox name, to the E2B front of
	// the worker that holds it (Server.Relayed there) with the authority
	// of the token of id (ActAsAdmin: the admin's); fail answers what
	// keeps it from getting there.
	Relay(rw http.ResponseWriter, r *http.Request, name, id string, fail func(error))
	// Owner is whom a request with sandbox name's access token acts
	// as: the ID of the token that owns it, or ActAsAdmin.
	Owner(ctx context.Context, name string) (string, error)
}

type relayKey struct{}

// relayed is the caller a gateway vouched for, on a request it relayed.
func relayed(ctx context.Context) (caller, bool) {
	who, ok := ctx.Value(relayKey{}).(caller)
	return who, ok
}

// Relayed serves r, a request about one sandbox that a gateway's front
// relayed to this worker's front, with the authority of the token of
// id (admin: the admin's): the caller whose key the gateway checked,
// or, for a request with a sandbox's access token, the sandbox's owner,
// whose token the gateway found live (the access token is checked here,
// against the record). r's path is E2B's; the worker holds the caller's
// request slot already.
func (s *Server) Relayed(rw http.ResponseWriter, r *http.Request, id string, admin bool) {
	r.Header.Del("Authorization") // (the gateway's to the worker)
	if h := r.Header.Get("X-Forwarded-Host"); h != "" && r.Header.Get("E2b-Sandbox-Id") != "" {
		r.Host = h // what the caller asked the gateway for (a port's server sees it)
	}
	if u := r.Header.Get(HeaderUser); u != "" {
		r.SetBasicAuth(u, "")
	}
	ctx := context.WithValue(r.Context(), relayKey{}, caller{id: id, admin: admin})
	if d := r.Header.Get(HeaderDomain); d != "" {
		ctx = context.WithValue(ctx, domainKey{}, d)
	}
	s.ServeHTTP(rw, r.WithContext(ctx))
}

type domainKey struct{}

// domain is what answers give as the sandboxes' domain ("": none).
func (s *Server) domain(ctx context.Context) string {
	if d, ok := ctx.Value(domainKey{}).(string); ok {
		return d
	}
	return s.opts.Domain
}

// relayedCaller is envdCaller for a relayed request: an access token is
// checked here, and must be of a sandbox the caller the gateway names
// owns (the admin: any).
func (s *Server) relayedCaller(id, token string, via caller) (caller, error) {
	rec, ok := s.records.get(id)
	if strings.HasPrefix(token, envdPrefix) {
		want := s.accessToken(rec)
		if ok && want != "" && hmac.Equal([]byte(token), []byte(want)) && (via.admin || rec.Owner == via.id) {
			return caller{id: rec.Owner}, nil
		}
		return caller{}, fmt.Errorf("unauthorized: %w", errdefs.ErrUnauthenticated)
	}
	if ok && !via.admin && rec.Owner != via.id {
		return caller{}, fmt.Errorf("sandbox %s not found: %w", id, errdefs.ErrNotFound)
	}
	return via, nil
}

// Adopt keeps the record a gateway's front sent with a create (raw, a
// HeaderRecord) as the record of sandbox name, owned by the token of
// owner ("": the admin's), from before make makes it; a create that
// fails leaves none. It returns the sandbox's E2B state, its access
// token included.
func (s *Server) Adopt(raw, name, owner string, make func() (id string, err error)) (*api.E2BState, error) {
	var rec record
	b, err := base64.RawURLEncoding.DecodeString(raw)
	if err == nil {
		err = json.Unmarshal(b, &rec)
	}
	if err == nil && rec.ID != name {
		err = fmt.Errorf("it is sandbox %q's, not %q's", rec.ID, name)
	}
	if err == nil {
		err = checkMetadata(rec.Metadata)
	}
	if err != nil {
		return nil, fmt.Errorf("bad %s header: %v: %w", HeaderRecord, err, errdefs.ErrInvalidArgument)
	}
	rec.Owner, rec.Sandbox, rec.Procs, rec.NextPID, rec.Expired = owner, "", nil, 1, false
	rec.Snapshots, rec.Forks = 0, 0
	if err := s.records.putNew(rec); err != nil {
		return nil, err
	}
	id, err := make()
	if err != nil {
		s.records.remove(name)
		return nil, err
	}
	if err := s.records.created(name, id); err != nil {
		return nil, err
	}
	st := s.State(name, id)
	if st == nil {
		return nil, fmt.Errorf("sandbox %s: its E2B record is gone: %w", name, errdefs.ErrNotFound)
	}
	rec, _ = s.records.get(name)
	st.AccessToken = s.accessToken(rec)
	return st, nil
}

// State is what the front keeps of sandbox name whose ID is id, for its
// description (api.Sandbox.E2B): nil if nothing.
func (s *Server) State(name, id string) *api.E2BState {
	rec, ok := s.records.get(name)
	if !ok || rec.Sandbox != "" && rec.Sandbox != id {
		return nil
	}
	return &api.E2BState{Template: rec.Template, Metadata: rec.Metadata, Started: rec.Started, EndAt: rec.EndAt, OnTimeout: rec.OnTimeout}
}

// relay is a control route of a gateway's front: the request goes to
// the front of the worker that holds the sandbox.
func (s *Server) relay(rw http.ResponseWriter, r *http.Request, who caller) {
	id := who.id
	if id == "" || who.admin {
		id = ActAsAdmin
	}
	r.Header.Del(HeaderDomain)
	if s.opts.Domain != "" {
		r.Header.Set(HeaderDomain, s.opts.Domain)
	}
	r.Header.Del("E2b-Sandbox-Id") // (a control route: by its path alone)
	r.Header.Del("X-Forwarded-Host")
	s.opts.Fleet.Relay(rw, r, r.PathValue("id"), id, func(err error) { writeError(rw, err) })
}

// relaySandbox relays a request to sandbox id's envd or a port of it,
// with token (an access token, or a key), from a gateway's front: by
// headers, whatever Host it came with.
func (s *Server) relaySandbox(rw http.ResponseWriter, r *http.Request, id, port, token string) {
	var as string
	if strings.HasPrefix(token, envdPrefix) {
		// The owner's token must be live; the worker's front checks the
		// access token itself.
		var err error
		as, err = s.opts.Fleet.Owner(r.Context(), id)
		if err == nil && as != ActAsAdmin && s.opts.Live != nil && !s.opts.Live(as) || errdefs.IsNotFound(err) {
			err = fmt.Errorf("unauthorized: %w", errdefs.ErrUnauthenticated)
		}
		if err != nil {
			refuse(rw, r, err)
			return
		}
	} else {
		who, err := s.authorize(token)
		if err != nil {
			refuse(rw, r, err)
			return
		}
		as = who.id
		if who.admin {
			as = ActAsAdmin
		}
	}
	r.Header.Set("E2b-Sandbox-Id", id)
	r.Header.Set("E2b-Sandbox-Port", port)
	r.Header.Set("X-Forwarded-Host", r.Host)
	r.Header.Del(HeaderUser)
	if user, _, ok := r.BasicAuth(); ok {
		r.Header.Set(HeaderUser, user)
	}
	r.Header.Del(HeaderDomain)
	if s.opts.Domain != "" {
		r.Header.Set(HeaderDomain, s.opts.Domain)
	}
	s.opts.Fleet.Relay(rw, r, id, as, func(err error) { refuse(rw, r, err) })
}
