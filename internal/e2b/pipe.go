//go:build unix

package e2b

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// InProcess is a transport whose requests h serves in this process, for
// Options.Transport: the front's calls into a worker (or a gateway) go
// over connections only this process can make, never a socket another
// could reach. It serves until ctx ends; stop then waits 2 s at most
// for requests under way.
func InProcess(ctx context.Context, h http.Handler) (t *http.Transport, stop func()) {
	pipe := &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
	srv := &http.Server{Handler: h, BaseContext: func(net.Listener) context.Context { return ctx }}
	go srv.Serve(pipe)
	t = &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return pipe.dial(ctx) },
		DisableCompression: true, MaxIdleConnsPerHost: 256, IdleConnTimeout: 90 * time.Second}
	return t, func() {
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
		pipe.Close()
		t.CloseIdleConnections()
	}
}

// pipeListener hands connections made in this process to a server.
type pipeListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
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

// dial makes a connection the server accepts: a socket pair, so the
// kernel buffers both ways as on a real socket.
func (l *pipeListener) dial(ctx context.Context) (net.Conn, error) {
	// (Close-on-exec under ForkLock, as package net does where
	// SOCK_CLOEXEC is not: no child started meanwhile inherits them.)
	syscall.ForkLock.RLock()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	if err == nil {
		unix.CloseOnExec(fds[0])
		unix.CloseOnExec(fds[1])
	}
	syscall.ForkLock.RUnlock()
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
			} else {
				unix.Close(fds[1])
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
	return nil, fmt.Errorf("nothing serves the E2B front's calls in process: %w", net.ErrClosed)
}
