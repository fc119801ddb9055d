package e2b

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/sdk"
)

// The control plane: E2B's REST API (e2b-dev/infra spec/openapi.yml), as
// the SDKs call it. Times are RFC 3339; timeouts are seconds.

// defaultTimeout is a sandbox's timeout when a create names none.
const defaultTimeout = 300 * time.Second

// maxTimeout bounds a timeout (E2B's own plans stop at a day).
const maxTimeout = 30 * 24 * time.Hour

func (s *Server) controlRoutes() *http.ServeMux {
	m := http.NewServeMux()
	h := func(pattern string, fn func(rw http.ResponseWriter, r *http.Request, c *sdk.Client, who caller) error) {
		// A route about one sandbox: on a gateway's front, its worker's.
		one := strings.Contains(pattern, "/sandboxes/{id}")
		m.HandleFunc(pattern, func(rw http.ResponseWriter, r *http.Request) {
			who, ok := relayed(r.Context()) // (its key checked, its slot held)
			if !ok {
				key := r.Header.Get("X-API-KEY")
				if key == "" { // the SDKs up to 2.39 with E2B_ACCESS_TOKEN
					key, _ = strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
				}
				// The key first: nothing of a request without a valid
				// one is read.
				var err error
				if who, err = s.authorize(key); err != nil {
					refuse(rw, r, err)
					return
				}
				release, err := s.hold(who)
				if err != nil {
					refuse(rw, r, err)
					return
				}
				defer release()
			}
			if s.opts.Fleet != nil && one {
				s.relay(rw, r, who) // the body read there, or on the way
				return
			}
			r.Body = bounded(rw, r, maxControlBody)
			if err := fn(rw, r.WithContext(withCaller(r.Context(), who)), s.as(who), who); err != nil {
				writeError(rw, err)
			}
		})
	}
	h("POST /sandboxes", s.create)
	h("POST /v2/sandboxes", s.create)
	h("GET /sandboxes", s.list)
	h("GET /v2/sandboxes", s.list)
	h("GET /sandboxes/{id}", s.info)
	h("DELETE /sandboxes/{id}", s.killReq)
	h("POST /sandboxes/{id}/timeout", s.setTimeout)
	h("POST /sandboxes/{id}/refreshes", s.refresh)
	h("POST /sandboxes/{id}/pause", s.pause)
	h("POST /sandboxes/{id}/resume", s.resume)
	h("POST /sandboxes/{id}/connect", s.connect)
	h("POST /v2/sandboxes/{id}/connect", s.connect)
	h("GET /sandboxes/{id}/metrics", s.metrics)
	h("POST /sandboxes/{id}/fork", s.fork)
	h("POST /sandboxes/{id}/grade", s.grade)
	h("POST /sandboxes/{id}/snapshots", s.snapshot)
	h("GET /snapshots", s.snapshots)
	h("DELETE /templates/{id}", s.deleteSnapshot)
	m.HandleFunc("GET /health", func(rw http.ResponseWriter, _ *http.Request) { rw.WriteHeader(http.StatusOK) })
	m.HandleFunc("/", func(rw http.ResponseWriter, r *http.Request) {
		writeError(rw, fmt.Errorf("%s %s: dsec's E2B front does not serve this (templates are dsec layers and the config's e2b.templates; volumes are not supported): %w",
			r.Method, r.URL.Path, errdefs.ErrNotFound))
	})
	return m
}

// maxControlBody bounds a control plane request's body (JSON), and
// bodyTimeout how long it may take to come.
const (
	maxControlBody = 1 << 20
	bodyTimeout    = 30 * time.Second
)

// bounded is r's body, at most max bytes, read within bodyTimeout:
// a client that sends it slowly holds nothing for long.
func bounded(rw http.ResponseWriter, r *http.Request, max int64) io.ReadCloser {
	return readBy(rw, http.MaxBytesReader(rw, r.Body, max))
}

// readBy is body, to be read whole within bodyTimeout.
func readBy(rw http.ResponseWriter, body io.ReadCloser) io.ReadCloser {
	rc := http.NewResponseController(rw)
	rc.SetReadDeadline(time.Now().Add(bodyTimeout))
	return &deadlineBody{ReadCloser: body, rc: rc}
}

// deadlineBody lifts its read deadline once it was read whole (the
// server's wait for the client's next request must not meet it).
type deadlineBody struct {
	io.ReadCloser
	rc   *http.ResponseController
	done bool
}

