package lazy

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"

	"github.com/opencontainers/go-digest"
	"oras.land/oras-go/v2/registry/remote/auth"
	"oras.land/oras-go/v2/registry/remote/credentials"
	"oras.land/oras-go/v2/registry/remote/retry"

	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// source reads byte ranges of one blob from a remote store.
type source interface {
	ReadAt(ctx context.Context, b []byte, off int64) error
	Close() error
}

// openSource opens the layer blob at a remote URL.
func openSource(spec Spec) (source, error) {
	loc, err := remote.ParseLocation(spec.Remote)
	if err != nil {
		return nil, err
	}
	switch loc.Scheme {
	case remote.SchemeDir:
		if spec.Chunk {
			f, err := os.Open(store.ChunkPath(loc.Path, spec.Digest))
			if err != nil {
				return nil, fmt.Errorf("chunk blob %s in %s: %w", spec.Digest, spec.Remote, err)
			}
			return dirSource{f, remote.EmulationFromEnv()}, nil
		}
		f, err := os.Open(filepath.Join(loc.Path, "blobs", "sha256", spec.Digest.Encoded()))
		var r readerAtCloser = f
		if err == nil && store.IsPacked(loc.Path, spec.Digest) {
			// A store that keeps its layers packed: the blob is the
			// layer's head; its file data is read from the chunk blobs
			// as windows are fetched (each checked against the table).
			f.Close()
			var s *store.Store
			if s, err = store.Open(loc.Path); err == nil {
				r, err = s.PackedReader(spec.Digest)
			}
		}
		if err != nil {
			return nil, fmt.Errorf("layer %s in %s: %w", spec.Ref, spec.Remote, err)
		}
		return dirSource{r, remote.EmulationFromEnv()}, nil
	case remote.SchemeOCI:
		name, _, _ := strings.Cut(spec.Ref, ":")
		return newHTTPSource(loc.Host, loc.Repo+"/"+name, spec.Digest, spec.Insecure), nil
	}
	return nil, fmt.Errorf("remote %s: unknown scheme", spec.Remote)
}

// dirSource reads a blob file of a dir: remote (a 3FS, CephFS, JuiceFS or
// NFS mount): one pread per window.
type dirSource struct {
	f   readerAtCloser
	emu remote.Emulation
}

type readerAtCloser interface {
	io.ReaderAt
	io.Closer
}

func (s dirSource) ReadAt(ctx context.Context, b []byte, off int64) error {
	s.emu.Request()
	_, err := s.f.ReadAt(b, off)
	s.emu.Transfer(len(b))
	return err
}

func (s dirSource) Close() error { return s.f.Close() }

// httpSource reads a registry blob with HTTP Range requests.
type httpSource struct {
	url    string
	client *auth.Client
}

func newHTTPSource(host, repo string, d digest.Digest, insecure bool) *httpSource {
	scheme := "https"
	if insecure || remote.Loopback(host) {
		scheme = "http"
	}
	c := &auth.Client{Client: retry.DefaultClient, Cache: auth.NewCache()}
	c.SetUserAgent("dsec")
	if u, p := os.Getenv("DSEC_REGISTRY_USERNAME"), os.Getenv("DSEC_REGISTRY_PASSWORD"); u != "" || p != "" {
		c.Credential = auth.StaticCredential(host, auth.Credential{Username: u, Password: p})
	} else if store, err := credentials.NewStoreFromDocker(credentials.StoreOptions{}); err == nil {
		c.Credential = credentials.Credential(store)
	}
	return &httpSource{url: fmt.Sprintf("%s://%s/v2/%s/blobs/%s", scheme, host, repo, d), client: c}
}

func (s *httpSource) ReadAt(ctx context.Context, b []byte, off int64) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.url, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", off, off+int64(len(b))-1))
	resp, err := s.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusPartialContent:
	case http.StatusOK: // no range support: skip to the window
		if _, err := io.CopyN(io.Discard, resp.Body, off); err != nil {
			return err
		}
	default:
		return fmt.Errorf("GET %s: %s", s.url, resp.Status)
	}
	_, err = io.ReadFull(resp.Body, b)
	return err
}

func (s *httpSource) Close() error { return nil }
