package e2b

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/sdk"
)

// A create (NewSandbox): its template (a template of the config, a
// snapshot, a layer or an image), its record (timeout, metadata,
// environment) kept from before the sandbox runs, its sandbox made here
// or, on a gateway's front, on the worker it is placed on.

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

// makeSandbox makes spec's sandbox. A template ID taken for a layer
// (spec's one layer) that names none may name an image the store or the
// shared remote holds: python:3.12, once dsec image pull python:3.12
// imported it. Such a name is never fetched from a registry: a typo
// asks no registry, and is as not found as any name that names nothing
// the caller may use (another tenant's layer too).
func makeSandbox(ctx context.Context, c *sdk.Client, spec api.SandboxSpec, templateID string) (*sdk.Sandbox, error) {
	sb, err := c.Create(ctx, spec)
	if !errdefs.IsNotFound(err) || spec.Image != "" || !slices.Equal(spec.Layers, []string{templateID}) {
		return sb, err
	}
	byImage := spec
	byImage.Layers, byImage.Image, byImage.Pull = nil, templateID, api.PullNever
	if byImage.User == "" {
		byImage.User = "0" // as for every image: E2B's root is root
	}
	sb, ierr := c.Create(ctx, byImage)
	if ierr == nil || !errdefs.IsNotFound(ierr) && !errdefs.IsInvalidArgument(ierr) {
		return sb, ierr
	}
	return nil, err // what the template ID names is not found, whatever the image's reason
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
// as Docker reads names). A Docker Hub name is a layer's first
// (python:3.12 could be either), then an image's the store holds
// (makeSandbox), unless it says docker://.
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
	sb, err := makeSandbox(ctx, c, spec, req.TemplateID)
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
	sb, err := makeSandbox(context.WithValue(ctx, recordKey{}, raw), c, spec, rec.Template)
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
