package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"sync"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
)

// A request about one sandbox goes to the worker that holds it (holder),
// relayed as it is through that worker's proxy (newNode), streaming both
// ways.

// newNode is the node of w, with its proxy.
func (g *Gateway) newNode(w Worker) (*node, error) {
	n, err := newNode(w)
	if err != nil {
		return nil, err
	}
	n.open = g.openProxy(n)
	n.proxy = &httputil.ReverseProxy{Transport: n.rt, FlushInterval: -1,
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(n.base)
			pr.Out.Host = n.host
			// On the request as it leaves, after the headers its
			// Connection names are gone: never the client's to drop.
			n.authorize(pr.Out.Header, tokenOf(pr.In))
			if h := pr.In.Header.Get("X-Forwarded-Host"); h != "" && strings.Contains(pr.In.URL.Path, "/ports/") {
				pr.Out.Header.Set("X-Forwarded-Host", h) // (the Host a sandbox's server is asked for)
			}
			if set, ok := pr.In.Context().Value(relayKey{}).(http.Header); ok { // an E2B front's relay
				for _, h := range relayHeaders {
					pr.Out.Header.Del(h)
				}
				for h, vs := range set {
					pr.Out.Header[h] = vs
				}
			}
		},
		ModifyResponse: func(resp *http.Response) error {
			// The worker's own 401 (its realm), not a sandbox server's
			// through the port route.
			if resp.StatusCode == http.StatusUnauthorized && resp.Header.Get("WWW-Authenticate") == `Bearer realm="dsec"` {
				resp.Body.Close()
				return n.refused()
			}
			if r := resp.Request; r.Method == http.MethodDelete && resp.StatusCode/100 == 2 {
				name, ok := strings.CutPrefix(r.URL.Path, "/"+api.Version+"/sandboxes/")
				if !ok { // E2B's kill, relayed to the worker's front
					name, ok = strings.CutPrefix(r.URL.Path, e2bPrefix+"/control/sandboxes/")
				}
				if ok && !strings.Contains(name, "/") {
					g.forget(n, name)
					g.freed(name)
				}
			}
			return nil
		},
		ErrorHandler: func(rw http.ResponseWriter, r *http.Request, err error) {
			// The transport may still read the request's body after
			// RoundTrip failed (an exec's input, full duplex): this
			// connection serves no next request, which it would read
			// at once.
			if r.ProtoMajor == 1 {
				rw.Header().Set("Connection", "close")
			}
			answer := func(err error) { fail(rw, err) }
			if f, ok := r.Context().Value(failKey{}).(func(error)); ok { // (an E2B front's relay: its own form)
				answer = f
			}
			if errors.Is(err, errRefused) {
				answer(err)
				return
			}
			if r.Context().Err() == nil { // (not the client's going)
				g.lost(n, err)
			}
			answer(n.unreachable(err))
		}}
	return n, nil
}

// described is the sandbox n's answer describes, with its node.
func (n *node) described(resp *http.Response) (map[string]json.RawMessage, error) {
	var sb map[string]json.RawMessage
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err == nil {
		err = json.Unmarshal(b, &sb)
	}
	if err != nil {
		return nil, fmt.Errorf("worker %s's description of a sandbox: %v: %w", n.URL, err, errdefs.ErrUnavailable)
	}
	sb["node"], _ = json.Marshal(n.URL)
	return sb, nil
}

