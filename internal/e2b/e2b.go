// Package e2b is dsec's E2B front: the API the official E2B SDKs (and
// the agent frameworks built on them) speak, served over a dsec worker
// so that they drive dsec sandboxes unchanged.
//
// One address serves both of E2B's planes. A request that carries an
// E2b-Sandbox-Id header (every envd request of SDK 2.7 and later, with
// E2B_SANDBOX_URL set to this address) or a Host of the form
// PORT-ID.DOMAIN goes to that sandbox: port 49983 is envd, which this
// package implements over dsec's API (the Process and Filesystem
// Connect services and the /files REST endpoints); another port is
// proxied to the sandbox's address, where it has one. Every other
// request is the control plane (sandboxes, timeouts, pause, fork,
// snapshots), with the caller's API key in X-API-KEY.
//
// An API key is a dsec token (dsec token create --e2b makes one shaped
// e2b_<40 hex>, which every 2.x SDK accepts). The front checks it before
// it reads anything of a request, then calls the worker with that
// token's authority, so a key sees only its own sandboxes, as on dsec's
// TCP API. A sandbox's envdAccessToken, which the SDK sends back on
// every envd request, is a token of that sandbox's alone (never the
// key). The front keeps what E2B knows
// and dsec does not (a sandbox's template, metadata, timeout and its
// processes' pids) in a record per sandbox under its directory.
//
// Sandboxes are dsec sandboxes named by their E2B ids, so dsec ps,
// exec and logs see them too; every E2B command is a dsec exec, in the
// sandbox's journal (process.go says where a retry is seen).
package e2b

import (
	"cmp"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/durable"
	"github.com/dsec-project/dsec/sdk"
)

// EnvdVersion is the envd version the front reports: the SDKs gate
// features on it (closeStdin needs 0.5.2, octet-stream uploads 0.5.7).
const EnvdVersion = "0.5.7"

// EnvdPort is the port the SDKs address envd by.
const EnvdPort = 49983

// Options configure a front.
type Options struct {
	// Transport carries the front's requests to the worker's API, in
	// process: each with the authority HeaderActAs names, which only such
	// a request may carry (the front checks keys itself).
	Transport http.RoundTripper
	// Authorize checks a key as the worker does: the id of its token and
	// whether it is the admin's.
	Authorize func(key string) (id string, admin bool, err error)
	// Lookup says which sandbox, if any, a name names now: its ID. The
	// front drops the records of sandboxes gone while it did not run.
	Lookup func(name string) (id string, ok bool)
	// Hold holds one of the requests at once a token may have (the
	// worker's bound) while the front serves one of its requests, from
	// before the request's body is read; nil: no bound.
	Hold func(id string, admin bool) (release func(), err error)
	// Live says whether the token of id still opens anything (a
	// sandbox's access token dies with its owner's token).
	Live func(id string) bool
	// Dir holds the front's records (one file per sandbox) and its key.
	Dir string
	// Templates are the template IDs the config names (e2b.templates);
	// any other ID is a snapshot (NAME:STEP) or a single layer ref.
	Templates map[string]api.SandboxSpec
	// ImageKeys are the create metadata keys that name a container image
	// for the sandbox (nil: "image"), as RL trainers send one with no
	// template: the sandbox is the image's, under the layers of the
	// template ID if the config names it.
	ImageKeys []string
	// Domain is what the create and connect answers give as the
	// sandboxes' domain (none: the SDK's own default is not used, it
	// routes by headers to E2B_SANDBOX_URL).
	Domain string
	Log    *slog.Logger
	// Fleet makes this a gateway's front, which keeps no records: each
	// sandbox's are its worker's front's (fleet.go). Dir is not used.
	Fleet Fleet
}

// The headers of the front's requests to the worker (Options.Transport).
const (
	// HeaderActAs names whose authority a request carries: a token's ID,
	// or ActAsAdmin (what the worker's own socket made: the admin's).
	HeaderActAs = "Dsec-Act-As"
	ActAsAdmin  = "admin"
	// HeaderActAsToken carries, with HeaderActAs, the token itself as a
	// gateway vouched for it (auth.OnBehalf's encoding), for a request
	// it relayed: the worker serves it with that token's quota and
	// allowances.
	HeaderActAsToken = "Dsec-Act-As-Token"
	// HeaderTemplate marks a create whose spec is the config's template
	// of that name (the admin's, not the caller's).
	HeaderTemplate = "Dsec-Template"
)

// Server is the E2B front.
type Server struct {
	opts    Options
	more    atomic.Pointer[map[string]api.SandboxSpec] // SetTemplates's
	records *records
	control *http.ServeMux
	envd    http.Handler
	procs   *procTable
	key     []byte // of the sandboxes' envd access tokens
}

