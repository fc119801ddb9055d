package e2b

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/url"
	"runtime"
	"slices"
	"sort"
	"strconv"
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

// newSandbox is NewSandbox (POST /sandboxes) and NewSandboxV2 (POST
// /v2/sandboxes): the fields dsec acts on. The rest (mcp, which the SDK
// itself starts, secure) are taken and ignored.
type newSandbox struct {
	TemplateID      string                  `json:"templateID"`
	Timeout         *int64                  `json:"timeout"`
	AutoPause       bool                    `json:"autoPause"`
	AutoPauseMemory *bool                   `json:"autoPauseMemory"`
	AutoResume      *struct{ Enabled bool } `json:"autoResume"`
	Metadata        map[string]string       `json:"metadata"`
	EnvVars         map[string]string       `json:"envVars"`
	Network         *networkConfig          `json:"network"`
	VolumeMounts    []json.RawMessage       `json:"volumeMounts"`
}

// networkConfig is SandboxNetworkConfig: dsec's network is its policy's
// (the template's), so only what asks for nothing more is taken.
type networkConfig struct {
	AllowOut []string        `json:"allowOut"`
	DenyOut  []string        `json:"denyOut"`
	Rules    json.RawMessage `json:"rules"`
	Egress   json.RawMessage `json:"egressProxy"`
}

