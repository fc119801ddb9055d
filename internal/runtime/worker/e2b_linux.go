package worker

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
)

// The E2B front (package e2b) runs in the worker: its own TCP listener
// (Config.E2B.Listen, TLS as the API's, with HTTP/2), and calls into
// the worker over in-process connections, which only it can make, with
// the authority of the key it checked (or, for what it does on its own,
// a sandbox's timeout, of the sandbox's owner): never more.

// pipeListener hands connections made in this process to a server.
type pipeListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func newPipeListener() *pipeListener {
	return &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *pipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *pipeListener) Close() error { l.once.Do(func() { close(l.done) }); return nil }

func (l *pipeListener) Addr() net.Addr { return &net.UnixAddr{Name: "e2b-front", Net: "unix"} }

// Dial makes a connection the server accepts: a socket pair, so the
// kernel buffers both ways as on a real socket.
func (l *pipeListener) Dial(ctx context.Context) (net.Conn, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	ends := [2]net.Conn{}
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "e2b-front")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			if i == 1 {
				ends[0].Close()
			}
			return nil, err
		}
		ends[i] = c
	}
	select {
	case l.conns <- ends[0]:
		return ends[1], nil
	case <-ctx.Done():
	case <-l.done:
	}
	ends[0].Close()
	ends[1].Close()
	return nil, fmt.Errorf("the worker is not serving its E2B front: %w", net.ErrClosed)
}

// serveE2B serves the front on l until ctx ends: its requests to the
// worker go through routes in process, with the authority the front
// names (actAs); each request it serves holds a slot of lim's.
func (w *worker) serveE2B(ctx context.Context, l net.Listener, routes http.Handler, lim *limiter, errc chan<- error) error {
	pipe := newPipeListener()
	inproc := &http.Server{Handler: w.actAs(routes), BaseContext: func(net.Listener) context.Context { return ctx }}
	go inproc.Serve(pipe)
	transport := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return pipe.Dial(ctx) },
		DisableCompression: true, MaxIdleConnsPerHost: 256, IdleConnTimeout: 90 * time.Second}
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
		inproc.Shutdown(sctx)
		pipe.Close()
		transport.CloseIdleConnections()
	}()
	return nil
}
