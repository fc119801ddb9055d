// Package remote moves layers between stores: the local store, a dir:
// remote (the same OCI image layout on any POSIX path, such as a 3FS,
// CephFS, JuiceFS or NFS mount) and an oci: remote (a repository of an
// OCI distribution registry, through oras-go).
//
// A layer NAME:VERSION is four blobs: its manifest, its config, the EROFS
// image and the window table the config names. In a dir: remote it is
// tagged NAME:VERSION like in the local store; in oci://HOST/REPO it is
// HOST/REPO/NAME:VERSION, a repository per layer name.
package remote

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"path/filepath"
	"strings"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer"
)

// Target is a store that layers are pushed to and pulled from.
type Target interface {
	// Repo opens the part of the store that holds ref.
	Repo(ctx context.Context, ref layer.Ref) (Repo, error)
	String() string
}

// Repo holds the blobs and the tag of one layer name.
type Repo interface {
	Resolve(ctx context.Context) (ocispec.Descriptor, error)
	Exists(ctx context.Context, d ocispec.Descriptor) (bool, error)
	Fetch(ctx context.Context, d ocispec.Descriptor) (io.ReadCloser, error)
	// Push stores d's bytes from r and refuses them unless they hash to
	// d.Digest.
	Push(ctx context.Context, d ocispec.Descriptor, r io.Reader) error
	// Tag points the layer's tag at manifest d; an existing tag for
	// other content is replaced only with force.
	Tag(ctx context.Context, d ocispec.Descriptor, force bool) error
}

// Options are what opening a remote may need.
type Options struct {
	// Insecure allows plain HTTP to a registry on a loopback address,
	// which is spoken to over it anyway, as Docker does; to no other.
	Insecure bool
	// Username and Password, if set, override the docker config file.
	Username, Password string
	// Anonymous: no credentials at all, the docker config's neither.
	Anonymous bool
	// PublicOnly: connect to public addresses only (not this host, nor
	// a private or link-local network).
	PublicOnly bool
}

// Scheme is the kind of store a remote URL names.
type Scheme int

const (
	SchemeUnknown Scheme = iota // no scheme, or one dsec does not know
	SchemeDir                   // dir:///PATH: an OCI image layout on a POSIX path
	SchemeOCI                   // oci://HOST[:PORT]/REPOSITORY: a registry's repository
)

// Location is a remote URL read once: its scheme and the parts that
// scheme has. What else the URL must be is Open's to check.
type Location struct {
	URL    *url.URL
	Scheme Scheme
	Path   string // SchemeDir: the directory
	Host   string // SchemeOCI: HOST[:PORT]
	Repo   string // SchemeOCI: the repository, without slashes around it
}

// ParseLocation reads a remote URL; its error is url.Parse's.
func ParseLocation(rawURL string) (Location, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return Location{}, err
	}
	loc := Location{URL: u}
	switch u.Scheme {
	case "dir":
		loc.Scheme, loc.Path = SchemeDir, u.Path
	case "oci":
		loc.Scheme, loc.Host, loc.Repo = SchemeOCI, u.Host, strings.Trim(u.Path, "/")
	}
	return loc, nil
}

// Open opens a remote URL: dir:///PATH or oci://HOST[:PORT]/REPOSITORY.
func Open(rawURL string, o Options) (Target, error) {
	loc, err := ParseLocation(rawURL)
	if err != nil || loc.URL.Scheme == "" {
		return nil, fmt.Errorf("bad remote %q: give dir:///PATH or oci://HOST[:PORT]/REPOSITORY: %w", rawURL, errdefs.ErrInvalidArgument)
	}
	switch loc.Scheme {
	case SchemeDir:
		if loc.URL.Host != "" || !filepath.IsAbs(loc.Path) {
			return nil, fmt.Errorf("bad remote %q: a dir: remote is dir:///ABSOLUTE/PATH: %w", rawURL, errdefs.ErrInvalidArgument)
		}
		return openDir(loc.Path)
	case SchemeOCI:
		if loc.Host == "" || loc.Repo == "" {
			return nil, fmt.Errorf("bad remote %q: an oci: remote is oci://HOST[:PORT]/REPOSITORY: %w", rawURL, errdefs.ErrInvalidArgument)
		}
		if o.Insecure && !isLoopback(loc.URL.Hostname()) {
			return nil, fmt.Errorf("--insecure (plain HTTP) is allowed only for a registry on localhost, not %s: %w", loc.Host, errdefs.ErrInvalidArgument)
		}
		return openOCI(loc.Host, loc.Repo, o), nil
	}
	return nil, fmt.Errorf("bad remote %q: unknown scheme %q (want dir or oci): %w", rawURL, loc.URL.Scheme, errdefs.ErrInvalidArgument)
}