// given says whether a JSON value asks for something.
func given(v json.RawMessage) bool {
	switch strings.TrimSpace(string(v)) {
	case "", "null", "{}", "[]":
		return false
	}
	return true
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

// newID is a sandbox id as E2B's look: 20 lower-case letters and
// digits, a letter first (a DNS label, for PORT-ID.DOMAIN hosts).
func newID() string {
	const alnum = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, 20)
	rand.Read(b)
	for i := range b {
		n := len(alnum)
		if i == 0 {
			n = 26
		}
		b[i] = alnum[int(b[i])%n]
	}
	return string(b)
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

// template is the sandbox spec a template ID stands for: one the config
// names (then ctx says so to the worker: its layers and limits are the
// admin's), a snapshot of the caller's (NAME:STEP, as createSnapshot
// answers), or a single layer ref the caller may name.
func (s *Server) template(ctx context.Context, c *sdk.Client, id string) (context.Context, api.SandboxSpec, error) {
	if id == "" {
		return ctx, api.SandboxSpec{}, fmt.Errorf("no templateID: name a template of the config's e2b.templates, a snapshot or a layer: %w", errdefs.ErrInvalidArgument)
	}
	if t, ok := s.templateOf(id); ok {
		return withTemplate(ctx, id), t, nil
	}
	if strings.Contains(id, ":") {
		if _, err := c.Snapshot(ctx, id); err == nil {
			return ctx, api.SandboxSpec{Snapshot: id}, nil
		} else if !errdefs.IsNotFound(err) {
			return ctx, api.SandboxSpec{}, err
		}
	}
	if looksLikeImage(id) {
		return ctx, api.SandboxSpec{Image: strings.TrimPrefix(id, "docker://")}, nil
	}
	return ctx, api.SandboxSpec{Layers: []string{id}}, nil
}

// imageOf is the image a create's metadata names under one of the image
// keys, if any.
func (s *Server) imageOf(md map[string]string) string {
	keys := s.opts.ImageKeys
	if keys == nil {
		keys = []string{"image"}
	}
	for _, k := range keys {
		if v := strings.TrimSpace(md[k]); v != "" {
			return v
		}
	}
	return ""
}

// looksLikeImage says whether a template ID names a container image
// rather than a layer: docker:// or oci://, or a name whose first
// component is a registry (it holds a '.' or a ':', or is localhost,
// as Docker reads names). A Docker Hub name is a layer's unless it
// says docker:// (python:3.12 could be either).
func looksLikeImage(id string) bool {
	if strings.HasPrefix(id, "docker://") || strings.HasPrefix(id, "oci://") {
		return true
	}
	first, _, ok := strings.Cut(id, "/")
	return ok && (strings.ContainsAny(first, ".:") || first == "localhost")
}

func (s *Server) create(rw http.ResponseWriter, r *http.Request, c *sdk.Client, who caller) error {
	var req newSandbox
	if err := decode(r, &req); err != nil {
		return err
	}
	if len(req.VolumeMounts) > 0 {
		return fmt.Errorf("volume mounts are not supported: put the files in a layer of the template: %w", errdefs.ErrInvalidArgument)
	}
	if n := req.Network; n != nil && (len(n.AllowOut) > 0 || len(n.DenyOut) > 0 || given(n.Rules) || given(n.Egress)) {
		return fmt.Errorf("network rules per create are not supported: a sandbox's network is its template's dsec policy (e2b.templates.NAME.policy): %w", errdefs.ErrInvalidArgument)
	}
	timeout, err := timeoutOf(req.Timeout, defaultTimeout)
	if err != nil {
		return err
	}
	var ctx context.Context
	var spec api.SandboxSpec
	if img := s.imageOf(req.Metadata); img != "" {
		ctx, spec = r.Context(), api.SandboxSpec{Image: img}
		if t, ok := s.templateOf(req.TemplateID); ok {
			ctx, spec = withTemplate(ctx, req.TemplateID), t
			spec.Image = img
		}
	} else if ctx, spec, err = s.template(r.Context(), c, req.TemplateID); err != nil {
		return err
	}
	if err := checkMetadata(req.Metadata); err != nil {
		return err
	}
	if spec.Image != "" && spec.User == "" {
		// E2B names a command's user: root is root, not the image's
		// USER, which the worker would make the sandbox's default (a
		// uid: an image may have no /etc/passwd).
		spec.User = "0"
	}
	spec.Name = newID()
	keys := slices.Sorted(maps.Keys(req.EnvVars))
	for _, k := range keys {
		if k == "" || strings.ContainsAny(k, "=\x00") {
			return fmt.Errorf("bad environment variable name %q: %w", k, errdefs.ErrInvalidArgument)
		}
		spec.Env = append(spec.Env, k+"="+req.EnvVars[k])
	}
	now := time.Now().UTC()
	rec := record{ID: spec.Name, Owner: who.id, Template: req.TemplateID, Metadata: req.Metadata, EnvVars: req.EnvVars, Started: now, EndAt: now.Add(timeout), NextPID: 1}
	if req.AutoPause {
		rec.OnTimeout, rec.PauseMemory = "pause", req.AutoPauseMemory == nil || *req.AutoPauseMemory
	}
	rec.AutoResume = req.AutoResume != nil && req.AutoResume.Enabled
	if s.opts.Fleet != nil {
		return s.createOnWorker(rw, ctx, c, spec, rec)
	}
	// The record first: a sandbox never runs without its timeout.
	if err := s.records.put(rec); err != nil {
		return err
	}
	sb, err := c.Create(ctx, spec)
	if err != nil {
		s.records.remove(rec.ID)
		if errdefs.IsNotFound(err) {
			return fmt.Errorf("template %s not found: %w", req.TemplateID, err)
		}
		return err
	}
	if err := s.records.created(rec.ID, sb.Info.ID); err != nil {
		return err
	}
	rec, _ = s.records.get(rec.ID)
	s.opts.Log.Info("e2b: created a sandbox", "sandbox", rec.ID, "template", rec.Template, "timeout", timeout)
	writeJSON(rw, http.StatusCreated, s.answer(r.Context(), rec))
	return nil
}

// createOnWorker is create's end on a gateway's front: the record goes
// with the create to the worker it is placed on, which keeps it from
// before the sandbox runs and answers its access token.
func (s *Server) createOnWorker(rw http.ResponseWriter, ctx context.Context, c *sdk.Client, spec api.SandboxSpec, rec record) error {
	b, _ := json.Marshal(rec)
	raw := base64.RawURLEncoding.EncodeToString(b)
	if len(raw) > maxRecordHeader {
		return fmt.Errorf("metadata too large for a gateway to pass to its worker (the sandbox's record is %d bytes, up to %d KiB): send less: %w",
			len(b), maxRecordHeader*3/4>>10, errdefs.ErrInvalidArgument)
	}
	sb, err := c.Create(context.WithValue(ctx, recordKey{}, raw), spec)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return fmt.Errorf("template %s not found: %w", rec.Template, err)
		}
		return err
	}
	st := sb.Info.E2B
	if st == nil || st.AccessToken == "" {
		// A worker that knew no E2B record: one older than its gateway.
		sb.Remove(context.WithoutCancel(ctx), true)
		return fmt.Errorf("worker %s keeps no E2B state (older than this gateway? upgrade it): %w", sb.Info.Node, errdefs.ErrNotImplemented)
	}
	a := s.answer(ctx, rec)
	a.EnvdAccessToken = st.AccessToken
	s.opts.Log.Info("e2b: created a sandbox", "sandbox", rec.ID, "template", rec.Template, "node", sb.Info.Node, "timeout", rec.EndAt.Sub(rec.Started))
	writeJSON(rw, http.StatusCreated, a)
	return nil
}

