package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
)

// Creates through the gateway: a sandbox, a batch of them, a call. Each
// is placed (placement.go), its name claimed across the fleet
// (claims.go), and what a worker made is recorded at once, so that it
// routes before the next heartbeat lists it.

// create places a sandbox: a name taken anywhere in the fleet is
// refused as a worker refuses one it holds; else the workers in the
// order of place, the next when one is busy (429) or does not answer.
func (g *Gateway) create(rw http.ResponseWriter, r *http.Request) {
	body, ok := readBody(rw, r)
	if !ok {
		return
	}
	var spec api.SandboxSpec
	json.Unmarshal(body, &spec) // (a bad body is the worker's to refuse)
	var only func(*node) bool
	if spec.Snapshot != "" {
		var err error
		if only, err = g.snapshotTakers(r.Context(), tokenOf(r), spec.Snapshot); err != nil {
			fail(rw, err)
			return
		}
	}
	// made: the sandbox may stand (made, or its answer lost on the way:
	// its claim is kept until the heartbeats say).
	made := true
	if spec.Name != "" {
		c, err := g.claim(r.Context(), []string{spec.Name})
		if err != nil {
			fail(rw, err)
			return
		}
		defer func() { c.done(func(string) bool { return made }) }()
	}
	last, n, settle, err := g.createOne(r.Context(), tokenOf(r), r.URL.RequestURI(), body, demandOf(spec, 1), only)
	if err != nil {
		made = errdefs.IsUnavailable(err) || r.Context().Err() != nil
		fail(rw, err)
		return
	}
	defer last.Body.Close()
	if last.StatusCode != http.StatusCreated {
		made = false
		relay(rw, last)
		return
	}
	sb, err := n.described(last)
	if err != nil {
		settle("")
		fail(rw, err)
		return
	}
	b, _ := json.Marshal(sb)
	var sandbox api.Sandbox
	json.Unmarshal(b, &sandbox)
	sandbox.E2B = nil // (its access token: the caller's alone, never kept here)
	settle(sandbox.Name)
	g.made(n, sandbox)
	answer(rw, http.StatusCreated, sb)
}

// made records a sandbox n made: routed there, and in its list until
// its next heartbeat says (its worker may die before).
func (g *Gateway) made(n *node, sb api.Sandbox) {
	g.mu.Lock()
	g.routes[sb.Name] = n
	g.mu.Unlock()
	n.mu.Lock()
	if !slices.ContainsFunc(n.held, func(s api.Sandbox) bool { return s.Name == sb.Name }) {
		n.held = append(slices.Clip(n.held), sb)
	}
	n.noteChange(sb.Name, true)
	// Pending until a heartbeat lists it: one whose list was asked for
	// before it was made must not take it for gone.
	if _, ok := n.pending[sb.Name]; !ok {
		if n.pending == nil {
			n.pending = map[string]pend{}
		}
		n.pending[sb.Name] = pend{sent: time.Now()}
	}
	n.mu.Unlock()
}

// noteChange notes that this gateway made (or removed) the sandbox name
// on n now; n.mu is held.
func (n *node) noteChange(name string, made bool) {
	if n.changed == nil {
		n.changed = map[string]change{}
	}
	n.changed[name] = change{made: made, at: time.Now()}
}

// forget records that n removed the sandbox name: its name is free at
// once, and its memory no longer counted.
func (g *Gateway) forget(n *node, name string) {
	g.mu.Lock()
	if g.routes[name] == n {
		delete(g.routes, name)
	}
	g.mu.Unlock()
	n.mu.Lock()
	n.held = slices.DeleteFunc(slices.Clone(n.held), func(s api.Sandbox) bool { return s.Name == name })
	n.noteChange(name, false)
	delete(n.pending, name)
	n.mu.Unlock()
}

// createOne sends a create (body, to path) to the workers in the order
// of place, each reserving mem until it answers: the next only when one
// surely never got it (no connection). It returns the answer (its body
// the caller's to close), the worker, and how to settle the
// reservation once the sandbox's name is known (201 only: else it is
// settled).
func (g *Gateway) createOne(ctx context.Context, t *auth.Token, path string, body []byte, d demand, only func(*node) bool) (*http.Response, *node, func(string), error) {
	if rec, _ := ctx.Value(recordKey{}).(string); rec != "" {
		// An E2B front's: to a worker whose front keeps its record (not
		// one older than this gateway, nor one whose front failed).
		only = withE2B(only)
	}
	nodes, settle, err := g.placeNear(d, only, g.nearness(ctx, t, d.layers, only))
	if err != nil {
		return nil, nil, nil, err
	}
	for i, n := range nodes {
		if i > 0 {
			settle = n.reserved(d)
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, n.base.String()+path, bytes.NewReader(body))
		if err != nil {
			settle("")
			return nil, nil, nil, err
		}
		req.Header.Set("Content-Type", "application/json")
		tq, err := g.quotaOn(t, n)
		if err != nil { // (used up on the others)
			settle("")
			return nil, nil, nil, err
		}
		n.authorize(req.Header, tq)
		if name, _ := ctx.Value(templateKey{}).(string); name != "" && t.Scope != auth.Admin {
			req.Header.Set(e2b.HeaderTemplate, name) // the admin's spec, vouched for as the worker's own front does
		}
		if rec, _ := ctx.Value(recordKey{}).(string); rec != "" {
			req.Header.Set(e2b.HeaderRecord, rec) // the E2B front's record, for the worker's front to keep
		}
		resp, err := n.rt.RoundTrip(req)
		if err != nil {
			settle("")
			if ctx.Err() != nil {
				return nil, nil, nil, ctx.Err()
			}
			g.lost(n, err)
			// (Only a create that surely never arrived goes elsewhere:
			// one lost on the way may have been made.)
			var op *net.OpError
			if !errors.As(err, &op) || op.Op != "dial" {
				return nil, nil, nil, n.unreachable(err)
			}
			continue
		}
		if resp.StatusCode != http.StatusCreated {
			settle("")
		}
		if resp.StatusCode == http.StatusUnauthorized {
			resp.Body.Close()
			return nil, nil, nil, n.refused()
		}
		// (A worker's busy or quota refusal is the client's answer.)
		return resp, n, settle, nil
	}
	return nil, nil, nil, fmt.Errorf("no worker took the sandbox: none answered (dsec node ls): %w", errdefs.ErrUnavailable)
}

