package gateway

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"slices"
	"sync"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
)

// What the fleet is and holds, asked of its workers: its sandboxes
// (every worker's list at once), its workers (dsec node ls) and their
// cordons, its version.

// version is the gateway's: the API it speaks, and every backend some
// worker up runs.
func (g *Gateway) version(rw http.ResponseWriter, r *http.Request) {
	v := api.VersionInfo{API: api.Version, Version: g.cfg.Version, Pid: os.Getpid(), Gateway: true}
	for _, n := range g.all() {
		n.mu.Lock()
		if !n.down {
			for _, b := range n.info.Backends {
				if !slices.Contains(v.Backends, b) {
					v.Backends = append(v.Backends, b)
				}
			}
		}
		n.mu.Unlock()
	}
	answer(rw, http.StatusOK, v)
}

// listNodes says how each worker is (dsec node ls).
func (g *Gateway) listNodes(rw http.ResponseWriter, r *http.Request) {
	out := []api.Node{}
	for _, n := range g.all() {
		_, free, _ := n.room()
		n.mu.Lock()
		s := api.Node{URL: n.URL, Up: !n.down && !n.seen.IsZero(), Cordoned: n.cordoned, Sandboxes: len(n.held),
			Version: n.info.Version, Backends: n.info.Backends, MemoryFree: max(free, 0)}
		if !n.seen.IsZero() {
			s.Seen = n.seen.UTC()
		}
		if n.err != nil {
			s.Error = n.err.Error()
		}
		if n.info.Limits != nil {
			s.MemoryBytes = n.info.Limits.MemoryBytes
		}
		s.Capacity = n.info.Capacity
		n.mu.Unlock()
		out = append(out, s)
	}
	answer(rw, http.StatusOK, out)
}

// cordon stops (or starts again) placing creates on a worker: the
// worker keeps it (PUT /v1/cordon), so that every gateway of the fleet,
// and this one started again, places none there.
func (g *Gateway) cordon(on bool) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		n := g.node(r.PathValue("node"))
		if n == nil {
			fail(rw, fmt.Errorf("no worker %s in the fleet (dsec node ls): %w", r.PathValue("node"), errdefs.ErrNotFound))
			return
		}
		if err := n.send(r.Context(), http.MethodPut, "/"+api.Version+"/cordon", api.CordonRequest{Cordoned: on}, nil); err != nil {
			if !answered(err) {
				err = n.unreachable(err)
			}
			fail(rw, fmt.Errorf("worker %s keeps its cordon, and did not take this one: %w", n.URL, err))
			return
		}
		n.mu.Lock()
		n.cordoned = on
		n.mu.Unlock()
		rw.WriteHeader(http.StatusNoContent)
	}
}

// node is the worker named by its URL or HOST:PORT.
func (g *Gateway) node(name string) *node {
	for _, n := range g.all() {
		if n.URL == name || n.host == name {
			return n
		}
	}
	return nil
}

// list is every worker's list, on behalf of the caller: a down
// worker's sandboxes as it last listed them, unreachable. A worker's
// refusal (busy: the caller's requests at once) is the list's.
func (g *Gateway) list(rw http.ResponseWriter, r *http.Request) {
	t := tokenOf(r)
	nodes := g.all()
	lists := make([][]api.Sandbox, len(nodes))
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Go(func() {
			n.mu.Lock()
			down, held := n.down, n.held
			n.mu.Unlock()
			var got []api.Sandbox
			var err error
			if !down {
				ctx, cancel := context.WithTimeout(r.Context(), g.cfg.DownAfter)
				err = n.get(ctx, r.URL.RequestURI(), t, &got)
				cancel()
				if answered(err) {
					errs[i] = err
					return
				}
				if err != nil && r.Context().Err() == nil {
					g.lost(n, err)
				}
			}
			if down || err != nil {
				got = nil
				for _, s := range held {
					if t.Scope == auth.Admin || s.Owner == t.ID {
						s.Status = api.StatusUnreachable
						got = append(got, s)
					}
				}
			}
			for i := range got {
				got[i].Node = n.URL
			}
			lists[i] = got
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			fail(rw, err)
			return
		}
	}
	out := slices.Concat(lists...)
	if out == nil {
		out = []api.Sandbox{}
	}
	slices.SortStableFunc(out, func(a, b api.Sandbox) int { return a.Created.Compare(b.Created) })
	answer(rw, http.StatusOK, out)
}
