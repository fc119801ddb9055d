package worker

import (
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/auth"
)

// TestListenTCP: loopback takes plain TCP; anything else needs TLS, a
// certificate needs its key, a client CA needs TLS; a bad address is
// the caller's error.
func TestListenTCP(t *testing.T) {
	certs := t.TempDir()
	if err := auth.MakeCerts(certs, []string{"127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	withTLS := TLS{Cert: filepath.Join(certs, auth.ServerFile), Key: filepath.Join(certs, auth.ServerKeyFile)}
	for _, c := range []struct {
		addr string
		tls  TLS
		ok   bool
	}{
		{"tcp://127.0.0.1:0", TLS{}, true},
		{"tcp://[::1]:0", TLS{}, true},
		{"tcp://localhost:0", TLS{}, true},
		{"tcp://0.0.0.0:0", TLS{}, false},
		{"tcp://0.0.0.0:0", withTLS, true},
		{"tcp://127.0.0.1:0", TLS{Cert: withTLS.Cert}, false},
		{"tcp://127.0.0.1:0", TLS{ClientCA: filepath.Join(certs, auth.CAFile)}, false},
		{"tcp://127.0.0.1:0", TLS{Cert: withTLS.Cert, Key: withTLS.Key, ClientCA: filepath.Join(certs, auth.ServerKeyFile)}, false},
		{"127.0.0.1:0", TLS{}, false},
		{"tcp://nohost", TLS{}, false},
	} {
		l, err := listenTCP(c.addr, c.tls)
		if l != nil {
			l.Close()
		}
		if (err == nil) != c.ok || (err != nil && !errdefs.IsInvalidArgument(err)) {
			t.Errorf("%s %+v: %v", c.addr, c.tls, err)
		}
	}
}

// TestAuthed: no token or a bad one is 401 with nothing said; a good one
// reaches the handler with its token; past the bound of requests at once
// the rest are busy, 429, until one ends.
func TestAuthed(t *testing.T) {
	w := &worker{tokens: auth.Open(t.TempDir())}
	secret, tok, err := w.tokens.Create(auth.Sandboxes, 0)
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	entered := make(chan string, 4)
	h := w.authed(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		entered <- tokenOf(r.Context()).ID
		<-release
	}), 2)
	do := func(bearer string) *httptest.ResponseRecorder {
		r := httptest.NewRequest("GET", "/v1/sandboxes", nil)
		if bearer != "" {
			r.Header.Set("Authorization", "Bearer "+bearer)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		return rec
	}
	for _, bad := range []string{"", "dsec_" + strings.Repeat("1", 40), secret + "x"} {
		rec := do(bad)
		if rec.Code != http.StatusUnauthorized || strings.TrimSpace(rec.Body.String()) != `{"class":"unauthorized","message":"unauthorized"}` || rec.Header().Get("WWW-Authenticate") == "" {
			t.Errorf("%q: %d %s", bad, rec.Code, rec.Body)
		}
	}
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() { defer wg.Done(); do(secret) }()
	}
	for range 2 {
		if id := <-entered; id != tok.ID {
			t.Fatalf("the handler saw token %q", id)
		}
	}
	if rec := do(secret); rec.Code != http.StatusTooManyRequests || !strings.Contains(rec.Body.String(), "retry later") {
		t.Errorf("past the bound: %d %s", rec.Code, rec.Body)
	}
	close(release)
	wg.Wait()
	if rec := do(secret); rec.Code != http.StatusOK {
		t.Errorf("after: %d %s", rec.Code, rec.Body)
	}
}
