package gateway

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/dsec-project/dsec/api"
)

// The fleet as the gateway sees it: workers join and leave as discovery
// names them, and each is asked every Heartbeat how it is and what it
// holds. Its answer routes its sandboxes there; its silence for
// DownAfter makes it down.

// Discovered makes ws the fleet (cfg.Discover's answer): a worker new
// to it joins at once; one no longer named leaves once it does not
// answer, so that a worker's restart (its pod replaced: gone from the
// list for a moment) loses none of its sandboxes' routes. A worker named
// wrong is logged and left out.
func (g *Gateway) Discovered(ws []Worker) {
	g.joining.Lock()
	defer g.joining.Unlock()
	old := g.all()
	nodes := make([]*node, 0, len(old)+len(ws))
	for _, n := range old {
		i := slices.IndexFunc(ws, func(w Worker) bool { return w.URL == n.URL })
		n.mu.Lock()
		if i >= 0 {
			n.absent = time.Time{}
		} else if n.absent.IsZero() {
			n.absent = time.Now()
		}
		n.mu.Unlock()
		nodes = append(nodes, n)
	}
	for _, w := range ws {
		if slices.ContainsFunc(old, func(n *node) bool { return n.URL == w.URL }) {
			continue
		}
		n, err := g.newNode(w)
		if err != nil {
			g.cfg.Log.Error("a worker discovered is left out", "worker", w.URL, "err", err)
			continue
		}
		g.cfg.Log.Info("a worker joins the fleet", "worker", w.URL)
		nodes = append(nodes, n)
		g.start(n)
	}
	g.fleet.Store(&nodes)
}

// leave drops n from the fleet: gone from discovery and not answering.
func (g *Gateway) leave(n *node) {
	g.joining.Lock()
	defer g.joining.Unlock()
	nodes := slices.DeleteFunc(slices.Clone(g.all()), func(o *node) bool { return o == n })
	g.fleet.Store(&nodes)
	g.cfg.Log.Warn("a worker leaves the fleet: no longer discovered, and silent", "worker", n.URL)
	g.mu.Lock()
	for name, o := range g.routes {
		if o == n {
			delete(g.routes, name)
		}
	}
	g.mu.Unlock()
}

// Run heartbeats each worker every Heartbeat until ctx ends, each on
// its own (one slow to answer delays no other's), and, with
// cfg.Discover, follows the fleet's workers as they join and leave. A
// gateway heartbeats once (Heartbeat) before it serves, so that it
// routes from its first request.
func (g *Gateway) Run(ctx context.Context) {
	g.joining.Lock()
	g.ctx = ctx
	for _, n := range g.all() {
		g.start(n)
	}
	g.joining.Unlock()
	if g.cfg.Discover != nil {
		if err := g.cfg.Discover(ctx, g.Discovered); err != nil && ctx.Err() == nil {
			g.cfg.Log.Error("the fleet's workers are no longer discovered", "err", err)
		}
	}
	<-ctx.Done()
	g.beating.Wait()
}

// start heartbeats n every Heartbeat once Run runs (under joining),
// until n leaves the fleet or Run's context ends. A worker never asked
// yet (one discovered) is asked at once: a create a moment after it
// joins may go there, not wait a heartbeat for it.
func (g *Gateway) start(n *node) {
	if g.ctx == nil {
		return
	}
	ctx := g.ctx
	g.beating.Go(func() {
		n.mu.Lock()
		asked := !n.seen.IsZero() || n.err != nil
		n.mu.Unlock()
		if !asked {
			g.beat(ctx, n)
		}
		tick := time.NewTicker(g.cfg.Heartbeat)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			g.beat(ctx, n)
			n.mu.Lock()
			leaves := !n.absent.IsZero() && (n.down || n.seen.IsZero() && time.Since(n.absent) >= g.cfg.DownAfter)
			n.mu.Unlock()
			if leaves {
				g.leave(n)
				return
			}
		}
	})
}

// Heartbeat asks every worker at once how it is and what it holds,
// waiting DownAfter at most.
func (g *Gateway) Heartbeat(ctx context.Context) {
	var wg sync.WaitGroup
	for _, n := range g.all() {
		wg.Go(func() { g.beat(ctx, n) })
	}
	wg.Wait()
}

// beat asks n how it is and what it holds. An answer, even busy, says
// it lives; none within DownAfter counts against it (lost).
func (g *Gateway) beat(ctx context.Context, n *node) {
	bctx, cancel := context.WithTimeout(ctx, g.cfg.DownAfter)
	defer cancel()
	var info api.VersionInfo
	var held []api.Sandbox
	asked := time.Now()
	// The list first: a sandbox made between the two is then counted in
	// the capacity the version says as well as pending (twice, until the
	// next heartbeat), never in neither.
	err := n.get(bctx, "/"+api.Version+"/sandboxes?brief=1", nil, &held) // (what it holds, not what each uses)
	if err == nil {
		err = n.get(bctx, "/"+api.Version+"/version", nil, &info)
	}
	if answered(err) {
		n.mu.Lock()
		n.seen = time.Now() // (busy: what it holds is as last said)
		n.mu.Unlock()
		return
	}
	if err != nil {
		if ctx.Err() == nil {
			g.lost(n, err)
		}
		return
	}
	n.mu.Lock()
	if n.down {
		g.cfg.Log.Info("a worker answers again", "worker", n.URL)
	}
	// What this gateway made or removed there since it asked: as done,
	// whatever the list says (the worker may have listed before).
	for name, c := range n.changed {
		i := slices.IndexFunc(held, func(s api.Sandbox) bool { return s.Name == name })
		switch {
		case c.at.Before(asked):
			delete(n.changed, name) // (the list shows it)
		case !c.made && i >= 0:
			held = slices.Delete(held, i, i+1)
		case c.made:
			// As its create answered, newer than the list (which may
			// show it still being made, or not at all).
			if j := slices.IndexFunc(n.held, func(s api.Sandbox) bool { return s.Name == name }); j >= 0 {
				if i >= 0 {
					held[i] = n.held[j]
				} else {
					held = append(held, n.held[j])
				}
			}
		}
	}
	n.seen, n.err, n.down, n.info, n.held = time.Now(), nil, false, info, held
	n.cordoned = info.Cordoned
	for name, p := range n.pending {
		if !strings.HasPrefix(name, "?") && (time.Since(p.sent) > pendFor || slices.ContainsFunc(held, func(s api.Sandbox) bool { return s.Name == name })) {
			delete(n.pending, name)
		}
	}
	n.mu.Unlock()
	g.mu.Lock()
	for name, o := range g.routes {
		if o == n && !slices.ContainsFunc(held, func(s api.Sandbox) bool { return s.Name == name }) {
			delete(g.routes, name)
		}
	}
	for _, s := range held {
		g.routes[s.Name] = n
	}
	g.mu.Unlock()
}

// answered says whether err is a worker's answer (a failure it said),
// not its silence.
func answered(err error) bool {
	var e *api.Error
	return errors.As(err, &e)
}

// lost records that n did not answer: down once it has not for
// DownAfter (or never has).
func (g *Gateway) lost(n *node, err error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.err = err
	if !n.down && time.Since(n.seen) >= g.cfg.DownAfter {
		n.down = true
		g.cfg.Log.Warn("a worker is down: its sandboxes are unreachable, and no create goes there", "worker", n.URL, "err", err)
	}
}
