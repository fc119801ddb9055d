package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/durable"
	"github.com/dsec-project/dsec/internal/policy"
)

// Named policies live in <root>/policies/NAME.json, as validated JSON.

func (w *worker) policyPath(name string) (string, error) {
	if !policy.ValidName(name) {
		return "", fmt.Errorf("policy name %q: use letters, digits, '.', '_' and '-': %w", name, errdefs.ErrInvalidArgument)
	}
	return filepath.Join(w.cfg.Root, "policies", name+".json"), nil
}

func (w *worker) loadPolicy(name string) (*api.Policy, error) {
	p, err := w.policyPath(name)
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("no policy %s (dsec policy ls lists them; dsec policy save stores one): %w", name, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	return policy.Parse(b)
}

// policyOf is the policy a request names: inline, stored, or none.
func (w *worker) policyOf(p *api.Policy, name string) (*api.Policy, error) {
	switch {
	case p != nil && name != "":
		return nil, fmt.Errorf("give a policy or a policy name, not both: %w", errdefs.ErrInvalidArgument)
	case name != "":
		return w.loadPolicy(name)
	case p != nil:
		return p, policy.Validate(p)
	}
	return nil, nil
}

func (w *worker) applyPolicy(r *http.Request, req api.PolicyRequest) (*api.PolicyReport, error) {
	if t := tenantOf(r.Context()); t != nil && !t.May(auth.AllowPolicy) {
		return nil, errNotAllowed(t, auth.AllowPolicy, "change its sandboxes' policies: they keep the one they were made with")
	}
	p, err := w.policyOf(req.Policy, req.Name)
	if err == nil && p == nil {
		err = fmt.Errorf("apply needs a policy or a policy name: %w", errdefs.ErrInvalidArgument)
	}
	if err != nil {
		return nil, err
	}
	e, err := w.get(r)
	if err != nil {
		return nil, err
	}
	e.op.Lock()
	rep, err := e.sb.ApplyPolicy(context.WithoutCancel(r.Context()), p)
	if err == nil && req.Reset {
		var n int
		n, err = e.sb.ResetConnections()
		rep.Now = append(rep.Now, fmt.Sprintf("network: %d connections the policy no longer allows reset", n))
	}
	e.op.Unlock()
	if err != nil {
		return nil, err
	}
	w.log.Info("applied policy", "sandbox", e.sb.Name, "now", rep.Now, "new_processes", rep.NewProcesses)
	return rep, nil
}

// policies lists the stored policies: those a tenant may name, to one.
func (w *worker) policies(r *http.Request, _ none) ([]api.Policy, error) {
	files, _ := filepath.Glob(filepath.Join(w.cfg.Root, "policies", "*.json"))
	sort.Strings(files)
	out := []api.Policy{}
	for _, f := range files {
		name := filepath.Base(f)
		if !mayName(r.Context(), name[:len(name)-len(".json")]) {
			continue
		}
		p, err := w.loadPolicy(name[:len(name)-len(".json")])
		if err != nil {
			return nil, err
		}
		out = append(out, *p)
	}
	return out, nil
}

func (w *worker) getPolicy(r *http.Request, _ none) (*api.Policy, error) {
	if !mayName(r.Context(), r.PathValue("name")) {
		return nil, fmt.Errorf("no policy %s (dsec policy ls lists them; dsec policy save stores one): %w", r.PathValue("name"), errdefs.ErrNotFound)
	}
	return w.loadPolicy(r.PathValue("name"))
}

// mayName says whether ctx's caller may name the stored policy name.
func mayName(ctx context.Context, name string) bool {
	t := tenantOf(ctx)
	return t == nil || len(t.Policies) == 0 || slices.Contains(t.Policies, name)
}

// putPolicy stores a policy under a name (replacing one there; sandboxes
// keep the policy they were given).
func (w *worker) putPolicy(r *http.Request, p api.Policy) (none, error) {
	name := r.PathValue("name")
	path, err := w.policyPath(name)
	if err != nil {
		return none{}, err
	}
	if p.Metadata == nil {
		p.Metadata = &api.PolicyMetadata{}
	}
	p.Metadata.Name = name
	if err := policy.Validate(&p); err != nil {
		return none{}, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return none{}, err
	}
	b, _ := json.MarshalIndent(p, "", "  ")
	return none{}, durable.WriteFile(path, b, 0o600)
}

func (w *worker) deletePolicy(r *http.Request, _ none) (none, error) {
	path, err := w.policyPath(r.PathValue("name"))
	if err != nil {
		return none{}, err
	}
	if err = os.Remove(path); errors.Is(err, os.ErrNotExist) {
		err = fmt.Errorf("no policy %s: %w", r.PathValue("name"), errdefs.ErrNotFound)
	}
	return none{}, err
}
