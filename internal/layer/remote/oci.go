package remote

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
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
		c.Client = &http.Client{Transport: retry.NewTransport(&http.Transport{
			DialContext:         (&net.Dialer{Timeout: 30 * time.Second, Control: publicOnly}).DialContext,
			TLSHandshakeTimeout: 30 * time.Second, ForceAttemptHTTP2: true,
		})}
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
	r.PlainHTTP = t.o.Insecure
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

// publicOnly refuses a connection to this host, or to a private or
// link-local network: checked on the address dialled, so no name that
// resolves there (now, or after a redirect) reaches it.
func publicOnly(network, address string, _ syscall.RawConn) error {
	host, _, err := net.SplitHostPort(address)
	if err != nil {
		return err
	}
	ip := net.ParseIP(host)
	if ip == nil || ip.IsLoopback() || ip.IsPrivate() || ip.IsLinkLocalUnicast() || ip.IsUnspecified() || ip.IsMulticast() {
		return fmt.Errorf("%s is not a public address: %w", host, errdefs.ErrPermissionDenied)
	}
	return nil
}
