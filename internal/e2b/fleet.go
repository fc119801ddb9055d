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
	// Relay sends r to the E2B front of the worker that holds the
	// sandbox to names (Server.Relayed there), streaming both ways; fail
	// answers what keeps it from getting there.
	Relay(rw http.ResponseWriter, r *http.Request, to RelayTo, fail func(error))
	// Owner is whom a request with sandbox name's access token acts
	// as: the ID of the token that owns it, or ActAsAdmin.
	Owner(ctx context.Context, name string) (string, error)
}

// RelayTo says where a gateway relays a request and with what. What
// decides where it goes and whose it is travels in its path (the
// worker's routes /v1/e2b/control/PATH, /v1/e2b/sandbox/NAME/PORT/PATH,
// /v1/e2b/token/NAME/PORT/PATH), or is set as it leaves, never left in
// a header the client sent: a proxy drops any header the client names
// in Connection.
type RelayTo struct {
	Sandbox string // its name
	// Port is the sandbox's port (envd's, or a server's); 0: the
	// control route r's path names.
	Port int
	// As is the ID of the token whose authority the request has (its
	// quota and allowances with it), or ActAsAdmin.
	As string
	// Access is the sandbox's access token the caller came with,
	// checked by the worker's front ("": the caller's key, checked by
	// the gateway).
	Access string
	// Header is set on the request as it leaves.
	Header http.Header
}

type relayKey struct{}

// relayed is the caller a gateway vouched for, on a request it relayed.
func relayed(ctx context.Context) (caller, bool) {
	who, ok := ctx.Value(relayKey{}).(caller)
	return who, ok
}

// Relay is a request a gateway relayed to this worker's front, as its
// route says: to Port of Sandbox (envd's, or a server's), or, with no
// Sandbox, to the control route its path names (E2B's). It has the
// authority of the token of ID (Admin: the admin's), Token as the
// gateway vouched for it (auth.OnBehalf's encoding): the caller whose
// key the gateway checked, or, ByAccess, the sandbox's owner, whose
// token the gateway found live, with an access token checked here
// against the record.
type Relay struct {
	Sandbox  string
	Port     int
	ID       string
	Admin    bool
	Token    string
	ByAccess bool
}

// Relayed serves r as rl says. The worker holds the caller's request
// slot already.
func (s *Server) Relayed(rw http.ResponseWriter, r *http.Request, rl Relay) {
	r.Header.Del("Authorization") // (the gateway's to the worker)
	r.Header.Del("E2b-Sandbox-Id")
	r.Header.Del("E2b-Sandbox-Port")
	if u := r.Header.Get(HeaderUser); u != "" {
		r.SetBasicAuth(u, "")
	}
	ctx := context.WithValue(r.Context(), relayKey{}, caller{id: rl.ID, admin: rl.Admin, token: rl.Token, byAccess: rl.ByAccess})
	if d := r.Header.Get(HeaderDomain); d != "" {
		ctx = context.WithValue(ctx, domainKey{}, d)
	}
	r = r.WithContext(ctx)
	if rl.Sandbox == "" {
		s.control.ServeHTTP(rw, r)
		return
	}
	if h := r.Header.Get("X-Forwarded-Host"); h != "" {
		r.Host = h // what the caller asked the gateway for (a port's server sees it)
	}
	s.toSandbox(rw, r, rl.Sandbox, rl.Port)
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
	if via.byAccess || strings.HasPrefix(token, envdPrefix) {
		want := s.accessToken(rec)
		if !ok || want == "" || !hmac.Equal([]byte(token), []byte(want)) || !via.admin && rec.Owner != via.id {
			return caller{}, fmt.Errorf("unauthorized: %w", errdefs.ErrUnauthenticated)
		}
		who := caller{id: rec.Owner}
		if via.id == rec.Owner {
			who.token = via.token
		}
		return who, nil
	}
	if ok && !via.admin && rec.Owner != via.id {
		return caller{}, fmt.Errorf("sandbox %s not found: %w", id, errdefs.ErrNotFound)
	}
	return via, nil
}