// New makes a front; Run then keeps the sandboxes' timeouts.
func New(opts Options) (*Server, error) {
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	s := &Server{opts: opts, records: &records{m: map[string]*record{}}, procs: newProcTable()}
	if opts.Fleet == nil {
		r, err := openRecords(opts.Dir)
		if err != nil {
			return nil, err
		}
		if opts.Lookup != nil {
			r.reconcile(opts.Lookup)
		}
		if s.key, err = envdKey(opts.Dir); err != nil {
			return nil, err
		}
		s.records = r
	}
	s.control = s.controlRoutes()
	s.envd = s.envdAuth(s.envdRoutes())
	return s, nil
}

// Forget drops what the front holds of the sandbox whose ID is id: the
// worker calls it when it removes one, before its name is free again.
func (s *Server) Forget(id string) {
	if name := s.records.forget(id); name != "" {
		s.procs.drop(name)
	}
}

// ServeHTTP routes a request to a sandbox's port or the control plane:
// the sandbox headers first (an envd GET /health carries them too).
func (s *Server) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	if s.opts.Log.Enabled(r.Context(), slog.LevelDebug) {
		t0, sw := time.Now(), &statusWriter{ResponseWriter: rw, status: http.StatusOK}
		defer func() {
			s.opts.Log.Debug("e2b request", "method", r.Method, "path", r.URL.Path, "sandbox", r.Header.Get("E2b-Sandbox-Id"),
				"status", sw.status, "took", time.Since(t0))
		}()
		rw = sw
	}
	s.route(rw, r)
}

// statusWriter notes an answer's status for the debug log.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) { w.status = code; w.ResponseWriter.WriteHeader(code) }

func (w *statusWriter) Flush() { http.NewResponseController(w.ResponseWriter).Flush() }

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (s *Server) route(rw http.ResponseWriter, r *http.Request) {
	id, port := r.Header.Get("E2b-Sandbox-Id"), r.Header.Get("E2b-Sandbox-Port")
	if id == "" {
		id, port = hostRoute(r.Host)
	}
	if id == "" {
		s.control.ServeHTTP(rw, r)
		return
	}
	p, err := strconv.Atoi(port)
	if port == "" {
		p, err = EnvdPort, nil
	}
	if err != nil || p <= 0 || p > 65535 {
		writeError(rw, fmt.Errorf("bad E2b-Sandbox-Port %q: give a port number: %w", port, errdefs.ErrInvalidArgument))
		return
	}
	if err := api.ValidName(id); err != nil {
		writeError(rw, fmt.Errorf("bad E2b-Sandbox-Id: %v: %w", err, errdefs.ErrInvalidArgument))
		return
	}
	s.toSandbox(rw, r, id, p)
}

// toSandbox serves a request to sandbox id's port p (envd's, or a
// server's), or, on a gateway's front, relays it to the sandbox's
// worker.
func (s *Server) toSandbox(rw http.ResponseWriter, r *http.Request, id string, p int) {
	if s.opts.Fleet != nil {
		token := r.Header.Get("X-Access-Token")
		if token == "" && p != EnvdPort {
			token = r.Header.Get("E2b-Traffic-Access-Token")
		}
		s.relaySandbox(rw, r, id, p, token)
		return
	}
	r = r.WithContext(context.WithValue(r.Context(), sandboxKey{}, id))
	if p != EnvdPort {
		s.proxy(rw, r, id, p)
		return
	}
	s.envd.ServeHTTP(rw, r)
}

type sandboxKey struct{}

// sandboxOf is the sandbox an envd request is for.
func sandboxOf(ctx context.Context) string { id, _ := ctx.Value(sandboxKey{}).(string); return id }

// hostRoute reads PORT-ID.DOMAIN, the host form of the SDKs that route
// by name.
func hostRoute(host string) (id, port string) {
	label, _, ok := strings.Cut(host, ".")
	if !ok {
		return "", ""
	}
	port, id, ok = strings.Cut(label, "-")
	if !ok || id == "" {
		return "", ""
	}
	if _, err := strconv.Atoi(port); err != nil || api.ValidName(id) != nil {
		return "", ""
	}
	return id, port
}

// caller is who a request comes from, once its key or access token
// was checked: a token's ID ("": the worker's own socket's, the admin,
// which only a record made over it has as its owner). token is the
// token itself as a gateway vouched for it (auth.OnBehalf's: its scope,
// quota and allowances), on a request it relayed.
type caller struct {
	id    string
	admin bool
	token string
	// byAccess: a relayed request whose caller is the sandbox's owner
	// for its access token, which must then be valid here.
	byAccess bool
}

