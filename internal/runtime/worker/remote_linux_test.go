package worker

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
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
		l, err := ListenTCP(c.addr, c.tls, false)
		if l != nil {
			l.Close()
		}
		if (err == nil) != c.ok || (err != nil && !errdefs.IsInvalidArgument(err)) {
			t.Errorf("%s %+v: %v", c.addr, c.tls, err)
		}
	}
}

// TestListenTCPProtocols: over TLS a listener offers HTTP/1.1, and
// HTTP/2 first where asked (the E2B front's e2b.http2); a client that
// offers both gets what the listener says.
func TestListenTCPProtocols(t *testing.T) {
	certs := t.TempDir()
	if err := auth.MakeCerts(certs, []string{"127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	ca, err := os.ReadFile(filepath.Join(certs, auth.CAFile))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	withTLS := TLS{Cert: filepath.Join(certs, auth.ServerFile), Key: filepath.Join(certs, auth.ServerKeyFile)}
	for _, c := range []struct {
		h2        bool
		wantMajor int
	}{{false, 1}, {true, 2}} {
		l, err := ListenTCP("tcp://127.0.0.1:0", withTLS, c.h2)
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})}
		go srv.Serve(l)
		hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}, ForceAttemptHTTP2: true}}
		resp, err := hc.Get("https://" + l.Addr().String() + "/")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.ProtoMajor != c.wantMajor {
			t.Errorf("h2 %v: the client got %s, want HTTP/%d", c.h2, resp.Proto, c.wantMajor)
		}
		hc.CloseIdleConnections()
		srv.Close()
	}
}

// TestAuthed: no token or a bad one is 401 with nothing said, its body
// unread; a good one reaches the handler with its token; each token has
// its own bound of requests at once, and all together a bound above
// them: past either the rest are busy, 429, until one ends.
func TestAuthed(t *testing.T) {
	w := &worker{tokens: auth.Open(t.TempDir())}
	secretA, tokA, err := w.tokens.Create(auth.Sandboxes, 0)
	if err != nil {
		t.Fatal(err)
	}
	secretB, tokB, err := w.tokens.Create(auth.Sandboxes, 0)
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	entered := make(chan string, 4)
	h := w.authed(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		entered <- tokenOf(r.Context()).ID
		<-release
	}), newLimiter(3, 2))
	do := func(bearer string) *httptest.ResponseRecorder {
		body := &readCounter{r: strings.NewReader("{}")}
		r := httptest.NewRequest("POST", "/v1/sandboxes", body)
		if bearer != "" {
			r.Header.Set("Authorization", "Bearer "+bearer)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		if rec.Code == http.StatusUnauthorized && body.n > 0 {
			t.Errorf("%q: refused, but its body was read", bearer)
		}
		return rec
	}
	for _, bad := range []string{"", "dsec_" + strings.Repeat("1", 40), secretA + "x"} {
		rec := do(bad)
		if rec.Code != http.StatusUnauthorized || strings.TrimSpace(rec.Body.String()) != `{"class":"unauthorized","message":"unauthorized"}` || rec.Header().Get("WWW-Authenticate") == "" {
			t.Errorf("%q: %d %s", bad, rec.Code, rec.Body)
		}
	}
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() { do(secretA) })
	}
	for range 2 {
		if id := <-entered; id != tokA.ID {
			t.Fatalf("the handler saw token %q", id)
		}
	}
	// A has its two: its third is busy, B still gets in.
	if rec := do(secretA); rec.Code != http.StatusTooManyRequests || !strings.Contains(rec.Body.String(), "this token has 2 requests") {
		t.Errorf("past a token's bound: %d %s", rec.Code, rec.Body)
	}
	wg.Go(func() { do(secretB) })
	if id := <-entered; id != tokB.ID {
		t.Fatalf("the handler saw token %q", id)
	}
	// Three in all: B's second is busy for the worker's sake.
	if rec := do(secretB); rec.Code != http.StatusTooManyRequests || !strings.Contains(rec.Body.String(), "serves 3 requests") {
		t.Errorf("past the bound of all: %d %s", rec.Code, rec.Body)
	}
	close(release)
	wg.Wait()
	if rec := do(secretA); rec.Code != http.StatusOK {
		t.Errorf("after: %d %s", rec.Code, rec.Body)
	}
}

