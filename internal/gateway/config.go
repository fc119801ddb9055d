package gateway

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
)

// The fleet's slow configuration: stored policies and FnCall pools. A
// policy stored through the gateway is stored on every worker up; a
// pool's size is the fleet's, split over the workers up and not
// cordoned (the first ones take what does not divide). A worker down
// meanwhile misses the change: store it again once it is up (dsec node
// ls says which). Reads merge the workers' answers.

// answerOf is one worker's answer to a request the gateway sent on.
type answerOf struct {
	n      *node
	status int
	body   []byte
	err    error // no answer, or the gateway's token refused
}

// toEach sends method path (with body, for each worker its own: bodyFor,
// nil: none) to every worker up that for takes, on behalf of t, and
// collects the answers.
func (g *Gateway) toEach(r *http.Request, method, path string, bodyFor func(n *node) []byte, take func(*node) bool) []answerOf {
	t := tokenOf(r)
	var nodes []*node
	for _, n := range g.all() {
		if n.isUp() && (take == nil || take(n)) {
			nodes = append(nodes, n)
		}
	}
	out := make([]answerOf, len(nodes))
	done := make(chan struct{}, len(nodes))
	for i, n := range nodes {
		go func() {
			defer func() { done <- struct{}{} }()
			out[i] = g.sendTo(r, n, t, method, path, bodyFor)
		}()
	}
	for range nodes {
		<-done
	}
	return out
}

// sendTo sends one request of toEach's to n.
func (g *Gateway) sendTo(r *http.Request, n *node, t *auth.Token, method, path string, bodyFor func(n *node) []byte) answerOf {
	var body io.Reader
	if bodyFor != nil {
		body = bytes.NewReader(bodyFor(n))
	}
	ctx := r.Context()
	if method == http.MethodGet { // (a read of one silent worker holds none up)
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, g.cfg.DownAfter)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(ctx, method, n.base.String()+path, body)
	if err != nil {
		return answerOf{n: n, err: err}
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	n.authorize(req.Header, t)
	resp, err := n.rt.RoundTrip(req)
	if err != nil {
		if r.Context().Err() == nil {
			g.lost(n, err)
		}
		return answerOf{n: n, err: n.unreachable(err)}
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusUnauthorized {
		return answerOf{n: n, err: n.refused()}
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return answerOf{n: n, err: n.unreachable(err)}
	}
	return answerOf{n: n, status: resp.StatusCode, body: b}
}

// failure is the error of an answer that is not a success.
func (a answerOf) failure() error {
	if a.err != nil {
		return a.err
	}
	if a.status/100 == 2 {
		return nil
	}
	var e api.Error
	if json.Unmarshal(a.body, &e) != nil || e.Class == "" {
		e = api.Error{Class: api.ClassOfStatus(a.status), Message: http.StatusText(a.status)}
	}
	return &e
}

// written answers a change sent to every worker: done where each took
// it; else the first failure, saying on how many it holds.
func written(rw http.ResponseWriter, what string, answers []answerOf, ok func(answerOf)) {
	if len(answers) == 0 {
		fail(rw, fmt.Errorf("no worker is up to %s (dsec node ls): %w", what, errdefs.ErrUnavailable))
		return
	}
	var failed []string
	var first error
	for _, a := range answers {
		if err := a.failure(); err != nil {
			failed = append(failed, a.n.URL)
			first = cmp.Or(first, err)
		}
	}
	switch {
	case len(failed) == 0:
		ok(answers[0])
	case len(failed) == len(answers):
		fail(rw, first)
	default:
		fail(rw, fmt.Errorf("%s: done on %d of the %d workers up, not on %s: %w", what, len(answers)-len(failed), len(answers),
			strings.Join(failed, ", "), first))
	}
}

// putPolicy stores a policy on every worker up.
func (g *Gateway) putPolicy(rw http.ResponseWriter, r *http.Request) {
	body, ok := readBody(rw, r)
	if !ok {
		return
	}
	answers := g.toEach(r, http.MethodPut, r.URL.RequestURI(), func(*node) []byte { return body }, nil)
	written(rw, "store policy "+r.PathValue("name"), answers, func(a answerOf) {
		rw.WriteHeader(a.status)
		rw.Write(a.body)
	})
}

// removeAll removes a policy or a pool from every worker up: done where
// any had it, not found where none did.
func (g *Gateway) removeAll(what string) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		answers := g.toEach(r, http.MethodDelete, r.URL.RequestURI(), nil, nil)
		if i := slices.IndexFunc(answers, func(a answerOf) bool { return a.failure() == nil }); i >= 0 {
			// (Not found on some: they never had it.)
			answers = slices.DeleteFunc(answers, func(a answerOf) bool { return errdefs.IsNotFound(a.failure()) })
		}
		written(rw, "remove "+what+" "+r.PathValue("name"), answers, func(a answerOf) { rw.WriteHeader(a.status) })
	}
}

