// Package gateway serves a worker's API for a fleet of workers (dsec
// gateway): a request about a sandbox goes to the worker that holds it,
// a create or a call to the worker with the most room, a list to every
// worker. It keeps no state of its own but its cordons (Config.Cordons):
// the workers' lists, asked at every heartbeat, say where each sandbox
// is, so a gateway started again (or a second one beside it) routes as
// the first did.
//
// Clients hold the gateway's own tokens (<root>/tokens.json, dsec
// token create on its root); the gateway speaks to each worker with an
// admin token of that worker's, and names the client's token on every
// request (auth.OnBehalfHeader), which the worker serves as that
// token's: its scope, what it may do, its quota (per worker) and its
// sandboxes alone. A worker that does not answer its heartbeats for
// DownAfter is down: its sandboxes are listed as unreachable and a
// request about one is an infrastructure failure (503), at once, and
// no create goes there until it answers again.
package gateway

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
)

// Worker is a worker of the fleet, as the gateway reaches it.
type Worker struct {
	// URL is its TCP API: tcp://HOST:PORT (dsec daemon --listen).
	URL string `json:"url"`
	// Token is an admin token of the worker's.
	Token string `json:"token"`
	// CA is the PEM file its certificate is checked against; none:
	// plain HTTP to a loopback address, else the system's roots.
	CA string `json:"ca,omitempty"`
	// Cert and Key are the gateway's client certificate, for a worker
	// that asks for one (dsec daemon --tls-client-ca).
	Cert string `json:"cert,omitempty"`
	Key  string `json:"key,omitempty"`
	// ServerName is the name its certificate must bear ("": the host
	// of URL).
	ServerName string `json:"server_name,omitempty"`
}

// Config is a gateway's configuration.
type Config struct {
	Workers []Worker
	// Discover, if any, finds the fleet's workers besides Workers (its
	// Kubernetes Service's endpoints): it calls found with all of them
	// at each change until ctx ends (Kubernetes).
	Discover func(ctx context.Context, found func([]Worker)) error
	// Tokens are the gateway's clients' tokens.
	Tokens *auth.Store
	// Heartbeat is how often each worker is asked how it is and what it
	// holds (default 2 s); DownAfter how long one may not answer before
	// it is down (default three heartbeats).
	Heartbeat, DownAfter time.Duration

	Version string
	Log     *slog.Logger
}

// Gateway serves the API for the fleet (ServeHTTP) while Run heartbeats.
type Gateway struct {
	cfg   Config
	fleet atomic.Pointer[[]*node] // all's
	mux   *http.ServeMux

	joining sync.Mutex      // one change of the fleet at a time
	ctx     context.Context // Run's, once it runs (under joining)
	beating sync.WaitGroup  // the heartbeats' loops

	placing   sync.Mutex // one placement at a time
	mu        sync.Mutex
	routes    map[string]*node          // a sandbox's name: its worker's
	making    map[string]bool           // names a create through this gateway is making
	estimates map[estimateKey]estimated // (near.go) by worker, tenant and layers
	next      int                       // the node a tie of placement goes to

	settling settling // (claims.go) the claims of creates made, to settle
}

// New is a gateway of cfg's workers; Run starts their heartbeats.
func New(cfg Config) (*Gateway, error) {
	if len(cfg.Workers) == 0 && cfg.Discover == nil {
		return nil, fmt.Errorf("a gateway needs workers: give --worker tcp://HOST:PORT (one per worker), or --kubernetes-service NAMESPACE/NAME: %w", errdefs.ErrInvalidArgument)
	}
	cfg.Heartbeat = cmp.Or(cfg.Heartbeat, 2*time.Second)
	cfg.DownAfter = cmp.Or(cfg.DownAfter, 3*cfg.Heartbeat)
	cfg.Log = cmp.Or(cfg.Log, slog.Default())
	g := &Gateway{cfg: cfg, routes: map[string]*node{}, making: map[string]bool{}, estimates: map[estimateKey]estimated{}}
	g.fleet.Store(&[]*node{})
	var nodes []*node
	for _, w := range cfg.Workers {
		n, err := g.newNode(w)
		if err != nil {
			return nil, err
		}
		if slices.ContainsFunc(nodes, func(o *node) bool { return o.host == n.host }) {
			return nil, fmt.Errorf("worker %s is named twice: %w", w.URL, errdefs.ErrInvalidArgument)
		}
		nodes = append(nodes, n)
	}
	g.fleet.Store(&nodes)
	g.mux = g.routesMux()
	return g, nil
}

