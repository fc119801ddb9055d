package gateway

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
)

// A sandbox name is the fleet's, whichever gateway (of several replicas)
// makes it: a create claims its name on the name's home, a worker up
// that every gateway seeing the same workers up picks (rendezvous
// hashing over their URLs), and the home refuses a name another create
// holds. A claim lives while its create is under way (renewed) and a
// few heartbeats after, until every gateway's lists show the sandbox.
// (Two gateways that disagree on which workers are up may pick two
// homes for a moment: a worker that just died or came back.)
const (
	claimTTL   = 30 * time.Second
	claimRenew = 10 * time.Second
	// claimAsk bounds a claim's round trip to a home; freeAsk a removed
	// name's (a removal's answer waits for it: a hung home costs it
	// this much, and the name a settle's time at most).
	claimAsk = 5 * time.Second
	freeAsk  = time.Second
	// settleEvery gathers the claims of creates made in a while into one
	// request to each home (a burst settles in a few, not one each).
	settleEvery = 100 * time.Millisecond
)

// settling are the claims of creates made, to settle on their homes.
type settling struct {
	mu        sync.Mutex
	at        map[*node]*api.ClaimRequest // (Names and Holders)
	scheduled bool
}

// homes orders the workers up for name, its home first: each worker's
// weight is a hash of its URL and the name, the heaviest first, so that
// a worker joining or leaving moves only the names it wins or held.
func homes(nodes []*node, name string) []*node {
	type w struct {
		n      *node
		weight uint64
	}
	var ws []w
	for _, n := range nodes {
		if n.isUp() {
			// (A hash whose every bit depends on the name: FNV's high
			// bits hardly do, and one worker won every name.)
			h := sha256.Sum256([]byte(n.URL + "\x00" + name))
			ws = append(ws, w{n, binary.BigEndian.Uint64(h[:8])})
		}
	}
	slices.SortFunc(ws, func(a, b w) int { return cmp.Compare(b.weight, a.weight) })
	out := make([]*node, len(ws))
	for i, x := range ws {
		out[i] = x.n
	}
	return out
}

// claimed is a create's claim of its names: by its holder, on their
// homes, renewed until done.
type claimed struct {
	g      *Gateway
	names  []string
	holder string
	at     map[*node][]string // the names each home granted
	stop   context.CancelFunc
	renew  sync.WaitGroup
}

// claim takes names for a create through this gateway, until done: a
// name some worker held at its last heartbeat, that another create here
// is making, or that its home says another create holds, is refused as
// a worker refuses a name it holds. A home that does not answer is
// passed for the next in the name's order; none answering, the names
// are this gateway's alone (as its lists say).
func (g *Gateway) claim(ctx context.Context, names []string) (*claimed, error) {
	g.mu.Lock()
	for _, name := range names {
		if g.routes[name] != nil || g.making[name] {
			g.mu.Unlock()
			return nil, fmt.Errorf("sandbox %s already exists: give another name, or remove it first (dsec rm): %w", name, errdefs.ErrAlreadyExists)
		}
	}
	for _, name := range names {
		g.making[name] = true
	}
	g.mu.Unlock()
	c := &claimed{g: g, names: names, holder: rand.Text(), at: map[*node][]string{}}
	if err := c.take(ctx); err != nil {
		c.release()
		g.unmake(names)
		return nil, err
	}
	rctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	c.stop = stop
	c.renew.Go(func() {
		tick := time.NewTicker(claimRenew)
		defer tick.Stop()
		for {
			select {
			case <-rctx.Done():
				return
			case <-tick.C:
			}
			for n, names := range c.at {
				actx, cancel := context.WithTimeout(rctx, claimAsk)
				n.send(actx, http.MethodPost, "/"+api.Version+"/claims", api.ClaimRequest{Names: names, Holder: c.holder, TTLMillis: claimTTL.Milliseconds()}, nil)
				cancel()
			}
		}
	})
	return c, nil
}

// take claims c's names on their homes, all or none.
func (c *claimed) take(ctx context.Context) error {
	nodes := c.g.all()
	order := map[string][]*node{}
	for _, name := range c.names {
		order[name] = homes(nodes, name)
	}
	left := slices.Clone(c.names)
	for len(left) > 0 {
		asks := map[*node][]string{}
		var next []string
		for _, name := range left {
			if hs := order[name]; len(hs) > 0 {
				asks[hs[0]] = append(asks[hs[0]], name)
				order[name] = hs[1:]
			}
		}
		var mu sync.Mutex
		var refused error
		var wg sync.WaitGroup
		for n, names := range asks {
			wg.Go(func() {
				actx, cancel := context.WithTimeout(ctx, claimAsk)
				defer cancel()
				err := n.send(actx, http.MethodPost, "/"+api.Version+"/claims", api.ClaimRequest{Names: names, Holder: c.holder, TTLMillis: claimTTL.Milliseconds()}, nil)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil:
					c.at[n] = append(c.at[n], names...)
				case errdefs.IsAlreadyExists(err) || errdefs.IsInvalidArgument(err):
					refused = err // (taken, or a bad name: the create's answer)
				default:
					next = append(next, names...) // (silent, busy, or an older worker: the next home)
				}
			})
		}
		wg.Wait()
		if refused != nil {
			return refused
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		left = next
	}
	return nil
}

