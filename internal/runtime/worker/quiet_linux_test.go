package worker

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/dsec-project/dsec/internal/runtime/warm"
)

// TestQuietWhile: what the worker makes ahead of need waits while a
// request is served, and a request that streams (a command's output
// followed, a screen, a port) does not hold it back.
func TestQuietWhile(t *testing.T) {
	for _, tc := range []struct {
		method, path string
		holds        bool
	}{
		{"POST", "/v1/sandboxes", true},
		{"POST", "/v1/sandboxes/a/exec", true},
		{"PUT", "/v1/sandboxes/a/files", true},
		{"DELETE", "/v1/sandboxes/a", true},
		{"POST", "/v1/calls", true},
		{"GET", "/v1/sandboxes/a/execs/x-1", false},
		{"POST", "/v1/sandboxes/a/execs/x-1/signal", true},
		{"GET", "/v1/vnc/a", false},
		{"GET", "/v1/sandboxes/a/ports/8080/", false},
		{"POST", "/v1/sandboxes/a/ports/8080/api", false},
	} {
		t.Run(tc.method+" "+tc.path, func(t *testing.T) {
			q := warm.NewQuiet(5*time.Millisecond, time.Hour)
			in, out := make(chan struct{}), make(chan struct{})
			h := quietWhile(q, http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
				close(in)
				<-out
			}))
			served := make(chan struct{})
			go func() {
				h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(tc.method, tc.path, nil))
				close(served)
			}()
			<-in
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			err := q.Wait(ctx)
			cancel()
			if held := err != nil; held != tc.holds {
				t.Errorf("held while served: %v, want %v", held, tc.holds)
			}
			close(out)
			<-served
			ctx, cancel = context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := q.Wait(ctx); err != nil {
				t.Errorf("still held once served: %v", err)
			}
		})
	}
}
