package worker

import (
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/durable"
)

// What a worker keeps for the gateways of its fleet, so that a gateway
// holds nothing of its own that another replica, or itself restarted,
// would lack: its cordon and the names claimed here.

// cordonFile is the worker's cordon (there: cordoned).
func (w *worker) cordonFile() string { return filepath.Join(w.cfg.Root, "cordoned") }

// cordoned says whether gateways are to place no create here.
func (w *worker) cordoned() bool {
	_, err := os.Stat(w.cordonFile())
	return err == nil
}

// cordon cordons the worker, or lifts it (PUT /v1/cordon, an admin's).
func (w *worker) cordon(_ *http.Request, req api.CordonRequest) (api.CordonRequest, error) {
	if !req.Cordoned {
		if err := os.Remove(w.cordonFile()); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return api.CordonRequest{}, err
		}
		return req, durable.SyncDir(w.cfg.Root)
	}
	return req, durable.WriteFile(w.cordonFile(), nil, 0o600)
}

// claim is a name claimed here: by whom, until when, and whether its
// create is over.
type claim struct {
	holder string
	until  time.Time
	made   bool
}

// The bounds of a claim's time: a create renews its claim well within
// the most it may ask.
const (
	claimTTL    = 30 * time.Second
	maxClaimTTL = 10 * time.Minute
)

// claimNames claims names for a gateway's create, all or none, or
// releases them (POST /v1/claims, an admin's): a name claimed by
// another holder, or held by a sandbox here, is refused as a worker
// refuses a name it holds.
func (w *worker) claimNames(_ *http.Request, req api.ClaimRequest) (none, error) {
	if len(req.Names) == 0 || len(req.Names) > api.MaxClaims {
		return none{}, fmt.Errorf("a claim names 1 to %d sandbox names, not %d: %w", api.MaxClaims, len(req.Names), errdefs.ErrInvalidArgument)
	}
	if req.Holders != nil && len(req.Holders) != len(req.Names) {
		return none{}, fmt.Errorf("a claim names %d holders for %d names: %w", len(req.Holders), len(req.Names), errdefs.ErrInvalidArgument)
	}
	holder := func(i int) string {
		if req.Holders != nil {
			return req.Holders[i]
		}
		return req.Holder
	}
	for i := range req.Names {
		if holder(i) == "" && !req.Release {
			return none{}, fmt.Errorf("a claim names its holder: %w", errdefs.ErrInvalidArgument)
		}
	}
	now := time.Now()
	w.mu.Lock()
	defer w.mu.Unlock()
	for name, c := range w.claims { // (the lapsed go first)
		if now.After(c.until) {
			delete(w.claims, name)
		}
	}
	if req.Release {
		for i, name := range req.Names {
			if c, ok := w.claims[name]; ok && (c.holder == holder(i) || holder(i) == "" && c.made) {
				delete(w.claims, name)
			}
		}
		return none{}, nil
	}
	for i, name := range req.Names {
		c, ok := w.claims[name]
		if ok && c.holder != holder(i) {
			return none{}, fmt.Errorf("sandbox %s already exists, or is being made: give another name, or remove it first (dsec rm): %w", name, errdefs.ErrAlreadyExists)
		}
		if _, held := w.sandboxes[name]; held && !ok { // (a renewal's sandbox may be here: its create made it)
			return none{}, fmt.Errorf("sandbox %s already exists: give another name, or remove it first (dsec rm): %w", name, errdefs.ErrAlreadyExists)
		}
	}
	ttl := min(cmpPositive(time.Duration(req.TTLMillis)*time.Millisecond, claimTTL), maxClaimTTL)
	if w.claims == nil {
		w.claims = map[string]claim{}
	}
	for i, name := range req.Names {
		w.claims[name] = claim{holder: holder(i), until: now.Add(ttl), made: req.Made}
	}
	return none{}, nil
}

// cmpPositive is d if positive, else def.
func cmpPositive(d, def time.Duration) time.Duration {
	if d > 0 {
		return d
	}
	return def
}