func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// Progress receives bytes copied.
type Progress interface{ Add(n int64) }

type noProgress struct{}

func (noProgress) Add(int64) {}

// Result says what a copy did.
type Result struct {
	Ref      string          `json:"name"`
	Digest   digest.Digest   `json:"digest"`
	Manifest digest.Digest   `json:"manifest"`
	From     string          `json:"from"`
	To       string          `json:"to"`
	Copied   []digest.Digest `json:"copied"`
	Skipped  []digest.Digest `json:"skipped"`
	Bytes    int64           `json:"bytes"`
	// Resumed counts the bytes an interrupted copy had already written
	// (not copied again, not in Bytes).
	Resumed int64 `json:"resumed_bytes,omitempty"`
	// Lowers: for a snapshot, the copies of the layers it stands on,
	// bottom first.
	Lowers []*Result `json:"lowers,omitempty"`
}

// Totals are the blobs copied and skipped, and bytes copied, with the
// lowers'.
func (r *Result) Totals() (copied, skipped int, bytes int64) {
	copied, skipped, bytes = len(r.Copied), len(r.Skipped), r.Bytes
	for _, l := range r.Lowers {
		c, s, b := l.Totals()
		copied, skipped, bytes = copied+c, skipped+s, bytes+b
	}
	return copied, skipped, bytes
}

type countingReader struct {
	r io.Reader
	p Progress
	n *int64
}

func (c countingReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	*c.n += int64(n)
	c.p.Add(int64(n))
	return n, err
}

// Copy copies layer ref from src to dst: every blob dst lacks, then the
// tag. Blobs already there are skipped, so a copy interrupted at any
// point resumes by running it again; the tag moves last, so dst never
// names a layer whose blobs it does not hold. A snapshot brings the
// layers it stands on, first: dst never names a snapshot it cannot
// mount. force replaces ref's own tag, never a lower's.
func Copy(ctx context.Context, src, dst Target, ref layer.Ref, force bool, p Progress) (*Result, error) {
	if p == nil {
		p = noProgress{}
	}
	if d, ok := dst.(*Dir); ok {
		// Hold gc off until the copied blobs are tagged.
		release, err := d.s.Writer()
		if err != nil {
			return nil, err
		}
		defer release()
	}
	return copyLayer(ctx, src, dst, ref, "", force, p)
}

