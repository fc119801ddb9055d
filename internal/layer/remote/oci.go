package remote

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	orerrdef "oras.land/oras-go/v2/errdef"
	"oras.land/oras-go/v2/registry/remote"
	"oras.land/oras-go/v2/registry/remote/auth"
	"oras.land/oras-go/v2/registry/remote/credentials"
	"oras.land/oras-go/v2/registry/remote/errcode"
	"oras.land/oras-go/v2/registry/remote/retry"

	"github.com/dsec-project/dsec/internal/layer"
)

// OCI is a repository prefix in an OCI distribution registry.
type OCI struct {
	host, repo string
	o          Options
	client     *auth.Client
}

func openOCI(host, repo string, o Options) *OCI {
	return &OCI{host: host, repo: repo, o: o, client: Client(host, o)}
}

// Client is a registry client for host: credentials from o, else as
// docker login left them (the config file and its credential helpers);
// bearer tokens cached; retries on the errors worth retrying.
func Client(host string, o Options) *auth.Client {
	c := &auth.Client{Client: retry.DefaultClient, Cache: auth.NewCache()}
	if o.PublicOnly {
		c.Client = publicClient()
	}
	c.SetUserAgent("dsec")
	switch {
	case o.Anonymous:
	case o.Username != "" || o.Password != "":
		c.Credential = auth.StaticCredential(host, auth.Credential{Username: o.Username, Password: o.Password})
	default:
		if store, err := credentials.NewStoreFromDocker(credentials.StoreOptions{}); err == nil {
			c.Credential = credentials.Credential(store)
		}
	}
	return c
}

func (t *OCI) String() string { return "oci://" + t.host + "/" + t.repo }

// Repo opens HOST/REPO/NAME.
func (t *OCI) Repo(ctx context.Context, ref layer.Ref) (Repo, error) {
	r, err := remote.NewRepository(t.host + "/" + t.repo + "/" + ref.Name)
	if err != nil {
		return nil, fmt.Errorf("%s: %v: %w", t, err, errdefs.ErrInvalidArgument)
	}
	// A registry on this host is spoken to over plain HTTP, as Docker
	// does (and dsec's image pulls); --insecure says it of no other.
	r.PlainHTTP = t.o.Insecure || Loopback(t.host)
	r.Client = t.client
	return ociRepo{r, ref, t.String()}, nil
}

type ociRepo struct {
	r    *remote.Repository
	ref  layer.Ref
	name string
}

// Classify turns registry errors into errdefs classes with a hint.
func Classify(err error) error { return classify(err) }

// classify turns registry errors into errdefs classes with a hint.
func classify(err error) error {
	if err == nil {
		return nil
	}
	var ec *errcode.ErrorResponse
	switch {
	case errors.Is(err, orerrdef.ErrNotFound):
		return fmt.Errorf("%v: %w", err, errdefs.ErrNotFound)
	case errors.Is(err, auth.ErrBasicCredentialNotFound) || errors.As(err, &ec) && (ec.StatusCode == 401 || ec.StatusCode == 403):
		return fmt.Errorf("%v (log in with docker login, or set DSEC_REGISTRY_USERNAME and DSEC_REGISTRY_PASSWORD): %w", err, errdefs.ErrPermissionDenied)
	case errors.As(err, &ec) && ec.StatusCode == 404:
		return fmt.Errorf("%v: %w", err, errdefs.ErrNotFound)
	}
	return err
}

func (r ociRepo) Resolve(ctx context.Context) (ocispec.Descriptor, error) {
	d, err := r.r.Resolve(ctx, r.ref.Version)
	return d, classify(err)
}

func (r ociRepo) Exists(ctx context.Context, d ocispec.Descriptor) (bool, error) {
	ok, err := r.r.Exists(ctx, d)
	return ok, classify(err)
}

func (r ociRepo) Fetch(ctx context.Context, d ocispec.Descriptor) (io.ReadCloser, error) {
	rc, err := r.r.Fetch(ctx, d)
	return rc, classify(err)
}

