package gateway

import (
	"net/http"
	"net/http/httputil"
	"slices"

	"github.com/dsec-project/dsec/api"
)

// VNC: a worker opens a full VM's screen to the WebSocket of a VNC grant
// (GET /v1/vnc/NAME?token=...), whose token is its only credential, as a
// browser's WebSocket sends no Authorization header. The grant itself is
// asked for through the gateway as any request about a sandbox is
// (POST /v1/sandboxes/NAME/vnc, relayed to its worker); the WebSocket
// comes here with no token of the gateway's, so the gateway relays it
// before its tokens are checked, to the worker that holds the sandbox,
// where the grant is checked. It never asks the workers about a name
// for it (a request no token opens must not make the gateway ask every
// worker): it takes its routes and the sandboxes the workers' last
// answers listed, which hold every sandbox made through it at once.
// Whatever is wrong (no such sandbox in the fleet, its worker down, no
// grant, a wrong token) is the worker's one answer, api.VNCRefused.

// vnc relays r, the WebSocket of a VNC grant of sandbox name, to the
// worker up that holds it.
func (g *Gateway) vnc(rw http.ResponseWriter, r *http.Request, name string) {
	n := g.heldBy(name)
	if n == nil {
		refuseVNC(rw)
		return
	}
	out := r.Clone(r.Context())
	if r.URL.Query().Get("token") != "" {
		// The grant is the query's: an Authorization header is the
		// client's token of the gateway's, no worker's to see. (Without
		// the query's, the header is the grant.)
		out.Header.Del("Authorization")
	}
	n.open.ServeHTTP(rw, out)
}

// heldBy is the worker up that holds the sandbox name, as the gateway
// knows it without asking: nil if none.
func (g *Gateway) heldBy(name string) *node {
	g.mu.Lock()
	n := g.routes[name]
	g.mu.Unlock()
	for _, o := range g.all() {
		if n != nil && o != n {
			continue
		}
		o.mu.Lock()
		up := !o.down && slices.ContainsFunc(o.held, func(s api.Sandbox) bool { return s.Name == name })
		o.mu.Unlock()
		if up {
			return o
		}
	}
	return nil
}

// openProxy is n's relay of requests no token of the gateway's opens
// (a VNC grant's WebSocket): as they came, with no token of the
// gateway's for the worker. A worker that does not answer is logged,
// and the client gets the one answer (it names no worker).
func (g *Gateway) openProxy(n *node) *httputil.ReverseProxy {
	return &httputil.ReverseProxy{Transport: n.rt, FlushInterval: -1,
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(n.base)
			pr.Out.Host = n.host
		},
		ErrorHandler: func(rw http.ResponseWriter, r *http.Request, err error) {
			g.cfg.Log.Warn("relaying a VNC WebSocket", "worker", n.URL, "err", err)
			refuseVNC(rw)
		},
	}
}

// refuseVNC answers api.VNCRefused, as the worker's refusal reaches the
// client through the relay (which drops its Connection header: a GET
// has no body to leave unread): the two are one answer.
func refuseVNC(rw http.ResponseWriter) {
	answer(rw, http.StatusForbidden, api.VNCRefused)
}