func (b *deadlineBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF && !b.done {
		b.done = true
		b.rc.SetReadDeadline(time.Time{})
	}
	return n, err
}

// decode reads a JSON body into v; an empty body leaves v as it is.
func decode(r *http.Request, v any) error {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		var mb *http.MaxBytesError
		if errors.As(err, &mb) {
			return fmt.Errorf("request body over %d bytes: %w", mb.Limit, errdefs.ErrInvalidArgument)
		}
		return err
	}
	if len(strings.TrimSpace(string(b))) == 0 {
		return nil
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("bad request body: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	return nil
}

// sandboxAnswer is Sandbox: what create, connect and resume answer.
type sandboxAnswer struct {
	TemplateID         string  `json:"templateID"`
	SandboxID          string  `json:"sandboxID"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken,omitempty"`
	TrafficAccessToken *string `json:"trafficAccessToken"`
	Domain             *string `json:"domain"`
}

func (s *Server) answer(ctx context.Context, rec record) sandboxAnswer {
	a := sandboxAnswer{TemplateID: rec.Template, SandboxID: rec.ID, EnvdVersion: EnvdVersion, EnvdAccessToken: s.accessToken(rec)}
	if d := s.domain(ctx); d != "" {
		a.Domain = &d
	}
	return a
}

// timeoutOf is a request's timeout in seconds as a duration.
func timeoutOf(sec *int64, def time.Duration) (time.Duration, error) {
	if sec == nil {
		return def, nil
	}
	d := time.Duration(*sec) * time.Second
	if *sec < 0 || d > maxTimeout {
		return 0, fmt.Errorf("bad timeout %d: give seconds from 0 to %d: %w", *sec, int64(maxTimeout/time.Second), errdefs.ErrInvalidArgument)
	}
	if d == 0 {
		return def, nil
	}
	return d, nil
}

// inspect describes sandbox id, a missing one as E2B's 404.
func inspect(ctx context.Context, c *sdk.Client, id string) (api.Sandbox, error) {
	sb, err := c.Sandbox(id).Inspect(ctx)
	if errdefs.IsNotFound(err) {
		return sb, fmt.Errorf("sandbox %s not found: %w", id, errdefs.ErrNotFound)
	}
	return sb, err
}

func (s *Server) killReq(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	id := r.PathValue("id")
	if err := s.kill(r.Context(), c.Sandbox(id), id); err != nil {
		return err
	}
	rw.WriteHeader(http.StatusNoContent)
	return nil
}

// kill removes a sandbox and its record; its processes end with it.
func (s *Server) kill(ctx context.Context, sb *sdk.Sandbox, id string) error {
	err := sb.Remove(ctx, true)
	if errdefs.IsNotFound(err) {
		return fmt.Errorf("sandbox %s not found: %w", id, errdefs.ErrNotFound)
	}
	if err != nil {
		return err
	}
	s.procs.drop(id) // its record went with it (Forget)
	s.opts.Log.Info("e2b: killed a sandbox", "sandbox", id)
	return nil
}

// ensureRecord gives a sandbox made outside E2B a record, so that its
// timeout and processes can be kept (and completes one a create left
// without its sandbox's ID).
func (s *Server) ensureRecord(sb api.Sandbox) error {
	if rec, ok := s.records.get(sb.Name); ok {
		switch rec.Sandbox {
		case sb.ID:
			return nil
		case "":
			return s.records.update(sb.Name, func(r *record) { r.Sandbox = sb.ID })
		}
		s.records.drop(rec) // a sandbox gone while no front ran: not this one's
	}
	rec := s.recordOf(sb)
	rec.NextPID = 1
	return s.records.put(rec)
}

// updateRecord changes the record of a sandbox the caller sees (one
// made outside E2B gets one first).
func (s *Server) updateRecord(ctx context.Context, c *sdk.Client, id string, fn func(*record)) error {
	sb, err := inspect(ctx, c, id)
	if err != nil {
		return err
	}
	if err := s.ensureRecord(sb); err != nil {
		return err
	}
	return s.records.update(sb.Name, fn)
}

func (s *Server) setTimeout(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	var req struct {
		Timeout *int64 `json:"timeout"`
	}
	if err := decode(r, &req); err != nil {
		return err
	}
	if req.Timeout == nil {
		return fmt.Errorf("no timeout: give seconds from now: %w", errdefs.ErrInvalidArgument)
	}
	d, err := timeoutOf(req.Timeout, 0)
	if err != nil {
		return err
	}
	if err := s.updateRecord(r.Context(), c, r.PathValue("id"), func(rec *record) { rec.EndAt, rec.Expired = time.Now().UTC().Add(d), false }); err != nil {
		return err
	}
	rw.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) refresh(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	var req struct {
		Duration *int64 `json:"duration"`
	}
	if err := decode(r, &req); err != nil {
		return err
	}
	d, err := timeoutOf(req.Duration, 60*time.Second)
	if err != nil {
		return err
	}
	end := time.Now().UTC().Add(d)
	if err := s.updateRecord(r.Context(), c, r.PathValue("id"), func(rec *record) { rec.EndAt = later(rec.EndAt, end) }); err != nil {
		return err
	}
	rw.WriteHeader(http.StatusNoContent)
	return nil
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func (s *Server) pause(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	var req struct {
		Memory *bool `json:"memory"`
	}
	if err := decode(r, &req); err != nil {
		return err
	}
	id := r.PathValue("id")
	if _, err := inspect(r.Context(), c, id); err != nil {
		return err
	}
	if err := s.pauseSandbox(r.Context(), c.Sandbox(id), req.Memory == nil || *req.Memory); err != nil {
		return err
	}
	rw.WriteHeader(http.StatusNoContent)
	return nil
}

// pauseSandbox pauses a running sandbox: with its memory, its processes
// frozen (dsec pause); without, stopped with its files (dsec stop), as
// E2B's filesystem-only pause. A paused one is ErrFailedPrecondition.
func (s *Server) pauseSandbox(ctx context.Context, sb *sdk.Sandbox, memory bool) error {
	d, err := sb.Inspect(ctx)
	if err != nil {
		return err
	}
	if stateOf(d) == "paused" {
		return fmt.Errorf("sandbox %s is paused already: %w", sb.Name, errdefs.ErrFailedPrecondition)
	}
	if memory {
		return sb.Pause(ctx)
	}
	return sb.Stop(ctx)
}

// wake resumes a paused sandbox (thaws a frozen one, starts a stopped
// one on its files); it reports whether it was paused.
func wake(ctx context.Context, c *sdk.Client, id string) (bool, error) {
	sb, err := inspect(ctx, c, id)
	if err != nil {
		return false, err
	}
	switch sb.Status {
	case api.StatusPaused:
		return true, c.Sandbox(id).Resume(ctx)
	case api.StatusStopped, api.StatusDead:
		return true, c.Sandbox(id).Start(ctx)
	}
	return false, nil
}

// connect and resume (which refuses a running sandbox): wakeAnswer.
func (s *Server) connect(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	return s.wakeAnswer(rw, r, c, false)
}

func (s *Server) resume(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	return s.wakeAnswer(rw, r, c, true)
}

// wakeAnswer is connect and resume: the sandbox running again (201 when
// it was paused, 200 when it ran; resume of a running one is 409), its
// timeout extended to at least the request's from now.
func (s *Server) wakeAnswer(rw http.ResponseWriter, r *http.Request, c *sdk.Client, mustBePaused bool) error {
	var req struct {
		Timeout *int64 `json:"timeout"`
	}
	if err := decode(r, &req); err != nil {
		return err
	}
	id := r.PathValue("id")
	d, err := timeoutOf(req.Timeout, defaultTimeout)
	if err != nil {
		return err
	}
	sb, err := inspect(r.Context(), c, id)
	if err != nil {
		return err
	}
	if mustBePaused && stateOf(sb) == "running" {
		return fmt.Errorf("sandbox %s is running: %w", id, errdefs.ErrAlreadyExists)
	}
	woke, err := wake(r.Context(), c, id)
	if err != nil {
		return err
	}
	if err := s.ensureRecord(sb); err != nil {
		return err
	}
	end := time.Now().UTC().Add(d)
	if err := s.records.update(id, func(rec *record) { rec.EndAt, rec.Expired = later(rec.EndAt, end), false }); err != nil {
		return err
	}
	rec, _ := s.records.get(id)
	code := http.StatusOK
	if woke {
		code = http.StatusCreated
	}
	writeJSON(rw, code, s.answer(r.Context(), rec))
	return nil
}