// as is the worker's API with who's authority.
func (s *Server) as(who caller) *sdk.Client {
	id := who.id
	if id == "" {
		id = ActAsAdmin
	}
	c, _ := sdk.New(sdk.Options{Host: "tcp://dsec-worker:0", Token: "in-process", Transport: actAs{s.opts.Transport, id, who.token}})
	return c
}

// actAs adds the front's headers to a request to the worker.
type actAs struct {
	base  http.RoundTripper
	id    string
	token string
}

type templateKey struct{}

// SetTemplates makes more template IDs besides the config's (which
// win a name both have): a gateway's, its SandboxTemplate objects. Each
// call replaces the last.
func (s *Server) SetTemplates(more map[string]api.SandboxSpec) {
	s.more.Store(&more)
}

// templateOf is the template id names, the config's or SetTemplates's,
// as a copy the caller may change.
func (s *Server) templateOf(id string) (api.SandboxSpec, bool) {
	t, ok := s.opts.Templates[id]
	if !ok {
		if more := s.more.Load(); more != nil {
			t, ok = (*more)[id]
		}
	}
	t.Layers, t.Env = slices.Clone(t.Layers), slices.Clone(t.Env)
	return t, ok
}

// withTemplate marks ctx's create as the config's template name.
func withTemplate(ctx context.Context, name string) context.Context {
	return context.WithValue(ctx, templateKey{}, name)
}

func (a actAs) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set(HeaderActAs, a.id)
	r.Header.Del(HeaderActAsToken)
	if a.token != "" {
		r.Header.Set(HeaderActAsToken, a.token)
	}
	r.Header.Del("Authorization")
	if name, _ := r.Context().Value(templateKey{}).(string); name != "" {
		r.Header.Set(HeaderTemplate, name)
	}
	if rec, _ := r.Context().Value(recordKey{}).(string); rec != "" && r.Method == http.MethodPost {
		r.Header.Set(HeaderRecord, rec)
	}
	return a.base.RoundTrip(r)
}

// authorize checks a key, before anything of its request is read.
func (s *Server) authorize(key string) (caller, error) {
	if key == "" {
		return caller{}, fmt.Errorf("no API key: set E2B_API_KEY to a dsec token (dsec token create --e2b): %w", errdefs.ErrUnauthenticated)
	}
	id, admin, err := s.opts.Authorize(key)
	if err != nil {
		return caller{}, fmt.Errorf("unauthorized: %w", errdefs.ErrUnauthenticated)
	}
	return caller{id: id, admin: admin}, nil
}

// envdKey is the front's key for the sandboxes' envd access tokens, made
// once and kept in dir.
func envdKey(dir string) ([]byte, error) {
	path := filepath.Join(dir, "envd.key")
	if b, err := os.ReadFile(path); err == nil && len(b) == 32 {
		return b, nil
	}
	b := make([]byte, 32)
	rand.Read(b)
	if err := durable.WriteFile(path, b, 0o600); err != nil {
		return nil, err
	}
	return b, nil
}

// envdPrefix starts a sandbox's envd access token.
const envdPrefix = "envd_"

// accessToken is rec's sandbox's envd access token: what create and
// connect answer as envdAccessToken and the SDK sends back on every
// envd request. It opens that sandbox alone: never another, nor the
// control plane ("": the sandbox's ID is not known yet).
func (s *Server) accessToken(rec record) string {
	if rec.Sandbox == "" || s.key == nil { // (a gateway's front: its workers' fronts know them)
		return ""
	}
	m := hmac.New(sha256.New, s.key)
	m.Write([]byte("envd\x00" + rec.Sandbox))
	return envdPrefix + hex.EncodeToString(m.Sum(nil))
}

// envdCaller is who an envd (or port) request for sandbox id comes
// from, by its token: the sandbox's access token is its owner; a key is
// its token's, which sees only its own sandboxes (another's is not
// found, as on the API).
func (s *Server) envdCaller(id, token string) (caller, error) {
	rec, ok := s.records.get(id)
	if strings.HasPrefix(token, envdPrefix) {
		if want := s.accessToken(rec); ok && want != "" && hmac.Equal([]byte(token), []byte(want)) &&
			(rec.Owner == "" || s.opts.Live == nil || s.opts.Live(rec.Owner)) {
			return caller{id: rec.Owner}, nil
		}
		return caller{}, fmt.Errorf("unauthorized: %w", errdefs.ErrUnauthenticated)
	}
	who, err := s.authorize(token)
	if err != nil {
		return caller{}, err
	}
	if ok && !who.admin && rec.Owner != who.id {
		return caller{}, fmt.Errorf("sandbox %s not found: %w", id, errdefs.ErrNotFound)
	}
	return who, nil
}