// FetchFrom reads the blob from byte off on: an HTTP Range request, when
// the registry serves them.
func (r ociRepo) FetchFrom(ctx context.Context, d ocispec.Descriptor, off int64) (io.ReadCloser, error) {
	rc, err := r.Fetch(ctx, d)
	if err != nil || off == 0 {
		return rc, err
	}
	if sk, ok := rc.(io.Seeker); ok {
		if _, err := sk.Seek(off, io.SeekStart); err == nil {
			return rc, nil
		}
	}
	rc.Close()
	return nil, errNoRange
}

func (r ociRepo) Push(ctx context.Context, d ocispec.Descriptor, rd io.Reader) error {
	return classify(r.r.Push(ctx, d, rd))
}

// Tag tags a manifest. A registry replaces tags freely: the caller has
// already refused to move a tag without force.
func (r ociRepo) Tag(ctx context.Context, d ocispec.Descriptor, force bool) error {
	return classify(r.r.Tag(ctx, d, r.ref.Version))
}

// EnvCredentials reads DSEC_REGISTRY_USERNAME and DSEC_REGISTRY_PASSWORD.
func EnvCredentials(o *Options) {
	o.Username = os.Getenv("DSEC_REGISTRY_USERNAME")
	o.Password = os.Getenv("DSEC_REGISTRY_PASSWORD")
}

// publicClient is the one client of every public-only pull: one pool
// of connections, idle ones closed, no proxy.
var publicClient = sync.OnceValue(func() *http.Client {
	return &http.Client{Transport: retry.NewTransport(&http.Transport{
		DialContext:         (&net.Dialer{Timeout: 30 * time.Second, Control: publicOnly}).DialContext,
		TLSHandshakeTimeout: 30 * time.Second, ResponseHeaderTimeout: time.Minute,
		IdleConnTimeout: 30 * time.Second, MaxIdleConnsPerHost: 4, ForceAttemptHTTP2: true,
	})}
})

// notPublic are the special-purpose ranges beyond what net.IP's
// methods name (IANA's registries): shared address space (a cloud's
// metadata service may live there), benchmarking, protocol assignments,
// this network, reserved, documentation, NAT64, and 6to4 and Teredo,
// which tunnel to any IPv4 address.
var notPublic = sync.OnceValue(func() []netip.Prefix {
	var out []netip.Prefix
	for _, p := range []string{"0.0.0.0/8", "100.64.0.0/10", "192.0.0.0/24", "192.0.2.0/24", "198.18.0.0/15", "198.51.100.0/24",
		"203.0.113.0/24", "240.0.0.0/4", "64:ff9b::/96", "64:ff9b:1::/48", "2001::/32", "2001:db8::/32", "2002::/16"} {
		out = append(out, netip.MustParsePrefix(p))
	}
	return out
})

// Public says whether ip is a public unicast address, none of this
// host's own.
func Public(ip netip.Addr) bool {
	ip = ip.Unmap()
	if !ip.IsGlobalUnicast() || ip.IsPrivate() {
		return false
	}
	for _, p := range notPublic() {
		if p.Contains(ip) {
			return false
		}
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if own, ok := netip.AddrFromSlice(n.IP); ok && own.Unmap() == ip {
				return false
			}
		}
	}
	return true
}

// publicOnly refuses a connection to an address that is not Public:
// checked on the address dialled, so no name that resolves there (now,
// or after a redirect) reaches it.
func publicOnly(network, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return err
	}
	if !Public(ap.Addr()) {
		return fmt.Errorf("%s is not a public address (a registry on this host or a private network is the admin's to pull from): %w", ap.Addr(), errdefs.ErrPermissionDenied)
	}
	return nil
}

// Loopback says whether HOST[:PORT] is on this host: a registry there is
// spoken to over plain HTTP.
func Loopback(hostport string) bool {
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		hostport = h
	}
	return isLoopback(strings.Trim(hostport, "[]"))
}