// all is the fleet's workers as of now (a slice never changed: one
// joining or leaving makes another).
func (g *Gateway) all() []*node { return *g.fleet.Load() }

// ServeHTTP serves r for the fleet, behind the gateway's tokens.
func (g *Gateway) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	if name := api.VNCSandbox(r.Method, r.URL.Path); name != "" { // a VNC grant's token opens it (vnc.go)
		g.vnc(rw, r, name)
		return
	}
	secret, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	t, err := g.cfg.Tokens.Check(secret, time.Now())
	if err != nil {
		rw.Header().Set("WWW-Authenticate", `Bearer realm="dsec"`)
		if r.ProtoMajor == 1 {
			rw.Header().Set("Connection", "close") // its body unread
		}
		answer(rw, http.StatusUnauthorized, api.Error{Class: api.ClassUnauthorized, Message: "unauthorized"})
		return
	}
	g.mux.ServeHTTP(rw, r.WithContext(context.WithValue(r.Context(), tokenKey{}, &t)))
}

type tokenKey struct{}

// templateKey marks a create whose spec is the E2B front's template of
// that name: the gateway's configuration, not its caller's; recordKey
// one the front sends with its record (e2b.HeaderRecord).
type (
	templateKey struct{}
	recordKey   struct{}
)

// ActAs serves the fleet's API to an E2B front in this process
// (e2b.InProcess): each request with the authority e2b.HeaderActAs
// names, a gateway token's ID or e2b.ActAsAdmin, which only such a
// request carries (the front checked the caller's key itself). A create
// the front marks as its template's (e2b.HeaderTemplate) is sent to its
// worker as the admin's spec on behalf of the caller, as a worker's own
// front makes one.
func (g *Gateway) ActAs() http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		id := r.Header.Get(e2b.HeaderActAs)
		if id == "" {
			answer(rw, http.StatusUnauthorized, api.Error{Class: api.ClassUnauthorized, Message: "unauthorized"})
			return
		}
		ctx := context.WithValue(r.Context(), tokenKey{}, g.actingAs(id))
		if name := r.Header.Get(e2b.HeaderTemplate); name != "" {
			ctx = context.WithValue(ctx, templateKey{}, name)
		}
		if rec := r.Header.Get(e2b.HeaderRecord); rec != "" {
			ctx = context.WithValue(ctx, recordKey{}, rec)
		}
		g.mux.ServeHTTP(rw, r.WithContext(ctx))
		// What a worker answered before it read all (a file past a full
		// disk) is read here, in process, so that the front reads the
		// answer, not a connection closed under its write.
		io.Copy(io.Discard, r.Body)
	})
}

// actingAs is the token an E2B front acts as: the gateway's token of id
// (a removed one's: its own sandboxes only, as scope sandboxes), or the
// admin's (e2b.ActAsAdmin).
func (g *Gateway) actingAs(id string) *auth.Token {
	if id == e2b.ActAsAdmin {
		return &auth.Token{Scope: auth.Admin}
	}
	if t, ok := g.cfg.Tokens.Lookup(id); ok {
		return &t
	}
	return &auth.Token{ID: id, Scope: auth.Sandboxes}
}

func tokenOf(r *http.Request) *auth.Token { return r.Context().Value(tokenKey{}).(*auth.Token) }

