package gateway

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
)

// Snapshots in a fleet. A pack-diff is taken on the worker that runs its
// sandbox (a request about the sandbox, relayed), into that worker's
// store, and, where the workers publish them (snap.publish), into their
// shared remote too. So a branch of a snapshot, or a create on one, goes
// to a worker that holds it, or to any worker that publishes to the
// remote (it finds the snapshot there, lazily); a memory snapshot's
// guest goes only where it was taken. A fork (a branch like a sandbox)
// goes to that sandbox's worker.

// snapshotTakers says which workers may take a sandbox on the snapshot
// ref, as t names it: those that hold it and, unless it is a memory
// snapshot, those that publish snapshots to a shared remote. One no
// worker up holds or could find is not found.
func (g *Gateway) snapshotTakers(ctx context.Context, t *auth.Token, ref string) (func(*node) bool, error) {
	if strings.HasPrefix(ref, "sha256:") {
		return nil, nil // (by digest: every worker is asked as a create is)
	}
	holders, memory := g.holders(ctx, t, ref)
	shares := func(n *node) bool {
		n.mu.Lock()
		defer n.mu.Unlock()
		return n.info.PublishesSnapshots
	}
	if len(holders) == 0 && !slices.ContainsFunc(g.all(), shares) {
		return nil, fmt.Errorf("no snapshot %s on any worker up (dsec snap ls lists them): %w", ref, errdefs.ErrNotFound)
	}
	return func(n *node) bool { return slices.Contains(holders, n) || !memory && shares(n) }, nil
}

// holders are the workers up that hold the snapshot ref, as t (nil:
// the admin) names it, and whether it is a memory snapshot.
func (g *Gateway) holders(ctx context.Context, t *auth.Token, ref string) (hs []*node, memory bool) {
	ctx, cancel := context.WithTimeout(ctx, g.cfg.DownAfter)
	defer cancel()
	var mu sync.Mutex
	g.eachUp(g.all(), func(_ int, n *node) {
		var got []api.SnapshotNode
		if n.get(ctx, "/"+api.Version+"/snapshots?name="+url.QueryEscape(ref), t, &got) != nil {
			return
		}
		for _, s := range got {
			if s.Name == ref {
				mu.Lock()
				hs = append(hs, n)
				memory = memory || s.MemoryBytes > 0
				mu.Unlock()
			}
		}
	})
	return hs, memory
}

// eachUp runs f for each worker of nodes up (i its index), all at
// once, and waits for them.
func (g *Gateway) eachUp(nodes []*node, f func(i int, n *node)) {
	var wg sync.WaitGroup
	for i, n := range nodes {
		if n.isUp() {
			wg.Go(func() { f(i, n) })
		}
	}
	wg.Wait()
}

// isUp says whether n answered its last heartbeat.
func (n *node) isUp() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return !n.down && !n.seen.IsZero()
}

// snapshots is every worker's list of the caller's snapshots: one held
// by several (each branched it from the remote) once, its children
// joined.
func (g *Gateway) snapshots(rw http.ResponseWriter, r *http.Request) {
	var out []api.SnapshotNode
	key := func(s api.SnapshotNode) string { return s.Name + "@" + s.Digest }
	if !merged(g, rw, r, &out, key, func(into *api.SnapshotNode, more api.SnapshotNode) {
		for _, c := range more.Children {
			if !slices.Contains(into.Children, c) {
				into.Children = append(into.Children, c)
			}
		}
	}) {
		return
	}
	slices.SortStableFunc(out, func(a, b api.SnapshotNode) int { return a.Created.Compare(b.Created) })
	answer(rw, http.StatusOK, out)
}