// readCounter counts what is read of a body.
type readCounter struct {
	r io.Reader
	n int
}

func (c *readCounter) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += n
	return n, err
}

// TestLimiterKeepsForTheAdmin: tenants that fill all but the admin's
// eighth of the slots leave admin tokens a way in.
func TestLimiterKeepsForTheAdmin(t *testing.T) {
	l := newLimiter(16, 16)
	for i := range 14 {
		if _, err := l.take(strconv.Itoa(i%2), false); err != nil {
			t.Fatalf("tenant slot %d: %v", i, err)
		}
	}
	if _, err := l.take("t", false); !errdefs.IsResourceExhausted(err) {
		t.Errorf("a tenant in the admin's eighth: %v", err)
	}
	release, err := l.take("admin", true)
	if err != nil {
		t.Fatalf("the admin: %v", err)
	}
	release()
	release() // once only
	if _, err := l.take("admin", true); err != nil {
		t.Errorf("the admin's slot after its release: %v", err)
	}
}

// TestOnBehalf: an admin token's request on behalf of another token is
// served as that token's, its scope and all; a sandboxes token may not
// act on behalf of anyone (403), and a bad header is 400, both before
// the body is read.
func TestOnBehalf(t *testing.T) {
	w := &worker{tokens: auth.Open(t.TempDir())}
	admin, _, err := w.tokens.Create(auth.Admin, 0)
	if err != nil {
		t.Fatal(err)
	}
	tenant, tokT, err := w.tokens.Create(auth.Sandboxes, 0)
	if err != nil {
		t.Fatal(err)
	}
	h := w.authed(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		t := tokenOf(r.Context())
		fmt.Fprintf(rw, "%s %s %v trusted=%v", t.ID, t.Scope, t.Allow, isTrusted(r.Context()))
	}), newLimiter(8, 8))
	client := auth.Token{ID: "0123456789ab", Scope: auth.Sandboxes, Allow: []string{auth.AllowPolicy}, SHA256: "x"}
	for _, c := range []struct {
		bearer, behalf string
		template       string // e2b.HeaderTemplate: an admin's vouching, on behalf of a client
		code           int
		body           string
	}{
		{admin, auth.OnBehalf(client), "", 200, "0123456789ab sandboxes [policy] trusted=false"},
		{admin, auth.OnBehalf(client), "base", 200, "0123456789ab sandboxes [policy] trusted=true"},
		{admin, "", "", 200, ""},
		{tenant, "", "", 200, tokT.ID + " sandboxes [] trusted=false"},
		{tenant, "", "base", 200, tokT.ID + " sandboxes [] trusted=false"}, // a tenant's own claim: nothing
		{tenant, auth.OnBehalf(client), "", 403, `"class":"denied"`},
		{admin, "e30", "", 400, `"class":"invalid"`}, // {}: no scope
		{admin, "%%%", "", 400, `"class":"invalid"`},
	} {
		body := &readCounter{r: strings.NewReader("{}")}
		r := httptest.NewRequest("POST", "/v1/sandboxes", body)
		r.Header.Set("Authorization", "Bearer "+c.bearer)
		if c.behalf != "" {
			r.Header.Set(auth.OnBehalfHeader, c.behalf)
		}
		if c.template != "" {
			r.Header.Set(e2b.HeaderTemplate, c.template)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		if rec.Code != c.code || !strings.Contains(rec.Body.String(), c.body) {
			t.Errorf("%.12s on behalf of %q: %d %s, want %d %s", c.bearer, c.behalf, rec.Code, rec.Body, c.code, c.body)
		}
		if c.code != 200 && body.n > 0 {
			t.Errorf("%q: refused, but its body was read", c.behalf)
		}
	}
}