func (g *Gateway) routesMux() *http.ServeMux {
	v := "/" + api.Version
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+v+"/version", g.version)
	mux.HandleFunc("GET "+v+"/nodes", g.adminOnly("list the workers", g.listNodes))
	mux.HandleFunc("POST "+v+"/nodes/{node}/cordon", g.adminOnly("cordon workers", g.cordon(true)))
	mux.HandleFunc("POST "+v+"/nodes/{node}/uncordon", g.adminOnly("uncordon workers", g.cordon(false)))
	mux.HandleFunc("POST "+v+"/sandboxes", g.create)
	mux.HandleFunc("GET "+v+"/sandboxes", g.list)
	mux.HandleFunc("GET "+v+"/sandboxes/{name}", g.inspect)
	mux.HandleFunc("POST "+v+"/sandboxes/{name}/fork", g.fork)
	mux.HandleFunc("GET "+v+"/groups", g.groups)
	mux.HandleFunc("GET "+v+"/groups/{id}", g.toHaving("group"))
	mux.HandleFunc("DELETE "+v+"/groups/{id}", g.toHaving("group"))
	mux.HandleFunc("POST "+v+"/groups/{id}/keep", g.toHaving("group"))
	mux.HandleFunc("POST "+v+"/leases", g.createLease)
	mux.HandleFunc("GET "+v+"/leases", g.leases)
	mux.HandleFunc("GET "+v+"/leases/{id}", g.toHaving("lease"))
	mux.HandleFunc("POST "+v+"/leases/{id}/renew", g.toHaving("lease"))
	mux.HandleFunc("DELETE "+v+"/leases/{id}", g.toHaving("lease"))
	mux.HandleFunc(v+"/sandboxes/{name}", g.toHolder)
	mux.HandleFunc(v+"/sandboxes/{name}/{rest...}", g.toHolder)
	mux.HandleFunc("POST "+v+"/calls", g.call)
	mux.HandleFunc("POST "+v+"/batches", g.batch)
	mux.HandleFunc("POST "+v+"/branches", g.branch)
	mux.HandleFunc("GET "+v+"/snapshots", g.snapshots)
	mux.HandleFunc("DELETE "+v+"/snapshots/{ref...}", g.removeSnapshot)
	mux.HandleFunc("POST "+v+"/squash", g.adminOnly("squash snapshots", g.squash))
	mux.HandleFunc("GET "+v+"/policies", g.policies)
	mux.HandleFunc("GET "+v+"/policies/{name}", g.policy)
	mux.HandleFunc("PUT "+v+"/policies/{name}", g.adminOnly("store policies", g.putPolicy))
	mux.HandleFunc("DELETE "+v+"/policies/{name}", g.adminOnly("remove stored policies", g.removeAll("policy")))
	mux.HandleFunc("GET "+v+"/pools", g.pools)
	mux.HandleFunc("PUT "+v+"/pools/{name}", g.adminOnly("make or resize pools", g.putPool))
	mux.HandleFunc("DELETE "+v+"/pools/{name}", g.adminOnly("remove pools", g.removeAll("pool")))
	mux.HandleFunc("/", func(rw http.ResponseWriter, r *http.Request) {
		fail(rw, fmt.Errorf("the gateway does not serve %s %s: ask a worker of the fleet for it (dsec --host tcp://WORKER): %w",
			r.Method, r.URL.Path, errdefs.ErrNotImplemented))
	})
	return mux
}

func (g *Gateway) adminOnly(what string, h http.HandlerFunc) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		if t := tokenOf(r); t.Scope != auth.Admin {
			fail(rw, fmt.Errorf("a token of scope %s cannot %s: use an admin token of the gateway's: %w", t.Scope, what, errdefs.ErrPermissionDenied))
			return
		}
		h(rw, r)
	}
}

// maxBody bounds a create's or call's body (a worker's bound too).
const maxBody = 1 << 20

// readBody reads r's body, maxBody at most; false: it is answered.
func readBody(rw http.ResponseWriter, r *http.Request) ([]byte, bool) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil || len(body) > maxBody {
		fail(rw, fmt.Errorf("request body over %d KiB, or unread: %v: %w", maxBody>>10, err, errdefs.ErrOutOfRange))
		return nil, false
	}
	return body, true
}

func answer(rw http.ResponseWriter, status int, v any) {
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(status)
	json.NewEncoder(rw).Encode(v)
}

// fail answers err as a worker would (api.ErrorOf).
func fail(rw http.ResponseWriter, err error) {
	body, status := api.ErrorOf(err)
	answer(rw, status, body)
}