// recordKey marks a create a gateway's front sends with its record
// (HeaderRecord).
type recordKey struct{}

// maxRecordHeader bounds a HeaderRecord: a worker reads at most 64 KiB
// of a request's headers.
const maxRecordHeader = 40 << 10

// checkMetadata bounds what a record keeps.
func checkMetadata(m map[string]string) error {
	n := 0
	for k, v := range m {
		n += len(k) + len(v)
	}
	if len(m) > 256 || n > 64<<10 {
		return fmt.Errorf("metadata too large: up to 256 keys and 64 KiB: %w", errdefs.ErrInvalidArgument)
	}
	return nil
}

// recordOf is the record of a sandbox the caller sees (one dsec made
// outside E2B gets one as its template its top layer).
func (s *Server) recordOf(sb api.Sandbox) record {
	if rec, ok := s.records.get(sb.Name); ok && (rec.Sandbox == sb.ID || rec.Sandbox == "") {
		return rec
	}
	if st := sb.E2B; st != nil { // its worker's front's (a gateway's front)
		return record{ID: sb.Name, Sandbox: sb.ID, Owner: sb.Owner, Template: st.Template, Metadata: st.Metadata, Started: st.Started,
			EndAt: st.EndAt, OnTimeout: st.OnTimeout}
	}
	tpl := sb.Snapshot
	if tpl == "" && len(sb.Layers) > 0 {
		tpl = sb.Layers[0]
	}
	return record{ID: sb.Name, Sandbox: sb.ID, Owner: sb.Owner, Template: tpl, Started: sb.Created}
}

// stateOf is a sandbox's E2B state: running, or paused (frozen with its
// memory, or stopped with its files).
func stateOf(sb api.Sandbox) string {
	switch sb.Status {
	case api.StatusPaused, api.StatusStopped, api.StatusDead:
		return "paused"
	}
	return "running"
}

// listedSandbox is ListedSandbox; sandboxDetail SandboxDetail.
type listedSandbox struct {
	TemplateID  string            `json:"templateID"`
	SandboxID   string            `json:"sandboxID"`
	ClientID    string            `json:"clientID"`
	StartedAt   time.Time         `json:"startedAt"`
	EndAt       time.Time         `json:"endAt"`
	CPUCount    int               `json:"cpuCount"`
	MemoryMB    int64             `json:"memoryMB"`
	DiskSizeMB  int64             `json:"diskSizeMB"`
	State       string            `json:"state"`
	EnvdVersion string            `json:"envdVersion"`
	Metadata    map[string]string `json:"metadata,omitempty"`
}

type sandboxDetail struct {
	listedSandbox
	EnvdAccessToken string     `json:"envdAccessToken,omitempty"`
	Domain          *string    `json:"domain"`
	Lifecycle       *lifecycle `json:"lifecycle,omitempty"`
}

type lifecycle struct {
	OnTimeout  string `json:"onTimeout"`
	AutoResume bool   `json:"autoResume"`
}

func (s *Server) listed(sb api.Sandbox, rec record) listedSandbox {
	cpus := int(sb.CPU + 0.999)
	if cpus == 0 {
		cpus = runtime.NumCPU()
	}
	return listedSandbox{TemplateID: rec.Template, SandboxID: sb.Name, StartedAt: rec.Started, EndAt: rec.EndAt,
		CPUCount: cpus, MemoryMB: cmp.Or(sb.MemoryLimit, sb.Memory) >> 20, DiskSizeMB: cmp.Or(sb.DiskLimit, sb.Disk) >> 20,
		State: stateOf(sb), EnvdVersion: EnvdVersion, Metadata: rec.Metadata}
}