// removeSnapshot removes the snapshot from every worker up that holds
// it: done where any did; not found where none did; a refusal (one
// stands on it) is the answer. (A copy published to the remote stays
// there.)
func (g *Gateway) removeSnapshot(rw http.ResponseWriter, r *http.Request) {
	t := tokenOf(r)
	type result struct {
		status int
		err    error
	}
	nodes := g.all()
	results := make([]result, len(nodes))
	g.eachUp(nodes, func(i int, n *node) {
		req, err := http.NewRequestWithContext(r.Context(), http.MethodDelete, n.base.String()+r.URL.RequestURI(), nil)
		if err != nil {
			results[i] = result{err: err}
			return
		}
		n.authorize(req.Header, t)
		resp, err := n.rt.RoundTrip(req)
		if err != nil {
			if r.Context().Err() == nil {
				g.lost(n, err)
			}
			results[i] = result{err: n.unreachable(err)}
			return
		}
		defer resp.Body.Close()
		switch {
		case resp.StatusCode == http.StatusUnauthorized:
			results[i] = result{err: n.refused()}
		case resp.StatusCode/100 == 2:
			results[i] = result{status: resp.StatusCode}
		default:
			results[i] = result{status: resp.StatusCode, err: errorOf(resp)}
		}
	})
	var refusal, notFound error
	removed, refused := 0, []string{}
	for i, res := range results {
		switch {
		case res.status/100 == 2:
			removed++
		case res.status == http.StatusNotFound:
			notFound = cmp.Or(notFound, res.err)
		case res.err != nil:
			refusal = cmp.Or(refusal, res.err)
			refused = append(refused, nodes[i].URL)
		}
	}
	switch {
	case refusal != nil && removed > 0:
		fail(rw, fmt.Errorf("snapshot %s removed from %d workers, not from %s: %w", r.PathValue("ref"), removed, strings.Join(refused, ", "), refusal))
		return
	case refusal != nil:
		fail(rw, refusal)
		return
	case removed > 0:
		rw.WriteHeader(http.StatusNoContent)
		return
	}
	if notFound == nil {
		notFound = fmt.Errorf("no snapshot %s on any worker up (dsec snap ls lists them): %w", r.PathValue("ref"), errdefs.ErrNotFound)
	}
	fail(rw, notFound)
}

