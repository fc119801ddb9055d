package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
)

// A worker as the gateway reaches it: its transport, what its last
// heartbeat said, and the requests the gateway sends it itself, as its
// admin (on behalf of a client's token where one is named).

// node is one worker, as the gateway knows it.
type node struct {
	Worker
	host  string   // HOST:PORT
	base  *url.URL // scheme://HOST:PORT
	rt    http.RoundTripper
	proxy *httputil.ReverseProxy
	open  *httputil.ReverseProxy // requests no token of the gateway's opens (vnc.go)

	mu       sync.Mutex
	seen     time.Time // its last answer
	err      error     // its last heartbeat's failure
	down     bool
	cordoned bool
	absent   time.Time // since when discovery no longer names it
	info     api.VersionInfo
	held     []api.Sandbox // as of its last answer
	// pending are the creates sent its way that its list does not show
	// yet, by sandbox name (or, while under way, a reservation's key):
	// the memory each may take.
	pending map[string]pend
	reserve int // the last reservation's number
	// changed are the sandboxes this gateway made (true) or removed
	// (false) there lately, and when: a list asked for before may not
	// show it (beat).
	changed map[string]change
}

// change is a sandbox a gateway made or removed on a worker, and when.
type change struct {
	made bool
	at   time.Time
}

// newNode is w, parsed, with its transport.
func newNode(w Worker) (*node, error) {
	hostport, ok := strings.CutPrefix(w.URL, "tcp://")
	if !ok {
		return nil, fmt.Errorf("bad worker %q: give tcp://HOST:PORT: %w", w.URL, errdefs.ErrInvalidArgument)
	}
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil, fmt.Errorf("bad worker %q: %v: give tcp://HOST:PORT: %w", w.URL, err, errdefs.ErrInvalidArgument)
	}
	if w.Token == "" {
		return nil, fmt.Errorf("worker %s has no token: give an admin token of its (dsec token create --scope admin on its host): %w", w.URL, errdefs.ErrInvalidArgument)
	}
	t := &http.Transport{DialContext: (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		DisableCompression: true, MaxIdleConnsPerHost: 256, IdleConnTimeout: 90 * time.Second, ResponseHeaderTimeout: 0}
	scheme := "http"
	ip := net.ParseIP(host)
	if w.CA != "" || w.Cert != "" || w.ServerName != "" || !(host == "localhost" || ip != nil && ip.IsLoopback()) {
		cfg, err := auth.ClientTLS(w.CA, w.Cert, w.Key)
		if err != nil {
			return nil, fmt.Errorf("worker %s: %w", w.URL, err)
		}
		cfg.ServerName = w.ServerName
		t.TLSClientConfig, scheme = cfg, "https"
	}
	return &node{Worker: w, host: hostport, base: &url.URL{Scheme: scheme, Host: hostport}, rt: t}, nil
}

// errRefused marks a worker's refusal of the gateway's own token.
var errRefused = errors.New("refuses the gateway's token for it")

// refused is the infrastructure failure of a worker's 401 to the
// gateway: its token for the worker is wrong, not the client's.
func (n *node) refused() error {
	return fmt.Errorf("worker %s %w (--worker-token: an admin token of that worker's): %w", n.URL, errRefused, errdefs.ErrUnavailable)
}

// unreachable is the infrastructure failure of a request n did not
// answer.
func (n *node) unreachable(err error) error {
	n.mu.Lock()
	seen := n.seen
	n.mu.Unlock()
	since := "never answered"
	if !seen.IsZero() {
		since = "last answered " + seen.UTC().Format(time.RFC3339)
	}
	return fmt.Errorf("worker %s does not answer (%s): %v: %w", n.URL, since, err, errdefs.ErrUnavailable)
}

// get asks n for path as its admin (or on behalf of t) and decodes
// its JSON answer into out.
func (n *node) get(ctx context.Context, path string, t *auth.Token, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, n.base.String()+path, nil)
	if err != nil {
		return err
	}
	n.authorize(req.Header, t)
	resp, err := n.rt.RoundTrip(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
		return json.NewDecoder(io.LimitReader(resp.Body, 64<<20)).Decode(out)
	case http.StatusUnauthorized:
		return n.refused()
	}
	return errorOf(resp)
}

// authorize makes h n's admin's, on behalf of t (nil: the admin).
func (n *node) authorize(h http.Header, t *auth.Token) {
	h.Set("Authorization", "Bearer "+n.Token)
	h.Del(auth.OnBehalfHeader)
	h.Del(e2b.HeaderActAs) // (an E2B front's, never a client's to send on)
	h.Del(e2b.HeaderTemplate)
	h.Del(e2b.HeaderRecord)
	if t != nil && t.Scope != auth.Admin {
		h.Set(auth.OnBehalfHeader, auth.OnBehalf(*t))
	}
}

// errorOf is the error a worker's answer of a failure says.
func errorOf(resp *http.Response) error {
	var e api.Error
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&e); err != nil || e.Class == "" {
		e = api.Error{Class: api.ClassOfStatus(resp.StatusCode), Message: resp.Status}
	}
	return &e
}