func (s *Server) list(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	q := r.URL.Query()
	want, err := metadataQuery(q.Get("metadata"))
	if err != nil {
		return err
	}
	states := map[string]bool{}
	for _, st := range strings.Split(q.Get("state"), ",") {
		switch st {
		case "":
		case "running", "paused":
			states[st] = true
		default:
			return fmt.Errorf("bad state %q: give running or paused: %w", st, errdefs.ErrInvalidArgument)
		}
	}
	limit := 100
	if l := q.Get("limit"); l != "" {
		if limit, err = strconv.Atoi(l); err != nil || limit < 1 || limit > 100 {
			return fmt.Errorf("bad limit %q: give 1 to 100: %w", l, errdefs.ErrInvalidArgument)
		}
	}
	var after time.Time
	if a := q.Get("startedAfter"); a != "" {
		if after, err = time.Parse(time.RFC3339, a); err != nil {
			return fmt.Errorf("bad startedAfter %q: give an RFC 3339 time: %w", a, errdefs.ErrInvalidArgument)
		}
	}
	sbs, err := c.List(r.Context())
	if err != nil {
		return err
	}
	var out []listedSandbox
	for _, sb := range sbs {
		rec := s.recordOf(sb)
		ls := s.listed(sb, rec)
		if len(states) > 0 && !states[ls.State] || !after.IsZero() && !rec.Started.After(after) ||
			q.Get("template") != "" && q.Get("template") != rec.Template || !matches(rec.Metadata, want) {
			continue
		}
		out = append(out, ls)
	}
	desc := q.Get("order") == "desc"
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if !a.StartedAt.Equal(b.StartedAt) {
			return a.StartedAt.Before(b.StartedAt) != desc
		}
		return a.SandboxID < b.SandboxID
	})
	// The token is the last id of the page before: stable while
	// sandboxes come and go.
	if tok := q.Get("nextToken"); tok != "" {
		i := slices.IndexFunc(out, func(l listedSandbox) bool { return l.SandboxID == tok })
		if i < 0 {
			return fmt.Errorf("bad nextToken %q: the sandbox it continues after is gone: list from the start: %w", tok, errdefs.ErrInvalidArgument)
		}
		out = out[i+1:]
	}
	if len(out) > limit {
		out = out[:limit]
		rw.Header().Set("X-Next-Token", out[limit-1].SandboxID)
	}
	if out == nil {
		out = []listedSandbox{}
	}
	writeJSON(rw, http.StatusOK, out)
	return nil
}

// metadataQuery reads the list's metadata filter: a query string whose
// keys and values the SDK also escaped.
func metadataQuery(v string) (map[string]string, error) {
	if v == "" {
		return nil, nil
	}
	q, err := url.ParseQuery(v)
	if err != nil {
		return nil, fmt.Errorf("bad metadata filter %q: give k=v&k2=v2: %w", v, errdefs.ErrInvalidArgument)
	}
	out := map[string]string{}
	for k, vs := range q {
		uk, err1 := url.QueryUnescape(k)
		uv, err2 := url.QueryUnescape(vs[0])
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("bad metadata filter %q: %w", v, errdefs.ErrInvalidArgument)
		}
		out[uk] = uv
	}
	return out, nil
}

func matches(have, want map[string]string) bool {
	for k, v := range want {
		if hv, ok := have[k]; !ok || hv != v {
			return false
		}
	}
	return true
}

func (s *Server) info(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	sb, err := inspect(r.Context(), c, r.PathValue("id"))
	if err != nil {
		return err
	}
	if err := s.ensureRecord(sb); err != nil {
		return err
	}
	rec := s.recordOf(sb)
	d := sandboxDetail{listedSandbox: s.listed(sb, rec), EnvdAccessToken: s.accessToken(rec),
		Lifecycle: &lifecycle{OnTimeout: cmp.Or(rec.OnTimeout, "kill"), AutoResume: rec.AutoResume}}
	if dom := s.domain(r.Context()); dom != "" {
		d.Domain = &dom
	}
	writeJSON(rw, http.StatusOK, d)
	return nil
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

func (s *Server) metrics(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	sb, err := inspect(r.Context(), c, r.PathValue("id"))
	if err != nil {
		return err
	}
	ls := s.listed(sb, s.recordOf(sb))
	now := time.Now().UTC()
	writeJSON(rw, http.StatusOK, []map[string]any{{
		"timestamp": now, "timestampUnix": now.Unix(), "cpuCount": ls.CPUCount, "cpuUsedPct": 0.0,
		"memUsed": sb.MemoryBytes, "memTotal": sb.MemoryLimit, "memCache": 0, "diskUsed": sb.DiskUsed, "diskTotal": sb.DiskLimit,
	}})
	return nil
}
