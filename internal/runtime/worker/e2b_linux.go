package worker

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
)

// The E2B front (package e2b) runs in every worker: for its own TCP
// listener (Config.E2B.Listen, TLS as the API's, with HTTP/2) if it has
// one, and for its gateways' fronts, which relay each request about
// one of its sandboxes here (e2bRelayed) and send it their creates'
// records (e2b.HeaderRecord); it keeps the records of the sandboxes it
// holds and their timeouts. It calls into the worker over in-process
// connections, which only it can make, with the authority of the key
// it (or a gateway) checked, or, for what it does on its own, a
// sandbox's timeout, of the sandbox's owner: never more.

// startFront makes the worker's E2B front and keeps its sandboxes'
// timeouts until ctx ends: its requests to the worker go through
// routes in process, with the authority the front names (actAs); each
// request on its own listener holds a slot of lim's.
func (w *worker) startFront(ctx context.Context, routes http.Handler, lim *limiter) (*e2b.Server, func(), error) {
	transport, stopInProc := e2b.InProcess(ctx, w.actAs(routes))
	front, err := e2b.New(e2b.Options{Transport: transport, Dir: filepath.Join(w.cfg.Root, "e2b"),
		Templates: w.cfg.E2B.Templates, Domain: w.cfg.E2B.Domain, ImageKeys: w.cfg.E2B.ImageKeys, Log: w.log,
		Authorize: func(key string) (string, bool, error) {
			t, err := w.tokens.Check(key, time.Now())
			return t.ID, t.Scope == auth.Admin, err
		},
		Hold: lim.take,
		Live: func(id string) bool {
			t, ok := w.tokens.Lookup(id)
			return ok && !t.Expired(time.Now())
		},
		Lookup: func(name string) (string, bool) {
			w.mu.Lock()
			defer w.mu.Unlock()
			if e := w.sandboxes[name]; e != nil && e.sb != nil && e.gone == nil {
				return e.sb.ID, true
			}
			return "", false
		}})
	if err != nil {
		stopInProc()
		return nil, nil, err
	}
	w.front.Store(front)
	go front.Run(ctx)
	return front, stopInProc, nil
}

// serveE2B serves front on l until ctx ends.
func (w *worker) serveE2B(ctx context.Context, l net.Listener, front *e2b.Server, errc chan<- error) {
	srv := &http.Server{Handler: front, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 64 << 10,
		BaseContext: func(net.Listener) context.Context { return ctx },
		ErrorLog:    slog.NewLogLogger(w.log.Handler(), slog.LevelDebug)}
	go func() { errc <- srv.Serve(l) }()
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
	}()
}

// e2bRelayed serves a request a gateway's E2B front relayed to this
// worker's, where its path says (/v1/e2b/control/PATH: E2B's control
// route PATH; /v1/e2b/sandbox/NAME/PORT/PATH: PATH on port PORT of
// sandbox NAME, envd's or a server's; /v1/e2b/token/NAME/PORT/PATH: the
// same, its caller the sandbox's owner for the access token it carries,
// which the front checks), with the authority of the token it came on
// behalf of, as the gateway vouched for it (none: the admin's). Only the
// admin's token may relay: a tenant's would have its key unchecked.
func (w *worker) e2bRelayed(rw http.ResponseWriter, r *http.Request) {
	front := w.front.Load()
	switch {
	case !vouched(r):
		fail(rw, fmt.Errorf("a token of scope %s cannot relay E2B requests: use an admin token (a gateway's): %w", tokenOf(r.Context()).Scope, errdefs.ErrPermissionDenied))
		return
	case front == nil:
		fail(rw, fmt.Errorf("this worker serves no E2B front (its log says why): %w", errdefs.ErrUnavailable))
		return
	}
	rl := e2b.Relay{Admin: true}
	if t := tokenOf(r.Context()); t != nil && t.Scope != auth.Admin {
		rl = e2b.Relay{ID: t.ID, Token: auth.OnBehalf(*t)}
	}
	rest, _ := strings.CutPrefix(r.URL.Path, "/"+api.Version+"/e2b/")
	mode, rest, _ := strings.Cut(rest, "/")
	switch mode {
	case "control":
		rest = "/" + rest
	case "sandbox", "token":
		parts := strings.SplitN(rest, "/", 3)
		p, err := strconv.Atoi(parts[min(1, len(parts)-1)])
		if len(parts) < 3 || api.ValidName(parts[0]) != nil || err != nil || p <= 0 || p > 65535 {
			fail(rw, fmt.Errorf("bad E2B relay %s: give /v1/e2b/%s/NAME/PORT/PATH: %w", r.URL.Path, mode, errdefs.ErrInvalidArgument))
			return
		}
		rl.Sandbox, rl.Port, rl.ByAccess, rest = parts[0], p, mode == "token", "/"+parts[2]
		http.NewResponseController(rw).EnableFullDuplex() // (a server's port: its client may write as it reads)
	default:
		fail(rw, fmt.Errorf("no E2B relay %s: give /v1/e2b/control/PATH, or /v1/e2b/sandbox/NAME/PORT/PATH: %w", r.URL.Path, errdefs.ErrNotFound))
		return
	}
	r2 := r.Clone(r.Context())
	r2.URL.Path, r2.URL.RawPath = rest, ""
	front.Relayed(rw, r2, rl)
}