// withE2B is only, of the workers whose E2B front serves gateways.
func withE2B(only func(*node) bool) func(*node) bool {
	return func(n *node) bool {
		n.mu.Lock()
		e2b := n.info.E2B
		n.mu.Unlock()
		return e2b && (only == nil || only(n))
	}
}

// batch makes a batch's sandboxes over the fleet: each a create placed
// as one is (so a burst spreads by the room each worker has left, its
// creates under way counted), all at once, answered as JSON lines as
// each is made or fails. Its names are checked against the workers'
// last lists, not asked of each.
func (g *Gateway) batch(rw http.ResponseWriter, r *http.Request) {
	var req api.BatchRequest
	lr := &io.LimitedReader{R: r.Body, N: maxBody + 1}
	dec := json.NewDecoder(lr)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		if lr.N == 0 {
			fail(rw, fmt.Errorf("request body over %d KiB: send less: %w", maxBody>>10, errdefs.ErrOutOfRange))
			return
		}
		fail(rw, fmt.Errorf("bad request body: %v: %w", err, errdefs.ErrInvalidArgument))
		return
	}
	if err := req.Validate(); err != nil {
		fail(rw, err)
		return
	}
	var mu sync.Mutex
	made := map[string]bool{} // (under mu)
	if req.Spec.Name != "" {
		names := make([]string, req.Count)
		for i := range names {
			names[i] = api.BatchName(req.Spec.Name, i)
		}
		c, err := g.claim(r.Context(), names)
		if err != nil {
			fail(rw, err)
			return
		}
		defer func() {
			mu.Lock()
			defer mu.Unlock()
			c.done(func(name string) bool { return made[name] })
		}()
	}
	t := tokenOf(r)
	var only func(*node) bool
	if req.Spec.Snapshot != "" {
		var err error
		if only, err = g.snapshotTakers(r.Context(), t, req.Spec.Snapshot); err != nil {
			fail(rw, err)
			return
		}
	}
	rw.Header().Set("Content-Type", "application/x-ndjson")
	rw.WriteHeader(http.StatusOK)
	flush := http.NewResponseController(rw)
	flush.Flush()
	enc := json.NewEncoder(rw)
	var wg sync.WaitGroup
	// So many under way at once, as a worker's own admission would take
	// them (more only wait there, holding the token's request slots).
	under := make(chan struct{}, maxBatchUnderWay)
	for i := range req.Count {
		under <- struct{}{}
		wg.Go(func() {
			defer func() { <-under }()
			item := g.batchItem(r.Context(), t, req.Spec, i, only)
			mu.Lock()
			defer mu.Unlock()
			if item.Sandbox != nil {
				made[item.Sandbox.Name] = true
			}
			enc.Encode(item)
			flush.Flush()
		})
	}
	wg.Wait()
}

// batchItem makes a batch's sandbox i of spec.
func (g *Gateway) batchItem(ctx context.Context, t *auth.Token, spec api.SandboxSpec, i int, only func(*node) bool) api.BatchItem {
	item := api.BatchItem{Index: i}
	if spec.Name != "" {
		spec.Name = api.BatchName(spec.Name, i)
	}
	body, _ := json.Marshal(spec)
	resp, n, settle, err := g.createOne(ctx, t, "/"+api.Version+"/sandboxes", body, demandOf(spec, 1), only)
	if err != nil {
		item.Error, _ = api.ErrorOf(err)
		return item
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		item.Error, _ = api.ErrorOf(errorOf(resp))
		return item
	}
	var sb api.Sandbox
	if err := json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(&sb); err != nil {
		settle("")
		item.Error, _ = api.ErrorOf(fmt.Errorf("worker %s's description of a sandbox: %v: %w", n.URL, err, errdefs.ErrUnavailable))
		return item
	}
	settle(sb.Name)
	g.made(n, sb)
	sb.Node = n.URL
	item.Sandbox = &sb
	return item
}

// call places a call (a sandbox for one command, streamed) as a create
// is placed: on the first worker of place's order.
func (g *Gateway) call(rw http.ResponseWriter, r *http.Request) {
	nodes, settle, err := g.place(demand{}, nil)
	if err != nil {
		fail(rw, err)
		return
	}
	defer settle("") // (a call's sandbox is gone when it answers)
	g.relayTo(nodes[0], rw, r)
}

// maxBatchUnderWay bounds a batch's creates under way at once through a
// gateway.
const maxBatchUnderWay = 64