// hold holds a request slot of who's for the request it serves now.
func (s *Server) hold(who caller) (func(), error) {
	if s.opts.Hold == nil {
		return func() {}, nil
	}
	return s.opts.Hold(who.id, who.admin || who.id == "")
}

type callerKey struct{}

func withCaller(ctx context.Context, who caller) context.Context {
	return context.WithValue(ctx, callerKey{}, who)
}

func callerOf(ctx context.Context) caller { c, _ := ctx.Value(callerKey{}).(caller); return c }

// errorBody is E2B's error: the SDKs key on its code, the HTTP status.
type errorBody struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// statusOf is the HTTP status E2B gives err's class.
func statusOf(err error) int {
	switch {
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout
	case errdefs.IsNotFound(err):
		return http.StatusNotFound
	case errdefs.IsInvalidArgument(err):
		return http.StatusBadRequest
	case errdefs.IsAlreadyExists(err), errdefs.IsFailedPrecondition(err):
		return http.StatusConflict
	case errdefs.IsUnauthorized(err):
		return http.StatusUnauthorized
	case errdefs.IsPermissionDenied(err):
		return http.StatusForbidden
	case errdefs.IsResourceExhausted(err):
		return http.StatusTooManyRequests
	case errdefs.IsOutOfRange(err):
		return http.StatusRequestEntityTooLarge
	case errdefs.IsNotImplemented(err):
		return http.StatusNotImplemented
	case errdefs.IsUnavailable(err):
		return http.StatusBadGateway
	}
	return http.StatusInternalServerError
}

// writeError answers err as E2B does; a full worker's with Retry-After,
// which the SDKs retry on.
func writeError(rw http.ResponseWriter, err error) {
	code := statusOf(err)
	if code == http.StatusTooManyRequests {
		rw.Header().Set("Retry-After", "1")
	}
	msg := err.Error()
	if code == http.StatusUnauthorized {
		msg = "unauthorized: give a valid API key (a dsec token: dsec token create --e2b)"
	}
	writeJSON(rw, code, errorBody{Code: code, Message: msg})
}

// connectErrors writes a Connect RPC's error in its protocol.
var connectErrors = connect.NewErrorWriter()

// refuse answers a request refused before anything of its body was
// read: an RPC as its protocol says, the rest as E2B's errors; over
// HTTP/1 its connection closes after (else the server would read what
// is left of the body first, which a client may never send).
func refuse(rw http.ResponseWriter, r *http.Request, err error) {
	if r.ProtoMajor == 1 {
		rw.Header().Set("Connection", "close")
	}
	if connectErrors.IsSupported(r) {
		connectErrors.Write(rw, r, connErr(err))
		return
	}
	writeError(rw, err)
}

func writeJSON(rw http.ResponseWriter, code int, v any) {
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(code)
	json.NewEncoder(rw).Encode(v)
}

// Run keeps the sandboxes' timeouts until ctx ends: one past its end is
// removed, or paused where its lifecycle says so. (A gateway's front
// keeps none: the workers' fronts do.)
func (s *Server) Run(ctx context.Context) {
	if s.opts.Fleet != nil {
		return
	}
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.expire(ctx, time.Now())
	}
}

// expire acts on every record whose time is up at now, with the
// authority of the sandbox's owner, on that very sandbox (its ID).
func (s *Server) expire(ctx context.Context, now time.Time) {
	for _, rec := range s.records.all() {
		if rec.EndAt.IsZero() || now.Before(rec.EndAt) || rec.Expired {
			continue
		}
		sb := s.as(caller{id: rec.Owner}).Sandbox(rec.ID)
		info, err := sb.Inspect(ctx)
		if err == nil && rec.Sandbox != "" && info.ID != rec.Sandbox {
			err = fmt.Errorf("sandbox %s is another now: %w", rec.ID, errdefs.ErrNotFound)
		}
		if err == nil {
			if rec.OnTimeout == "pause" {
				err = s.pauseSandbox(ctx, sb, rec.PauseMemory)
				if errdefs.IsFailedPrecondition(err) { // paused already
					err = nil
				}
				if err == nil {
					err = s.records.update(rec.ID, func(r *record) { r.Expired = true })
				}
			} else {
				err = s.kill(ctx, sb, rec.ID)
			}
		}
		switch {
		case errdefs.IsNotFound(err):
			s.records.drop(rec)
		case err != nil:
			s.opts.Log.Warn("e2b: cannot end a sandbox past its timeout", "sandbox", rec.ID, "action", rec.OnTimeout, "err", err)
		default:
			s.opts.Log.Info("e2b: a sandbox's timeout passed", "sandbox", rec.ID, "action", cmp.Or(rec.OnTimeout, "kill"))
		}
	}
}