// done ends c: the names made (made says which) stay claimed a few
// heartbeats, until every gateway's lists show them; the rest are let
// go at once.
func (c *claimed) done(made func(name string) bool) {
	var wg sync.WaitGroup
	if c.stop != nil {
		c.stop()
		c.renew.Wait()
	}
	for n, names := range c.at {
		var kept, freed []string
		for _, name := range names {
			if made(name) {
				kept = append(kept, name)
			} else {
				freed = append(freed, name)
			}
		}
		if len(kept) > 0 {
			c.g.settleLater(n, kept, c.holder)
		}
		if len(freed) > 0 {
			// Before the create's answer is out (its handler returns
			// after): a client that retries a refused create finds its
			// name free. A lapse is harmless: the claim runs out.
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				defer cancel()
				n.send(ctx, http.MethodPost, "/"+api.Version+"/claims", api.ClaimRequest{Names: freed, Holder: c.holder, Release: true}, nil)
			})
		}
	}
	wg.Wait()
	c.g.unmake(c.names)
}

// settleLater settles the claims of names, made, on their home n with
// those of the other creates made within settleEvery: each kept a few
// heartbeats, until every gateway's lists show its sandbox.
func (g *Gateway) settleLater(n *node, names []string, holder string) {
	s := &g.settling
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.at == nil {
		s.at = map[*node]*api.ClaimRequest{}
	}
	req := s.at[n]
	if req == nil {
		req = &api.ClaimRequest{Made: true, TTLMillis: max(3*g.cfg.Heartbeat, 10*time.Second).Milliseconds()}
		s.at[n] = req
	}
	for _, name := range names {
		req.Names, req.Holders = append(req.Names, name), append(req.Holders, holder)
	}
	if !s.scheduled {
		s.scheduled = true
		time.AfterFunc(settleEvery, g.settle)
	}
}

// settle sends the claims settleLater gathered.
func (g *Gateway) settle() {
	s := &g.settling
	s.mu.Lock()
	at := s.at
	s.at, s.scheduled = nil, false
	s.mu.Unlock()
	for n, req := range at {
		for len(req.Names) > 0 { // (in requests a worker takes)
			k := min(len(req.Names), api.MaxClaims)
			part := *req
			part.Names, part.Holders = req.Names[:k], req.Holders[:k]
			req.Names, req.Holders = req.Names[k:], req.Holders[k:]
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), claimAsk)
				defer cancel()
				n.send(ctx, http.MethodPost, "/"+api.Version+"/claims", part, nil)
			}()
		}
	}
}

// unsettled takes name out of the claims settleLater gathers.
func (g *Gateway) unsettled(name string) {
	s := &g.settling
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, req := range s.at {
		if i := slices.Index(req.Names, name); i >= 0 {
			req.Names, req.Holders = slices.Delete(req.Names, i, i+1), slices.Delete(req.Holders, i, i+1)
		}
	}
}

// release lets go of every name c took (a claim refused in part).
func (c *claimed) release() {
	for n, names := range c.at {
		ctx, cancel := context.WithTimeout(context.Background(), claimAsk)
		n.send(ctx, http.MethodPost, "/"+api.Version+"/claims", api.ClaimRequest{Names: names, Holder: c.holder, Release: true}, nil)
		cancel()
	}
}

// unmake ends names' creates here.
func (g *Gateway) unmake(names []string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, name := range names {
		delete(g.making, name)
	}
}

// freed lets go of name's claim on its home once its sandbox is
// removed, so that the name is free at once (only a claim whose create
// is over: one under way is another's). Before the removal is
// answered: the client's next create may take the name.
func (g *Gateway) freed(name string) {
	hs := homes(g.all(), name)
	if len(hs) == 0 {
		return
	}
	g.unsettled(name)
	ctx, cancel := context.WithTimeout(context.Background(), freeAsk)
	defer cancel()
	hs[0].send(ctx, http.MethodPost, "/"+api.Version+"/claims", api.ClaimRequest{Names: []string{name}, Release: true}, nil)
}
