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
// e2b_<40 hex>, which every 2.x SDK accepts). The front calls the
// worker with it, so a key sees only its own sandboxes, as on dsec's
// TCP API; the key is also the sandbox's envdAccessToken, which the SDK
// sends back on every envd request. The front keeps what E2B knows
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
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/sdk"
)

// EnvdVersion is the envd version the front reports: the SDKs gate
// features on it (closeStdin needs 0.5.2, octet-stream uploads 0.5.7).
const EnvdVersion = "0.5.7"

// EnvdPort is the port the SDKs address envd by.
const EnvdPort = 49983

// Options configure a front.
type Options struct {
	// Dial reaches the worker's API as a TCP client does: every request
	// with the caller's key as its token.
	Dial func(ctx context.Context) (net.Conn, error)
	// Admin is the worker as its admin: what the front does on its own
	// (removing or pausing sandboxes past their timeout).
	Admin *sdk.Client
	// Authorize checks a key as the worker does: the id of its token and
	// whether it is the admin's. The envd requests the front answers from
	// what it holds (a running command's stdin, its list) are the key's
	// only for a sandbox its token owns.
	Authorize func(key string) (id string, admin bool, err error)
	// Dir holds the front's records (one file per sandbox).
	Dir string
	// Templates are the template IDs the config names (e2b.templates);
	// any other ID is a snapshot (NAME:STEP) or a single layer ref.
	Templates map[string]api.SandboxSpec
	// Domain is what the create and connect answers give as the
	// sandboxes' domain (none: the SDK's own default is not used, it
	// routes by headers to E2B_SANDBOX_URL).
	Domain string
	Log    *slog.Logger
}

// Server is the E2B front.
type Server struct {
	opts    Options
	records *records
	control *http.ServeMux
	envd    *http.ServeMux
	procs   *procTable

	mu      sync.Mutex
	clients map[string]*sdk.Client // by key
}

// New makes a front; Run then keeps the sandboxes' timeouts.
func New(opts Options) (*Server, error) {
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	r, err := openRecords(opts.Dir)
	if err != nil {
		return nil, err
	}
	s := &Server{opts: opts, records: r, clients: map[string]*sdk.Client{}, procs: newProcTable()}
	s.control = s.controlRoutes()
	s.envd = s.envdRoutes()
	return s, nil
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

// maxClients bounds the clients kept (one per key seen).
const maxClients = 4096

// client is the worker as the holder of key sees it.
func (s *Server) client(key string) (*sdk.Client, error) {
	if key == "" {
		return nil, fmt.Errorf("no API key: set E2B_API_KEY to a dsec token (dsec token create --e2b): %w", errdefs.ErrUnauthenticated)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if c := s.clients[key]; c != nil {
		return c, nil
	}
	if len(s.clients) >= maxClients {
		clear(s.clients)
	}
	c, err := sdk.New(sdk.Options{Host: "tcp://dsec-worker:0", Token: key, Dial: s.opts.Dial})
	if err != nil {
		return nil, err
	}
	s.clients[key] = c
	return c, nil
}

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

func writeJSON(rw http.ResponseWriter, code int, v any) {
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(code)
	json.NewEncoder(rw).Encode(v)
}

// Run keeps the sandboxes' timeouts until ctx ends: one past its end is
// removed, or paused where its lifecycle says so.
func (s *Server) Run(ctx context.Context) {
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

// expire acts on every record whose time is up at now.
func (s *Server) expire(ctx context.Context, now time.Time) {
	for _, rec := range s.records.all() {
		if rec.EndAt.IsZero() || now.Before(rec.EndAt) || rec.Expired {
			continue
		}
		sb := s.opts.Admin.Sandbox(rec.ID)
		var err error
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
		switch {
		case errdefs.IsNotFound(err):
			s.records.remove(rec.ID)
		case err != nil:
			s.opts.Log.Warn("e2b: cannot end a sandbox past its timeout", "sandbox", rec.ID, "action", rec.OnTimeout, "err", err)
		default:
			s.opts.Log.Info("e2b: a sandbox's timeout passed", "sandbox", rec.ID, "action", cmp.Or(rec.OnTimeout, "kill"))
		}
	}
}
