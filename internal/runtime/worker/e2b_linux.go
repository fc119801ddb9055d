package worker

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
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
// worker's (/v1/e2b/...: E2B's path after it), with the authority of
// the token it came on behalf of (none: the admin's). Only the admin's
// token may relay: a tenant's would have its key unchecked.
func (w *worker) e2bRelayed(rw http.ResponseWriter, r *http.Request) {
	front := w.front.Load()
	switch {
	case !vouched(r):
		fail(rw, fmt.Errorf("a token of scope %s cannot relay E2B requests: use an admin token (a gateway's): %w", tokenOf(r.Context()).Scope, errdefs.ErrPermissionDenied))
		return
	case front == nil:
		fail(rw, fmt.Errorf("this worker's E2B front is not started yet: try again: %w", errdefs.ErrUnavailable))
		return
	}
	id, admin := "", true
	if t := tokenOf(r.Context()); t != nil && t.Scope != auth.Admin {
		id, admin = t.ID, false
	}
	http.StripPrefix("/"+api.Version+"/e2b", http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		front.Relayed(rw, r, id, admin)
	})).ServeHTTP(rw, r)
}