// Adopt keeps the record a gateway's front sent with a create (raw, a
// HeaderRecord) as the record of sandbox name, owned by the token of
// owner ("": the admin's), from before the sandbox is made: the create
// then ends the adoption by Made once the sandbox runs, or by Drop if
// it failed, which leaves no record.
func (s *Server) Adopt(raw, name, owner string) (*Adoption, error) {
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
	return &Adoption{s: s, name: name}, nil
}

// An Adoption is a record kept for a sandbox being made (Adopt).
type Adoption struct {
	s    *Server
	name string
}

// Made ties the record to the sandbox made, whose ID is id, and returns
// the sandbox's E2B state, its access token included.
func (a *Adoption) Made(id string) (*api.E2BState, error) {
	if err := a.s.records.created(a.name, id); err != nil {
		return nil, err
	}
	st := a.s.State(a.name, id)
	if st == nil {
		return nil, fmt.Errorf("sandbox %s: its E2B record is gone: %w", a.name, errdefs.ErrNotFound)
	}
	rec, _ := a.s.records.get(a.name)
	st.AccessToken = a.s.accessToken(rec)
	return st, nil
}

// Drop removes the record of a sandbox that was not made; a record
// tied to a sandbox (Made) stays.
func (a *Adoption) Drop() { a.s.records.drop(record{ID: a.name}) }

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
	to := RelayTo{Sandbox: r.PathValue("id"), As: who.id, Header: s.relayHeader(r)}
	if to.As == "" || who.admin {
		to.As = ActAsAdmin
	}
	s.opts.Fleet.Relay(rw, r, to, func(err error) { writeError(rw, err) })
}

// relayHeader is what a relayed request carries for the worker's front
// besides its path: the domain answers give and the user a command
// runs as (Basic auth's, which the relay's own replaces).
func (s *Server) relayHeader(r *http.Request) http.Header {
	h := http.Header{}
	if s.opts.Domain != "" {
		h.Set(HeaderDomain, s.opts.Domain)
	}
	if user, _, ok := r.BasicAuth(); ok {
		h.Set(HeaderUser, user)
	}
	return h
}

// relaySandbox relays a request to port of sandbox id (envd's, or a
// server's) with token (an access token, or a key), from a gateway's
// front.
func (s *Server) relaySandbox(rw http.ResponseWriter, r *http.Request, id string, port int, token string) {
	to := RelayTo{Sandbox: id, Port: port, Header: s.relayHeader(r)}
	to.Header.Set("X-Forwarded-Host", r.Host)
	if strings.HasPrefix(token, envdPrefix) {
		// The owner's token must be live; the worker's front checks the
		// access token itself.
		var err error
		to.As, err = s.opts.Fleet.Owner(r.Context(), id)
		if err == nil && to.As != ActAsAdmin && s.opts.Live != nil && !s.opts.Live(to.As) || errdefs.IsNotFound(err) {
			err = fmt.Errorf("unauthorized: %w", errdefs.ErrUnauthenticated)
		}
		if err != nil {
			refuse(rw, r, err)
			return
		}
		to.Access = token
	} else {
		who, err := s.authorize(token)
		if err != nil {
			refuse(rw, r, err)
			return
		}
		to.As = who.id
		if who.admin {
			to.As = ActAsAdmin
		}
	}
	// (A key, checked here, is never the worker's to see; an access
	// token goes as the relay sets it.)
	for _, h := range []string{"X-Access-Token", "E2b-Traffic-Access-Token", HeaderUser, HeaderDomain, "X-Forwarded-Host"} {
		r.Header.Del(h)
	}
	s.opts.Fleet.Relay(rw, r, to, func(err error) { refuse(rw, r, err) })
}
