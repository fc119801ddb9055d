package worker

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/durable"
	"github.com/dsec-project/dsec/internal/layer"
)

// The remote API. Besides its unix socket, whose file permissions are
// its guard (the admin's), a worker may listen on TCP (Config.Listen):
// the same API, every request carrying a token (package auth) as
// "Authorization: Bearer dsec_...". Off loopback it takes TLS only
// (Config.TLS; with ClientCA, only clients with a certificate that CA
// signed). No token, or a wrong or expired one, is 401 and nothing
// else. A token of scope sandboxes sees and acts on the sandboxes it
// created and the snapshots taken of them (and branches them): another
// token's is not found, as if it did not exist; what only the admin
// does (pools, stored policies, squash, shutdown) is refused, 403.

// maxRemoteRequests bounds the requests a worker serves over TCP at
// once (a stream of an exec's output holds one while it runs).
const maxRemoteRequests = 1024

// listenTCP listens on addr (tcp://HOST:PORT) as t says: TLS where t
// has a certificate, which it must off loopback.
func listenTCP(addr string, t TLS) (net.Listener, error) {
	hostport, ok := strings.CutPrefix(addr, "tcp://")
	if !ok {
		return nil, fmt.Errorf("bad listen address %q: give tcp://HOST:PORT: %w", addr, errdefs.ErrInvalidArgument)
	}
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil, fmt.Errorf("bad listen address %q: %v: give tcp://HOST:PORT: %w", addr, err, errdefs.ErrInvalidArgument)
	}
	if (t.Cert == "") != (t.Key == "") {
		return nil, fmt.Errorf("TLS needs both a certificate and its key (--tls-cert, --tls-key): %w", errdefs.ErrInvalidArgument)
	}
	if t.Cert == "" && !loopback(host) {
		return nil, fmt.Errorf("listening on %s, off loopback, needs TLS: give --tls-cert and --tls-key (dsec daemon certs DIR makes a CA and certificates), or listen on 127.0.0.1: %w",
			hostport, errdefs.ErrInvalidArgument)
	}
	if t.Cert == "" && t.ClientCA != "" {
		return nil, fmt.Errorf("--tls-client-ca needs TLS: give --tls-cert and --tls-key too: %w", errdefs.ErrInvalidArgument)
	}
	var cfg *tls.Config
	if t.Cert != "" {
		pair, err := tls.LoadX509KeyPair(t.Cert, t.Key)
		if err != nil {
			return nil, fmt.Errorf("TLS certificate %s and key %s: %v: %w", t.Cert, t.Key, err, errdefs.ErrInvalidArgument)
		}
		cfg = &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}
		if t.ClientCA != "" {
			b, err := os.ReadFile(t.ClientCA)
			if err != nil {
				return nil, fmt.Errorf("client CA: %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(b) {
				return nil, fmt.Errorf("client CA %s holds no PEM certificate: %w", t.ClientCA, errdefs.ErrInvalidArgument)
			}
			cfg.ClientCAs, cfg.ClientAuth = pool, tls.RequireAndVerifyClientCert
		}
	}
	l, err := net.Listen("tcp", hostport)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", hostport, err)
	}
	if cfg != nil {
		l = tls.NewListener(l, cfg)
	}
	return l, nil
}

// loopback says whether host names only this machine.
func loopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

type tokenKey struct{}

// tokenOf is the token a request came with (nil: over the unix socket).
func tokenOf(ctx context.Context) *auth.Token {
	t, _ := ctx.Value(tokenKey{}).(*auth.Token)
	return t
}

// ownerOf is what a sandbox or snapshot ctx's request makes records as
// its owner: its token's id, "" over the unix socket.
func ownerOf(ctx context.Context) string {
	if t := tokenOf(ctx); t != nil {
		return t.ID
	}
	return ""
}

// mayUse says whether ctx's caller may see and act on what owner owns:
// the admin (the unix socket, an admin token) on everything, a
// sandboxes token on its own.
func mayUse(ctx context.Context, owner string) bool {
	t := tokenOf(ctx)
	return t == nil || t.Scope == auth.Admin || t.ID == owner
}

// adminOnly refuses h to a token that is not the admin's.
func adminOnly(what string, h http.HandlerFunc) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		if t := tokenOf(r.Context()); t != nil && t.Scope != auth.Admin {
			fail(rw, fmt.Errorf("a token of scope %s cannot %s: use an admin token: %w", t.Scope, what, errdefs.ErrPermissionDenied))
			return
		}
		h(rw, r)
	}
}

// authed is next behind the tokens: a request without a valid one is
// answered 401 and nothing more; at most max are served at once
// (maxRemoteRequests), the rest answered busy.
func (w *worker) authed(next http.Handler, max int) http.Handler {
	slots := make(chan struct{}, max)
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		secret, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		t, err := w.tokens.Check(secret, time.Now())
		if err != nil {
			rw.Header().Set("WWW-Authenticate", `Bearer realm="dsec"`)
			answer(rw, http.StatusUnauthorized, api.Error{Class: api.ClassUnauthorized, Message: "unauthorized"})
			return
		}
		select {
		case slots <- struct{}{}:
			defer func() { <-slots }()
		default:
			fail(rw, fmt.Errorf("the worker serves %d requests over TCP already: retry later: %w", max, errdefs.ErrResourceExhausted))
			return
		}
		next.ServeHTTP(rw, r.WithContext(context.WithValue(r.Context(), tokenKey{}, &t)))
	})
}

// snapOwners records which token took each snapshot (a sandboxes
// token's own), in <root>/owners.json: the worker's alone.
type snapOwners struct {
	path string
	mu   sync.Mutex
	m    map[string]string // NAME:STEP: token id
}

func openSnapOwners(root string) *snapOwners {
	o := &snapOwners{path: filepath.Join(root, "owners.json"), m: map[string]string{}}
	if b, err := os.ReadFile(o.path); err == nil {
		json.Unmarshal(b, &o.m)
	}
	return o
}

func (o *snapOwners) get(ref string) string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.m[canonical(ref)]
}

func (o *snapOwners) set(ref, owner string) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	ref = canonical(ref)
	if o.m[ref] == owner {
		return nil
	}
	if owner == "" {
		delete(o.m, ref)
	} else {
		o.m[ref] = owner
	}
	b, _ := json.Marshal(o.m)
	return durable.WriteFile(o.path, b, 0o600)
}

// canonical is ref as the store names it.
func canonical(ref string) string {
	if r, err := layer.ParseRef(ref); err == nil {
		return r.String()
	}
	return ref
}

// mayUseSnapshot says whether ctx's caller may see and use the snapshot
// ref; errNoSnapshot is what it is told when it may not.
func (w *worker) mayUseSnapshot(ctx context.Context, ref string) bool {
	return mayUse(ctx, w.owners.get(ref))
}

func errNoSnapshot(ref string) error {
	return fmt.Errorf("no snapshot %s (dsec snap ls lists them): %w", canonical(ref), errdefs.ErrNotFound)
}