// copyLayer is Copy without the gc lock; want, if set, is the layer
// digest ref must name in src (a snapshot's lower).
func copyLayer(ctx context.Context, src, dst Target, ref layer.Ref, want digest.Digest, force bool, p Progress) (*Result, error) {
	from, to, err := repos(ctx, src, dst, ref)
	if err != nil {
		return nil, err
	}
	mdesc, err := from.Resolve(ctx)
	var man *ocispec.Manifest
	var cfg *layer.Config
	if err == nil {
		man, cfg, err = readLayer(ctx, from, mdesc)
	}
	if f, ok := from.(imageFinder); ok && want != "" && (errdefs.IsNotFound(err) || err == nil && man.Layers[0].Digest != want) {
		// A lower whose tag was removed (layer rm --force) or moved:
		// the store keeps it for the snapshot, untagged.
		if mdesc, err = f.FindImage(ctx, want); err == nil {
			man, cfg, err = readLayer(ctx, from, mdesc)
		}
	}
	if errdefs.IsNotFound(err) {
		return nil, fmt.Errorf("layer %s not found in %s: check its name and version there: %w", ref, src, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("layer %s in %s: %w", ref, src, err)
	}
	blob := man.Layers[0].Digest
	if want != "" && blob != want {
		return nil, fmt.Errorf("%s in %s is now %s, not the %s a snapshot over it stands on: %w", ref, src, blob, want, errdefs.ErrFailedPrecondition)
	}
	tag := true
	if cur, err := to.Resolve(ctx); err == nil && cur.Digest != mdesc.Digest && !force {
		_, local := dst.(*Dir)
		switch {
		case want != "" && local:
			tag = false // kept untagged for the snapshot, found by its digest
		case want != "":
			return nil, fmt.Errorf("tag %s in %s names other content (%s) than the snapshot stands on; a snapshot never moves its lowers' tags: %w", ref, dst, cur.Digest, errdefs.ErrAlreadyExists)
		default:
			return nil, fmt.Errorf("tag %s in %s names other content (%s); pass --force to replace it: %w", ref, dst, cur.Digest, errdefs.ErrAlreadyExists)
		}
	} else if err != nil && !errdefs.IsNotFound(err) {
		return nil, fmt.Errorf("%s: %w", dst, err)
	}
	res := &Result{Ref: ref.String(), Digest: blob, Manifest: mdesc.Digest, From: src.String(), To: dst.String()}
	if cfg.Snapshot != nil {
		// Bottom up, so each tag moves only over whole lowers.
		for i := len(cfg.Snapshot.Lowers) - 1; i >= 0; i-- {
			lo := cfg.Snapshot.Lowers[i]
			lref, err := layer.ParseRef(lo.Ref)
			if err != nil {
				return nil, err
			}
			lres, err := copyLayer(ctx, src, dst, lref, lo.Digest, false, p)
			if err != nil {
				return nil, fmt.Errorf("snapshot %s stands on %s: %w", ref, lo.Ref, err)
			}
			res.Lowers = append(res.Lowers, lres)
		}
	}
	windows := ocispec.Descriptor{MediaType: layer.MediaTypeWindows, Digest: cfg.Windows.Digest, Size: int64(cfg.Windows.Count) * 32}
	blobs := []ocispec.Descriptor{man.Layers[0], windows}
	if cfg.Snapshot != nil && cfg.Snapshot.Memory != nil { // before the config that names them
		blobs = append(blobs, cfg.Snapshot.Memory.Blobs()...)
	}
	if err := copyBlobs(ctx, from, to, append(blobs, man.Config, mdesc), p, res); err != nil {
		return nil, fmt.Errorf("copy from %s to %s: %w", src, dst, err)
	}
	if !tag {
		return res, nil
	}
	mdesc.MediaType = ocispec.MediaTypeImageManifest
	mdesc.ArtifactType = layer.ArtifactType
	mdesc.Annotations = layer.TagAnnotations(cfg.Kind, blob)
	if err := to.Tag(ctx, mdesc, force); err != nil {
		return nil, fmt.Errorf("tag %s in %s: %w", ref, dst, err)
	}
	return res, nil
}

// repos are ref's repositories in src and dst.
func repos(ctx context.Context, src, dst Target, ref layer.Ref) (from, to Repo, err error) {
	if from, err = src.Repo(ctx, ref); err == nil {
		to, err = dst.Repo(ctx, ref)
	}
	return from, to, err
}

// copyBlobs copies the blobs ds from one repository to another, in
// order, skipping those it holds already.
func copyBlobs(ctx context.Context, from, to Repo, ds []ocispec.Descriptor, p Progress, res *Result) error {
	for _, d := range ds {
		ok, err := to.Exists(ctx, d)
		if err != nil {
			return err
		}
		if ok {
			res.Skipped = append(res.Skipped, d.Digest)
			continue
		}
		if err := copyBlob(ctx, from, to, d, p, res); err != nil {
			return fmt.Errorf("copy %s: %w", d.Digest, err)
		}
		res.Copied = append(res.Copied, d.Digest)
	}
	return nil
}

// CopyBlobs copies the blobs ds of layer ref (its memory snapshot's,
// say) from src to dst, skipping those dst holds already.
func CopyBlobs(ctx context.Context, src, dst Target, ref layer.Ref, ds []ocispec.Descriptor, p Progress) (*Result, error) {
	if p == nil {
		p = noProgress{}
	}
	from, to, err := repos(ctx, src, dst, ref)
	if err != nil {
		return nil, err
	}
	res := &Result{Ref: ref.String(), From: src.String(), To: dst.String()}
	if err := copyBlobs(ctx, from, to, ds, p, res); err != nil {
		return nil, fmt.Errorf("copy from %s to %s: %w", src, dst, err)
	}
	return res, nil
}

// imageFinder is a Repo that finds a layer by its image's digest,
// tagged or not (the local store).
type imageFinder interface {
	FindImage(ctx context.Context, image digest.Digest) (ocispec.Descriptor, error)
}

// rangeFetcher is a Repo that can read a blob from an offset.
type rangeFetcher interface {
	FetchFrom(ctx context.Context, d ocispec.Descriptor, off int64) (io.ReadCloser, error)
}

var errNoRange = errors.New("the source does not serve byte ranges")

// copyBlob copies blob d. Into a store (the local one, a dir: remote)
// it resumes: the bytes an interrupted copy left stay in the store's
// ingest, and only the rest is fetched, from where they end; the whole
// blob is hashed before it is published. A registry destination takes
// the blob whole.
func copyBlob(ctx context.Context, from, to Repo, d ocispec.Descriptor, p Progress, res *Result) error {
	dr, ok := to.(dirRepo)
	rf, ranged := from.(rangeFetcher)
	if !ok {
		rc, err := from.Fetch(ctx, d)
		if err != nil {
			return err
		}
		defer rc.Close()
		return to.Push(ctx, d, countingReader{rc, p, &res.Bytes})
	}
	in, err := dr.resume(d)
	if err != nil {
		return err
	}
	off := in.Size()
	var rc io.ReadCloser
	if off > 0 && ranged {
		rc, err = rf.FetchFrom(ctx, d, off)
	}
	if off > 0 && (!ranged || errors.Is(err, errNoRange)) {
		in.Discard() // the source cannot start mid-blob: start over
		if in, err = dr.resume(d); err != nil {
			return err
		}
		off = 0
	}
	if off == 0 {
		rc, err = from.Fetch(ctx, d)
	}
	if err != nil {
		in.Abort()
		return err
	}
	defer rc.Close()
	if off > 0 {
		res.Resumed += off
		p.Add(off)
	}
	return dr.finish(in, d, countingReader{rc, p, &res.Bytes})
}

// readLayer fetches and checks a layer's manifest and config.
func readLayer(ctx context.Context, r Repo, mdesc ocispec.Descriptor) (*ocispec.Manifest, *layer.Config, error) {
	mdesc.MediaType = ocispec.MediaTypeImageManifest
	mb, err := fetchSmall(ctx, r, mdesc)
	if err != nil {
		return nil, nil, err
	}
	man, err := layer.ParseManifest(mb)
	if err != nil {
		return nil, nil, err
	}
	cb, err := fetchSmall(ctx, r, man.Config)
	if err != nil {
		return nil, nil, err
	}
	cfg, err := layer.ParseConfig(cb, man.Layers[0].Size)
	if err != nil {
		return nil, nil, err
	}
	return man, cfg, nil
}

const maxSmall = 4 << 20

func fetchSmall(ctx context.Context, r Repo, d ocispec.Descriptor) ([]byte, error) {
	return fetchVerified(ctx, r, d, maxSmall)
}

// fetchVerified reads a blob of at most max bytes whole and checks it.
func fetchVerified(ctx context.Context, r Repo, d ocispec.Descriptor, max int64) ([]byte, error) {
	if d.Size > max {
		return nil, fmt.Errorf("%s is %d bytes, more than the %d this blob may be: %w", d.Digest, d.Size, max, errdefs.ErrInvalidArgument)
	}
	rc, err := r.Fetch(ctx, d)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, max+1))
	if err != nil {
		return nil, err
	}
	if digest.FromBytes(b) != d.Digest {
		return nil, fmt.Errorf("%s does not match its digest (corrupt remote?): %w", d.Digest, errdefs.ErrDataLoss)
	}
	return b, nil
}

