package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
)

// A create goes, among the workers whose admission takes it, first to
// one that holds its layers: each worker up is asked what the create
// would fetch there (POST /v1/estimates), an answer kept a few seconds
// so that a burst of one spec asks once.
const (
	estimateFor     = 5 * time.Second
	estimateTimeout = 300 * time.Millisecond
	// nearStep is the fetch below which workers are alike: a lazy
	// layer fetches what its sandbox reads, so what a worker lacks
	// matters in orders of magnitude, not bytes.
	nearStep = 16 << 20
	// farthest is a worker that finds some layer nowhere: a create
	// there fails.
	farthest = 100
)

// estimateKey is what an estimate is of: a worker, a tenant, layers.
type estimateKey struct{ node, tenant, layers string }

// estimated is a worker's estimate, and when it answered.
type estimated struct {
	near int
	at   time.Time
}

// nearness says, for each worker up that only takes (nil: any), how far
// it is from layers, for t: 0 for one that holds them (or fetches less
// than nearStep), one more for each 16 times as much, farthest for one
// that lacks one. A worker that does not answer in time counts as near
// (the create's other orders decide). Nil for a create on no layers, or
// with one worker to go to.
func (g *Gateway) nearness(ctx context.Context, t *auth.Token, layers []string, only func(*node) bool) map[*node]int {
	if len(layers) == 0 {
		return nil
	}
	var nodes []*node
	for _, n := range g.all() {
		if n.isUp() && (only == nil || only(n)) {
			nodes = append(nodes, n)
		}
	}
	if len(nodes) < 2 {
		return nil
	}
	tenant := ""
	if t != nil && t.Scope != auth.Admin {
		tenant = t.ID
	}
	joined := strings.Join(layers, "\x00")
	out := make(map[*node]int, len(nodes))
	var mu sync.Mutex
	var wg sync.WaitGroup
	ctx, cancel := context.WithTimeout(ctx, estimateTimeout)
	defer cancel()
	for _, n := range nodes {
		key := estimateKey{n.URL, tenant, joined}
		g.mu.Lock()
		e, ok := g.estimates[key]
		g.mu.Unlock()
		if ok && time.Since(e.at) < estimateFor {
			out[n] = e.near
			continue
		}
		wg.Go(func() {
			est, err := n.estimate(ctx, api.EstimateRequest{Layers: layers, Tenant: tenant})
			if err != nil {
				return
			}
			near := farthest
			if est.Missing == 0 {
				near = 0
				for b := est.FetchBytes; b >= nearStep; b >>= 4 {
					near++
				}
			}
			mu.Lock()
			out[n] = near
			mu.Unlock()
			g.mu.Lock()
			g.estimates[key] = estimated{near, time.Now()}
			for k, e := range g.estimates { // (few: one per worker, tenant and spec in the last seconds)
				if time.Since(e.at) >= estimateFor {
					delete(g.estimates, k)
				}
			}
			g.mu.Unlock()
		})
	}
	wg.Wait()
	return out
}

// estimate asks n, as its admin, what a create on req's layers would
// fetch there.
func (n *node) estimate(ctx context.Context, req api.EstimateRequest) (api.Estimate, error) {
	var e api.Estimate
	return e, n.send(ctx, http.MethodPost, "/"+api.Version+"/estimates", req, &e)
}

// send sends n method path with in as its JSON body, as n's admin, and
// decodes a 200's answer into out (nil: any 2xx, its body unread).
func (n *node) send(ctx context.Context, method, path string, in, out any) error {
	b, _ := json.Marshal(in)
	r, err := http.NewRequestWithContext(ctx, method, n.base.String()+path, bytes.NewReader(b))
	if err != nil {
		return err
	}
	n.authorize(r.Header, nil)
	r.Header.Set("Content-Type", "application/json")
	resp, err := n.rt.RoundTrip(r)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusUnauthorized:
		return n.refused()
	case out == nil && resp.StatusCode/100 == 2:
		return nil
	case resp.StatusCode != http.StatusOK:
		return errorOf(resp)
	}
	return json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(out)
}
