package sdk

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
)

// newRemote is a client of the worker at opts.Host, over TCP.
func newRemote(opts Options) (*Client, error) {
	hostport, ok := strings.CutPrefix(opts.Host, "tcp://")
	if !ok {
		return nil, fmt.Errorf("bad host %q: give tcp://HOST:PORT: %w", opts.Host, errdefs.ErrInvalidArgument)
	}
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil, fmt.Errorf("bad host %q: %v: give tcp://HOST:PORT: %w", opts.Host, err, errdefs.ErrInvalidArgument)
	}
	if opts.Token == "" {
		return nil, fmt.Errorf("the worker at %s takes a token: give one in DSEC_TOKEN or the config's token (dsec token create makes one on the worker's host): %w",
			opts.Host, errdefs.ErrUnauthenticated)
	}
	if opts.Transport != nil {
		return &Client{opts: opts, base: "http://" + hostport + "/" + api.Version, hc: &http.Client{Transport: opts.Transport}}, nil
	}
	t := &http.Transport{DialContext: (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		DisableCompression: true, MaxIdleConnsPerHost: 64, IdleConnTimeout: 90 * time.Second}
	scheme := "http"
	ip := net.ParseIP(host)
	if opts.Dial != nil {
		t.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) { return opts.Dial(ctx) }
		t.MaxIdleConnsPerHost = 256
	} else if opts.TLSCA != "" || opts.ClientCert != "" || !(host == "localhost" || ip != nil && ip.IsLoopback()) {
		cfg, err := auth.ClientTLS(opts.TLSCA, opts.ClientCert, opts.ClientKey)
		if err != nil {
			return nil, err
		}
		t.TLSClientConfig, scheme = cfg, "https"
	}
	return &Client{opts: opts, base: scheme + "://" + hostport + "/" + api.Version, hc: &http.Client{Transport: t}}, nil
}

// where names the worker the client talks to.
func (c *Client) where() string {
	if c.opts.Host != "" {
		return c.opts.Host
	}
	return c.opts.Root
}

// Remote says whether the client talks to a worker over TCP.
func (c *Client) Remote() bool { return c.opts.Host != "" }