// Layer is what a host needs to mount a remote layer lazily.
type Layer struct {
	Manifest ocispec.Descriptor
	Blob     ocispec.Descriptor // the EROFS image
	Config   *layer.Config
	Windows  []byte // the window table, verified
}

// Describe fetches a layer's manifest, config and window table, each
// checked against its digest, without its EROFS image.
func Describe(ctx context.Context, t Target, ref layer.Ref) (*Layer, error) {
	r, err := t.Repo(ctx, ref)
	if err != nil {
		return nil, err
	}
	mdesc, err := r.Resolve(ctx)
	if err != nil {
		return nil, fmt.Errorf("layer %s in %s: %w", ref, t, err)
	}
	man, cfg, err := readLayer(ctx, r, mdesc)
	if err != nil {
		return nil, fmt.Errorf("layer %s in %s: %w", ref, t, err)
	}
	wd := ocispec.Descriptor{MediaType: layer.MediaTypeWindows, Digest: cfg.Windows.Digest, Size: int64(cfg.Windows.Count) * 32}
	table, err := fetchVerified(ctx, r, wd, 64<<20) // 2 TiB of image
	if err != nil {
		return nil, fmt.Errorf("window table of %s in %s: %w", ref, t, err)
	}
	return &Layer{Manifest: mdesc, Blob: man.Layers[0], Config: cfg, Windows: table}, nil
}