// branch places a branch request: a fork (like a sandbox) on that
// sandbox's worker, else on a worker that may take the snapshot
// (snapshotTakers), the one with the most room. Its names are the
// fleet's: without a prefix, numbered on from the last PREFIX-N any
// worker holds.
func (g *Gateway) branch(rw http.ResponseWriter, r *http.Request) {
	body, ok := readBody(rw, r)
	if !ok {
		return
	}
	var req api.BranchRequest
	if err := json.Unmarshal(body, &req); err != nil {
		fail(rw, fmt.Errorf("bad request body: %v: %w", err, errdefs.ErrInvalidArgument))
		return
	}
	if req.Snapshot == "" || req.N < 1 || req.First < 0 {
		fail(rw, fmt.Errorf("a branch needs a snapshot (NAME:STEP; dsec snap ls lists them), a count of 1 or more and no negative first number: %w", errdefs.ErrInvalidArgument))
		return
	}
	t := tokenOf(r)
	var only func(*node) bool
	var err error
	if req.Like != "" {
		n := g.holderNamed(rw, r, req.Like)
		if n == nil {
			return
		}
		only = func(o *node) bool { return o == n }
	} else if only, err = g.snapshotTakers(r.Context(), t, req.Snapshot); err != nil {
		fail(rw, err)
		return
	}
	c, err := g.claimBranches(r.Context(), &req)
	if err != nil {
		fail(rw, err)
		return
	}
	var made []api.Sandbox
	defer func() {
		c.done(func(name string) bool {
			return slices.ContainsFunc(made, func(s api.Sandbox) bool { return s.Name == name })
		})
	}()
	body, _ = json.Marshal(req)
	resp, n, settle, err := g.createOne(r.Context(), t, r.URL.RequestURI(), body, demandOf(req.Spec, req.N), only)
	if err != nil {
		fail(rw, err)
		return
	}
	defer resp.Body.Close()
	defer settle("")
	if resp.StatusCode != http.StatusCreated {
		relay(rw, resp)
		return
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err == nil {
		err = json.NewDecoder(bytes.NewReader(b)).Decode(&made)
	}
	if err != nil {
		fail(rw, fmt.Errorf("worker %s's answer to a branch: %v: %w", n.URL, err, errdefs.ErrUnavailable))
		return
	}
	for i := range made {
		g.made(n, made[i])
		made[i].Node = n.URL
	}
	answer(rw, http.StatusCreated, made)
}

// claimBranches claims a branch request's names as claim does: without
// a prefix, numbered on from the last PREFIX-N (both at once: two
// branches of one snapshot at once take numbers one after the other).
func (g *Gateway) claimBranches(ctx context.Context, req *api.BranchRequest) (*claimed, error) {
	after := 0 // (numbers a home said are taken: the next try goes past)
	for try := 0; ; try++ {
		var first int
		prefix := req.NamePrefix
		if prefix == "" {
			prefix, first = api.BranchPrefix(req.Snapshot), max(g.nextBranch(api.BranchPrefix(req.Snapshot)), after+1)
		}
		names := make([]string, req.N)
		for i := range names {
			names[i] = prefix + "-" + strconv.Itoa(max(cmp.Or(first, req.First), 1)+i)
		}
		c, err := g.claim(ctx, names)
		if err != nil && errdefs.IsAlreadyExists(err) && req.NamePrefix == "" && try < 64 {
			after = first // (taken meanwhile, here or through another gateway: the next numbers)
			continue
		}
		if err == nil && req.NamePrefix == "" {
			req.NamePrefix, req.First = prefix, first
		}
		return c, err
	}
}

// nextBranch is the number after the last PREFIX-N a worker held at its
// last heartbeat, or a create here is making.
func (g *Gateway) nextBranch(prefix string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	next := 1
	see := func(name string) {
		if rest, ok := strings.CutPrefix(name, prefix+"-"); ok {
			if i, err := strconv.Atoi(rest); err == nil && i >= next {
				next = i + 1
			}
		}
	}
	for name := range g.routes {
		see(name)
	}
	for name := range g.making {
		see(name)
	}
	return next
}

// squash folds a snapshot's chain into a new snapshot (an admin's) on a
// worker up that holds the chain: a tag some worker holds is refused,
// as a worker refuses one it holds (a worker publishing its snapshots
// publishes the new one, so that every worker of the shared remote
// branches it).
func (g *Gateway) squash(rw http.ResponseWriter, r *http.Request) {
	body, ok := readBody(rw, r)
	if !ok {
		return
	}
	var req api.SquashRequest
	json.Unmarshal(body, &req) // (a bad body is the worker's to refuse)
	if req.Tag != "" {
		if hs, _ := g.holders(r.Context(), nil, req.Tag); len(hs) > 0 {
			fail(rw, fmt.Errorf("snapshot %s already exists on worker %s: give another tag: %w", req.Tag, hs[0].URL, errdefs.ErrAlreadyExists))
			return
		}
	}
	var hs []*node
	if req.Snapshot != "" {
		hs, _ = g.holders(r.Context(), nil, req.Snapshot)
	}
	if len(hs) == 0 && req.Snapshot != "" && req.Tag != "" {
		fail(rw, fmt.Errorf("no snapshot %s on any worker up (dsec snap ls lists them): %w", req.Snapshot, errdefs.ErrNotFound))
		return
	}
	n := g.pick(hs)
	if n == nil {
		fail(rw, fmt.Errorf("no worker of the fleet is up (dsec node ls): %w", errdefs.ErrUnavailable))
		return
	}
	r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
	g.relayTo(n, rw, r)
}

// pick is the first of ns, else any worker up (one that answers a bad
// request as a worker does); nil: none is up.
func (g *Gateway) pick(ns []*node) *node {
	if len(ns) > 0 {
		return ns[0]
	}
	for _, n := range g.all() {
		if n.isUp() {
			return n
		}
	}
	return nil
}
