package worker

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"time"

	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
)

// The E2B front (package e2b) runs in the worker: its own TCP listener
// (Config.E2B.Listen, TLS as the API's, with HTTP/2), and calls into
// the worker over in-process connections, which only it can make, with
// the authority of the key it checked (or, for what it does on its own,
// a sandbox's timeout, of the sandbox's owner): never more.

// serveE2B serves the front on l until ctx ends: its requests to the
// worker go through routes in process, with the authority the front
// names (actAs); each request it serves holds a slot of lim's.
func (w *worker) serveE2B(ctx context.Context, l net.Listener, routes http.Handler, lim *limiter, errc chan<- error) error {
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
		return err
	}
	w.front.Store(front)
	srv := &http.Server{Handler: front, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 64 << 10,
		BaseContext: func(net.Listener) context.Context { return ctx },
		ErrorLog:    slog.NewLogLogger(w.log.Handler(), slog.LevelDebug)}
	go front.Run(ctx)
	go func() { errc <- srv.Serve(l) }()
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
		stopInProc()
	}()
	return nil
}
