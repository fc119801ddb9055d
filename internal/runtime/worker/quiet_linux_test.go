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
// request is served, for the request's first Most at the longest (a
// command that runs for minutes, an output followed, a screen).
func TestQuietWhile(t *testing.T) {
	const most = 300 * time.Millisecond
	q := warm.NewQuiet(5*time.Millisecond, most)
	in, out := make(chan struct{}), make(chan struct{})
	h := quietWhile(q, http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		close(in)
		<-out
	}))
	served := make(chan struct{})
	t0 := time.Now()
	go func() {
		h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("POST", "/v1/sandboxes/a/exec", nil))
		close(served)
	}()
	<-in
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	err := q.Wait(ctx)
	cancel()
	if err == nil && time.Since(t0) < most {
		t.Fatal("nothing held back while a request was served")
	}
	time.Sleep(most - time.Since(t0) + 20*time.Millisecond)
	ctx, cancel = context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := q.Wait(ctx); err != nil {
		t.Errorf("held back by a request begun over %v ago: %v", most, err)
	}
	close(out)
	<-served
}