// policies is every worker's list of the policies the caller may name,
// each once (the first worker's, in the fleet's order).
func (g *Gateway) policies(rw http.ResponseWriter, r *http.Request) {
	var out []api.Policy
	if !merged(g, rw, r, &out, policyName, nil) {
		return
	}
	answer(rw, http.StatusOK, out)
}

func policyName(p api.Policy) string {
	if p.Metadata == nil {
		return ""
	}
	return p.Metadata.Name
}

// policy is a stored policy, as the first worker up that has it says.
func (g *Gateway) policy(rw http.ResponseWriter, r *http.Request) {
	answers := g.toEach(r, http.MethodGet, r.URL.RequestURI(), nil, nil)
	var first error
	for _, n := range g.all() { // (in the fleet's order)
		for _, a := range answers {
			if a.n != n {
				continue
			}
			if a.failure() == nil {
				rw.Header().Set("Content-Type", "application/json")
				rw.WriteHeader(a.status)
				rw.Write(a.body)
				return
			}
			if !errdefs.IsNotFound(a.failure()) {
				first = cmp.Or(first, a.failure())
			}
		}
	}
	fail(rw, cmp.Or(first, fmt.Errorf("no policy %s on any worker up (dsec policy ls lists them): %w", r.PathValue("name"), errdefs.ErrNotFound)))
}

// merged decodes every worker's list answer to r into out, one entry per
// key (join, if any, adds a later worker's into the first's); false once
// rw has the failure.
func merged[T any](g *Gateway, rw http.ResponseWriter, r *http.Request, out *[]T, key func(T) string, join func(into *T, more T)) bool {
	answers := g.toEach(r, http.MethodGet, r.URL.RequestURI(), nil, nil)
	*out = []T{}
	for _, n := range g.all() {
		for _, a := range answers {
			if a.n != n {
				continue
			}
			if err := a.failure(); err != nil {
				if a.err == nil { // (a worker's refusal is the answer; its silence is not)
					fail(rw, err)
					return false
				}
				continue
			}
			var list []T
			if err := json.Unmarshal(a.body, &list); err != nil {
				fail(rw, fmt.Errorf("worker %s's list: %v: %w", n.URL, err, errdefs.ErrUnavailable))
				return false
			}
			for _, v := range list {
				i := slices.IndexFunc(*out, func(o T) bool { return key(o) == key(v) })
				switch {
				case i < 0:
					*out = append(*out, v)
				case join != nil:
					join(&(*out)[i], v)
				}
			}
		}
	}
	return true
}

// pools is the fleet's pools: each once, its sizes and counts added up
// over the workers.
func (g *Gateway) pools(rw http.ResponseWriter, r *http.Request) {
	var out []api.Pool
	if !merged(g, rw, r, &out, func(p api.Pool) string { return p.Name }, joinPool) {
		return
	}
	answer(rw, http.StatusOK, out)
}

func joinPool(into *api.Pool, more api.Pool) {
	into.Size += more.Size
	into.Warm += more.Warm
	into.Filling += more.Filling
	into.Calls += more.Calls
	into.Misses += more.Misses
	if more.Error != "" && !strings.Contains(into.Error, more.Error) {
		into.Error = strings.TrimPrefix(into.Error+"; "+more.Error, "; ")
	}
}

// putPool makes or resizes a pool over the fleet: its size split over
// the workers up and not cordoned (a cordoned one keeps none), the
// answer the fleet's pool.
func (g *Gateway) putPool(rw http.ResponseWriter, r *http.Request) {
	var ps api.PoolSpec
	lr := &io.LimitedReader{R: r.Body, N: maxBody + 1}
	if err := json.NewDecoder(lr).Decode(&ps); err != nil {
		fail(rw, fmt.Errorf("bad request body: %v: %w", err, errdefs.ErrInvalidArgument))
		return
	}
	if ps.Size < 0 {
		fail(rw, fmt.Errorf("pool size %d: give 0 or more: %w", ps.Size, errdefs.ErrInvalidArgument))
		return
	}
	var takers []*node
	for _, n := range g.all() {
		if up, _, _ := n.room(); up {
			takers = append(takers, n)
		}
	}
	share := func(n *node) int {
		i := slices.Index(takers, n)
		if i < 0 {
			return 0
		}
		s := ps.Size / len(takers)
		if i < ps.Size%len(takers) {
			s++
		}
		return s
	}
	answers := g.toEach(r, http.MethodPut, r.URL.RequestURI(), func(n *node) []byte {
		b, _ := json.Marshal(api.PoolSpec{Size: share(n), Spec: ps.Spec})
		return b
	}, nil)
	written(rw, "size pool "+r.PathValue("name"), answers, func(answerOf) {
		var out *api.Pool
		for _, a := range answers {
			var p api.Pool
			if json.Unmarshal(a.body, &p) != nil {
				continue
			}
			if out == nil {
				out = &p
			} else {
				joinPool(out, p)
			}
		}
		if out == nil {
			fail(rw, errors.New("no worker described the pool"))
			return
		}
		answer(rw, http.StatusOK, out)
	})
}