// inspect is the sandbox's worker's description of it, with its node.
func (g *Gateway) inspect(rw http.ResponseWriter, r *http.Request) {
	n := g.holderUp(rw, r)
	if n == nil {
		return
	}
	req, err := http.NewRequestWithContext(r.Context(), http.MethodGet, n.base.String()+r.URL.RequestURI(), nil)
	if err != nil {
		fail(rw, err)
		return
	}
	n.authorize(req.Header, tokenOf(r))
	resp, err := n.rt.RoundTrip(req)
	if err != nil {
		if r.Context().Err() == nil {
			g.lost(n, err)
		}
		fail(rw, n.unreachable(err))
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusUnauthorized {
		fail(rw, n.refused())
		return
	}
	if resp.StatusCode != http.StatusOK {
		relay(rw, resp)
		return
	}
	sb, err := n.described(resp)
	if err != nil {
		fail(rw, err)
		return
	}
	answer(rw, http.StatusOK, sb)
}

// toHolder relays a request about a sandbox to its worker.
func (g *Gateway) toHolder(rw http.ResponseWriter, r *http.Request) {
	if n := g.holderUp(rw, r); n != nil {
		g.relayTo(n, rw, r)
	}
}

// holderUp is the worker up that holds r's sandbox, or nil once rw
// has the answer: not found, or its worker down.
func (g *Gateway) holderUp(rw http.ResponseWriter, r *http.Request) *node {
	return g.holderNamed(rw, r, r.PathValue("name"))
}

// holderNamed is holderUp of the sandbox name.
func (g *Gateway) holderNamed(rw http.ResponseWriter, r *http.Request, name string) *node {
	n, err := g.holderOf(r.Context(), name, tokenOf(r))
	if err != nil {
		fail(rw, err)
	}
	return n
}

// holderOf is the worker up that holds the sandbox name, as t sees it:
// else not found, or its worker down.
func (g *Gateway) holderOf(ctx context.Context, name string, t *auth.Token) (*node, error) {
	notFound := fmt.Errorf("no sandbox %s (dsec ps lists them): %w", name, errdefs.ErrNotFound)
	n := g.holder(ctx, name, t)
	if n == nil {
		return nil, notFound
	}
	n.mu.Lock()
	down, err := n.down, n.err
	// Another's sandbox on a worker down is not found, as on one up.
	mine := t.Scope == auth.Admin || slices.ContainsFunc(n.held, func(s api.Sandbox) bool { return s.Name == name && s.Owner == t.ID })
	n.mu.Unlock()
	switch {
	case down && !mine:
		return nil, notFound
	case down:
		return nil, fmt.Errorf("sandbox %s: %w", name, n.unreachable(err))
	}
	return n, nil
}

// holder is the worker that holds the sandbox name: as the last
// heartbeat said, or else as the workers up say now to t (one made
// through another gateway since; t's own only).
func (g *Gateway) holder(ctx context.Context, name string, t *auth.Token) *node {
	g.mu.Lock()
	n := g.routes[name]
	g.mu.Unlock()
	if n != nil {
		return n
	}
	ctx, cancel := context.WithTimeout(ctx, g.cfg.DownAfter)
	defer cancel()
	nodes := g.all()
	found := make(chan *node, len(nodes))
	var wg sync.WaitGroup
	for _, o := range nodes {
		o.mu.Lock()
		down := o.down
		o.mu.Unlock()
		if down {
			continue
		}
		wg.Go(func() {
			var sb api.Sandbox
			if o.get(ctx, "/"+api.Version+"/sandboxes/"+url.PathEscape(name), t, &sb) == nil {
				found <- o
			}
		})
	}
	go func() { wg.Wait(); close(found) }()
	n, ok := <-found
	if !ok {
		return nil
	}
	g.mu.Lock()
	g.routes[name] = n
	g.mu.Unlock()
	return n
}

// relayTo relays r to n as the caller's (n.proxy's Rewrite), streaming
// both ways (an exec's input and output at once).
func (g *Gateway) relayTo(n *node, rw http.ResponseWriter, r *http.Request) {
	http.NewResponseController(rw).EnableFullDuplex()
	n.proxy.ServeHTTP(rw, r)
}

// relay copies a worker's answer to rw as it is.
func relay(rw http.ResponseWriter, resp *http.Response) {
	for k, vs := range resp.Header {
		for _, v := range vs {
			rw.Header().Add(k, v)
		}
	}
	rw.WriteHeader(resp.StatusCode)
	io.Copy(rw, resp.Body)
}
