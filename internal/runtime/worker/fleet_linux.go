package worker

import (
	"context"
	"encoding/json"
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

// claim is a name claimed here: by whom, until when.
type claim struct {
	holder string
	until  time.Time
}

// The claims outlive the worker: written to claimsFile at most every
// claimsEvery while they change (and as the worker stops), read as it
// starts, so a worker restarted (its pod rolled) keeps the claims
// homed here, all but those of the last claimsEvery before a crash.
const claimsEvery = 200 * time.Millisecond

// claimsFile holds the claims: claimsState, JSON.
func (w *worker) claimsFile() string { return filepath.Join(w.cfg.Root, "claims.json") }

type claimsState struct {
	Claims   map[string]savedClaim `json:"claims"`
	Released map[string]savedClaim `json:"released"`
}

type savedClaim struct {
	Holder string    `json:"holder"`
	Until  time.Time `json:"until"`
}

// loadClaims reads the claims a worker before this one left, those
// still in force; a file it cannot read is a warning (its claims are
// gone: a window of the claims' time for a name's second create).
func (w *worker) loadClaims() {
	b, err := os.ReadFile(w.claimsFile())
	if errors.Is(err, fs.ErrNotExist) {
		return
	}
	var st claimsState
	if err == nil {
		err = json.Unmarshal(b, &st)
	}
	if err != nil {
		w.log.Warn("the names claimed here before are forgotten", "file", w.claimsFile(), "err", err)
		return
	}
	now := time.Now()
	w.mu.Lock()
	defer w.mu.Unlock()
	w.claims, w.released = map[string]claim{}, map[string]claim{}
	for _, m := range []struct {
		from map[string]savedClaim
		to   map[string]claim
	}{{st.Claims, w.claims}, {st.Released, w.released}} {
		for name, c := range m.from {
			if now.Before(c.Until) && api.ValidName(name) == nil {
				m.to[name] = claim{holder: c.Holder, until: c.Until}
			}
		}
	}
}

// keepClaims writes the claims while they change, until ctx ends or
// stop, and once more then (stop waits for it).
func (w *worker) keepClaims(ctx context.Context) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(claimsEvery)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				w.saveClaims()
				return
			case <-t.C:
				w.saveClaims()
			}
		}
	}()
	return func() { cancel(); <-done }
}

// saveClaims writes the claims if they changed since last written.
func (w *worker) saveClaims() {
	w.mu.Lock()
	if !w.claimsDirty {
		w.mu.Unlock()
		return
	}
	w.claimsDirty = false
	st := claimsState{Claims: map[string]savedClaim{}, Released: map[string]savedClaim{}}
	for name, c := range w.claims {
		st.Claims[name] = savedClaim{c.holder, c.until}
	}
	for name, c := range w.released {
		st.Released[name] = savedClaim{c.holder, c.until}
	}
	w.mu.Unlock()
	b, _ := json.Marshal(st)
	if err := durable.Replace(w.claimsFile(), b, 0o600); err != nil {
		w.log.Warn("cannot keep the names claimed here", "err", err)
		w.mu.Lock()
		w.claimsDirty = true
		w.mu.Unlock()
	}
}

// The bounds of a claim's time: a create renews its claim well within
// the most it may ask. A name released as its sandbox's removal is
// remembered so long, its holder's late settle or renewal ignored.
const (
	claimTTL    = 30 * time.Second
	maxClaimTTL = 10 * time.Minute
	releasedFor = time.Minute
)

// claimNames claims names for gateways' creates (POST /v1/claims, an
// admin's): a claim is all or none, a name claimed by another holder,
// or held by a sandbox here, refused as a worker refuses a name it
// holds; a settle (Made) keeps each name its holder still holds, name
// by name; a release by a holder drops its claims, one by no holder
// (a sandbox removed) whoever's they are.
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
	w.claimsDirty = true
	for name, c := range w.claims { // (the lapsed go first)
		if now.After(c.until) {
			delete(w.claims, name)
		}
	}
	for name, r := range w.released {
		if now.After(r.until) {
			delete(w.released, name)
		}
	}
	if w.claims == nil {
		w.claims, w.released = map[string]claim{}, map[string]claim{}
	}
	gone := func(i int) bool { r, ok := w.released[req.Names[i]]; return ok && r.holder == holder(i) }
	ttl := min(cmpPositive(time.Duration(req.TTLMillis)*time.Millisecond, claimTTL), maxClaimTTL)
	switch {
	case req.Release:
		for i, name := range req.Names {
			if c, ok := w.claims[name]; ok && (c.holder == holder(i) || holder(i) == "") {
				delete(w.claims, name)
				if holder(i) == "" {
					w.released[name] = claim{holder: c.holder, until: now.Add(releasedFor)}
				}
			}
		}
		return none{}, nil
	case req.Made:
		for i, name := range req.Names {
			if c, ok := w.claims[name]; (!ok || c.holder == holder(i)) && !gone(i) {
				w.claims[name] = claim{holder: holder(i), until: now.Add(ttl)}
			}
		}
		return none{}, nil
	}
	for i, name := range req.Names {
		c, ok := w.claims[name]
		if ok && c.holder != holder(i) {
			return none{}, fmt.Errorf("sandbox %s already exists, or is being made: give another name, or remove it first (dsec rm): %w", name, errdefs.ErrAlreadyExists)
		}
		// (A renewal's sandbox may be here: its create made it; one
		// being discarded holds its name no longer, as a create here
		// waits for it.)
		if e, held := w.sandboxes[name]; held && e.gone == nil && !ok && !gone(i) {
			return none{}, fmt.Errorf("sandbox %s already exists: give another name, or remove it first (dsec rm): %w", name, errdefs.ErrAlreadyExists)
		}
	}
	for i, name := range req.Names {
		if gone(i) { // (a renewal of a create whose sandbox was removed)
			continue
		}
		delete(w.released, name)
		w.claims[name] = claim{holder: holder(i), until: now.Add(ttl)}
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
