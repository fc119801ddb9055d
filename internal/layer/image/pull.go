package image

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/singleflight"
	"oras.land/oras-go/v2/content"
	orasremote "oras.land/oras-go/v2/registry/remote"
	"oras.land/oras-go/v2/registry/remote/auth"
	"oras.land/oras-go/v2/registry/remote/errcode"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// Media types of an image's record in the store.
const (
	ArtifactType    = "application/vnd.dsec.image.v1"
	MediaTypeRecord = "application/vnd.dsec.image.record.v1+json"
)

// errNoPlatform: the image is not for the platform asked for.
var errNoPlatform = errdefs.ErrNotFound

// Options says how to pull.
type Options struct {
	Platform Platform // zero: the host's
	// Username and Password, when set, are the registry's credentials;
	// else those docker login left.
	Username, Password string
	// Anonymous: no credentials, docker login's neither; PublicOnly: no
	// registry on this host or a private network (a tenant's pull).
	Anonymous, PublicOnly bool
	// Insecure lists registries (HOST[:PORT]) spoken to over plain HTTP
	// beside those on a loopback address, which always are.
	Insecure []string
	// Limits bound what an import may take (zero: none): a tenant's.
	Limits Limits
	// CredentialHost is the one registry Username and Password are
	// given to ("": none; docker login's are each for its own host).
	CredentialHost string
	// Mirrors lists, for a registry (docker.io, ghcr.io, HOST:PORT), the
	// hosts (HOST[:PORT]) asked first, in order: the first that has the
	// image serves the whole pull; the registry itself comes last.
	Mirrors map[string][]string
	// Progress, when set, is given the compressed bytes to fetch once
	// they are known (not called when the store holds every layer), and
	// returns what receives them as they arrive.
	Progress func(total int64) layer.Progress
	// NoResume keeps nothing of a layer an import did not finish (a
	// tenant's, whose registry could stall every layer near its end and
	// so fill the disk with kept bytes); it still reads what an earlier
	// pull kept.
	NoResume bool
	// Compress stores the layers' files LZ4-compressed where that saves
	// a block (layer.BuildOptions.Compress). A layer the store holds
	// already is taken as it is, compressed or not.
	Compress bool
	// Whole, when set, says whether every layer of an image whose record
	// the store holds is there to mount: a worker's says so of layers on
	// its shared remote too, so a pull of a tag that still names the held
	// manifest fetches nothing where the image came from the remote.
	// nil: every layer in the store.
	Whole func(context.Context, *Image) bool
}

// Target is the platform an import takes: o's, or the host's.
func (o Options) Target() Platform {
	if o.Platform == (Platform{}) {
		return HostPlatform()
	}
	return o.Platform
}

// Limits bound an import.
type Limits struct {
	Compressed int64 // the bytes its layers' blobs declare, together
	Bytes      int64 // the bytes its layers' tars unpack to, together
	Entries    int   // the entries of one layer
}

// Record is an image in the store: its layers, bottom first, and its
// config. It is the config blob of the image's manifest in the store,
// whose layers are the layers' own manifests (so a collection keeps
// them while the image is kept).
type Record struct {
	Reference string        `json:"reference"` // as pulled, normalized
	Manifest  digest.Digest `json:"manifest"`  // the registry's manifest
	Platform  string        `json:"platform"`
	Config    Config        `json:"config"`
	Layers    []Layer       `json:"layers"`
}

// Layer is one of an image's layers: the OCI layer and the EROFS layer
// it became.
type Layer struct {
	DiffID digest.Digest `json:"diff_id"`  // its tar's sha256
	Chain  digest.Digest `json:"chain_id"` // it and everything under it
	Blob   digest.Digest `json:"blob"`     // as the registry holds it
	Size   int64         `json:"size"`     // the blob's
	Ref    string        `json:"ref"`      // the EROFS layer's store tag
	Digest digest.Digest `json:"digest"`   // the EROFS layer's
}

// Image is an image record in the store.
type Image struct {
	Record
	Tag string        `json:"tag"` // the record's store tag
	ID  digest.Digest `json:"id"`  // the record's manifest in the store
	// From is the host this import read it from (a mirror's, or the
	// registry's); Fetched and Reused count the layers it converted and
	// those the store already held; Resumed the bytes of layers' blobs
	// read again from what an interrupted pull kept, not fetched.
	From    string `json:"from,omitempty"`
	Fetched int    `json:"fetched,omitempty"`
	Reused  int    `json:"reused,omitempty"`
	Resumed int64  `json:"resumed_bytes,omitempty"`
	// Joined: this import waited on another one's pull of the image in
	// this process, and the counts are that pull's.
	Joined bool `json:"joined,omitempty"`
}

// Refs are the image's layers as a sandbox stacks them: topmost first.
func (i *Image) Refs() []string {
	out := make([]string, len(i.Layers))
	for n, l := range i.Layers {
		out[len(i.Layers)-1-n] = l.Ref
	}
	return out
}

// pulls makes concurrent imports of one image in one process one.
var pulls singleflight.Group

// Import pulls ref into s: each layer the store lacks is fetched once,
// verified against its digests and converted to EROFS as it streams in
// (nothing is unpacked to disk), and the image's record is tagged by
// its reference (a tag pulled again moves to what the registry says
// now). Concurrent imports of one image in a process share one pull;
// across processes a layer two convert at once is stored once (its
// conversion is deterministic).
func Import(ctx context.Context, s *store.Store, ref Reference, o Options) (*Image, error) {
	o.Platform = o.Target()
	// Only pulls of the same authority share: a tenant's anonymous one
	// must not fail the admin's, nor ride on it.
	key := fmt.Sprintf("%s\x00%s\x00%s\x00%t\x00%t\x00%s", s.Dir(), ref, o.Platform, o.Anonymous, o.PublicOnly, o.Username)
	// The pull is the first caller's; each waits on its own context.
	led := false // only the leader's function runs
	ch := pulls.DoChan(key, func() (any, error) { led = true; return pull(ctx, s, ref, o) })
	select {
	case r := <-ch:
		if r.Err != nil {
			return nil, r.Err
		}
		img := *r.Val.(*Image)
		img.Joined = !led
		return &img, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// unreachable says so of an error that never reached host (no such
// name, no route, refused), with what to check; any other err is as it
// was, a tenant's dial the worker refused too.
func unreachable(host string, err error) error {
	var dns *net.DNSError
	var op *net.OpError
	switch {
	case errdefs.IsPermissionDenied(err): // a tenant's dialer refused the address: said as it is
		return err
	case errors.As(err, &dns):
		return fmt.Errorf("cannot reach the registry %s (%w): check its name and this host's DNS, or name a mirror in registries.mirrors: %w", host, dns, errdefs.ErrUnavailable)
	case errors.As(err, &op) && op.Op == "dial":
		return fmt.Errorf("cannot reach the registry %s (%w): check its address and this host's network, or name a mirror in registries.mirrors: %w", host, op, errdefs.ErrUnavailable)
	}
	return err
}

// repository opens ref's repository on host (the registry's, or a
// mirror's: the config's, so reached wherever it is).
func repository(ref Reference, host string, mirror bool, o Options) (*orasremote.Repository, error) {
	repo, err := orasremote.NewRepository(host + "/" + ref.Repository)
	if err != nil {
		return nil, fmt.Errorf("%s on %s: %v: %w", ref, host, err, errdefs.ErrInvalidArgument)
	}
	on := Reference{Registry: host}
	repo.PlainHTTP = on.Loopback() || slices.Contains(o.Insecure, host)
	ro := remote.Options{Anonymous: o.Anonymous, PublicOnly: o.PublicOnly && !mirror}
	if host == o.CredentialHost || o.CredentialHost == dockerHub && host == dockerHubHost {
		ro.Username, ro.Password = o.Username, o.Password
	}
	repo.Client = remote.Client(host, ro)
	return repo, nil
}

// resolve finds ref on its mirrors, in the order given, then on its
// registry: the first that has it serves the whole pull.
func resolve(ctx context.Context, ref Reference, o Options) (*orasremote.Repository, ocispec.Descriptor, string, error) {
	want := ref.Tag
	if ref.Digest != "" {
		want = ref.Digest.String()
	}
	hosts := append(slices.Clone(o.Mirrors[ref.Registry]), ref.Host())
	var why []string
	for i, host := range hosts {
		repo, err := repository(ref, host, i < len(hosts)-1, o)
		if err != nil {
			return nil, ocispec.Descriptor{}, "", err
		}
		desc, err := repo.Resolve(ctx, want)
		if err == nil {
			return repo, desc, host, nil
		}
		err = unreachable(host, remote.Classify(err))
		if i == len(hosts)-1 {
			if errdefs.IsNotFound(err) {
				err = fmt.Errorf("the registry has no such image: check its name and tag: %w", errdefs.ErrNotFound)
			}
			if len(why) > 0 {
				err = fmt.Errorf("%w (mirrors: %s)", err, strings.Join(why, "; "))
			}
			return nil, ocispec.Descriptor{}, "", fmt.Errorf("%s: %w", ref, err)
		}
		why = append(why, host+": "+err.Error())
	}
	panic("unreachable")
}

func pull(ctx context.Context, s *store.Store, ref Reference, o Options) (*Image, error) {
	fail := func(what string, err error) error {
		if what == "" || errors.Is(err, layer.ErrBadSource) {
			return fmt.Errorf("%s: %w", ref, err)
		}
		return fmt.Errorf("%s: %s: %w", ref, what, remote.Classify(err))
	}
	repo, desc, host, err := resolve(ctx, ref, o)
	if err != nil {
		return nil, err
	}
	if desc, err = platformManifest(ctx, repo, desc, o.Platform, fail); err != nil {
		return nil, err
	}
	if held, ok := heldAs(ctx, s, ref, desc.Digest, o.Platform, o.Whole); ok {
		// What the tag names now is what the store holds (a pull again,
		// or a create's pull always): no more is asked of the registry.
		held.From, held.Reused = host, len(held.Layers)
		return held, nil
	}
	mb, err := fetchJSON(ctx, repo, desc)
	if err != nil {
		return nil, fail("fetch the manifest", err)
	}
	m, err := parseManifest(mb)
	if err != nil {
		return nil, fail("", err)
	}
	cb, err := fetchJSON(ctx, repo, m.config)
	if err != nil {
		return nil, fail("fetch the config", err)
	}
	cfg, diffIDs, err := parseConfig(cb, len(m.layers), o.Platform)
	if err != nil {
		return nil, fail("", err)
	}
	img := &Image{Record: Record{Reference: ref.String(), Manifest: desc.Digest, Platform: o.Platform.String(), Config: cfg}, From: host}
	// What the store holds already is not fetched again.
	var todo []int
	var total int64
	chains := chainIDs(diffIDs)
	// A store that packs keeps file data uncompressed (layer.Build).
	compress := o.Compress && !s.Dedup()
	for i, l := range m.layers {
		img.Layers = append(img.Layers, Layer{DiffID: diffIDs[i], Chain: chains[i], Blob: l.Digest, Size: l.Size, Ref: LayerTag(chains[i], compress).String()})
		if held(ctx, s, &img.Layers[i]) {
			img.Reused++
			continue
		}
		todo, total = append(todo, i), total+l.Size
	}
	if lim := o.Limits.Compressed; lim > 0 && total > lim {
		return nil, fmt.Errorf("%s: its layers are %d bytes, more than an import may fetch here (%d): ask the worker's admin to dsec image pull it: %w",
			ref, total, lim, errdefs.ErrOutOfRange)
	}
	budget := &budget{limit: o.Limits.Bytes}
	var p layer.Progress = noProgress{}
	if o.Progress != nil && len(todo) > 0 {
		if q := o.Progress(total); q != nil {
			p = q
		}
	}
	for _, i := range todo {
		var under []digest.Digest
		for _, l := range img.Layers[:i] {
			under = append(under, l.Digest)
		}
		// One process converts a layer: another pulling an image with it
		// (dsec image pull beside a worker's import) waits, then finds it.
		release, err := s.Exclusive(ctx, "oci-"+chains[i].Encoded())
		if err != nil {
			return nil, err
		}
		if held(ctx, s, &img.Layers[i]) {
			release()
			img.Reused++
			p.Add(m.layers[i].Size)
			continue
		}
		info, resumed, err := convertSpooled(ctx, s, repo, m.layers[i], img.Layers[i], under, p, budget, layerConversion{entries: o.Limits.Entries, compress: compress}, !o.NoResume)
		release()
		if err != nil {
			return nil, fail("", fmt.Errorf("layer %d of %d (%s): %w", i+1, len(m.layers), m.layers[i].Digest, remote.Classify(err)))
		}
		img.Layers[i].Digest = info.Digest
		img.Fetched++
		img.Resumed += resumed
	}
	if err := record(ctx, s, ref, img); err != nil {
		return nil, err
	}
	return img, nil
}

// platformManifest follows desc through image indexes, two deep at most,
// to the manifest of platform p; fail words its errors.
func platformManifest(ctx context.Context, repo *orasremote.Repository, desc ocispec.Descriptor, p Platform, fail func(string, error) error) (ocispec.Descriptor, error) {
	for depth := 0; isIndex(desc.MediaType); depth++ {
		if depth == 2 {
			return desc, fail("", fmt.Errorf("%w: image indexes nest too deep", layer.ErrBadSource))
		}
		b, err := fetchJSON(ctx, repo, desc)
		if err != nil {
			return desc, fail("fetch the index", err)
		}
		if desc, err = parseIndex(b, p); err != nil {
			return desc, fail("", err)
		}
	}
	return desc, nil
}

// held says whether the store holds l's layer, converted as l.Ref names
// or the other way (compressed or not: the same files, not converted and
// kept twice), and sets l's Ref and Digest to it.
func held(ctx context.Context, s *store.Store, l *Layer) bool {
	for _, tag := range []string{l.Ref, otherConversion(l.Ref)} {
		if have, err := layer.Resolve(ctx, s, tag); err == nil {
			l.Ref, l.Digest = tag, have.Digest
			return true
		}
	}
	return false
}

// heldAs is ref's image as the store holds it, if it was pulled from
// manifest for platform and every layer of it is still held (whole
// says; nil: in the store).
func heldAs(ctx context.Context, s *store.Store, ref Reference, manifest digest.Digest, platform Platform, whole func(context.Context, *Image) bool) (*Image, bool) {
	img, err := Lookup(ctx, s, ref)
	if err != nil || img.Manifest != manifest || img.Platform != platform.String() {
		return nil, false
	}
	if whole != nil {
		return img, whole(ctx, img)
	}
	for _, l := range img.Layers {
		if have, err := layer.Resolve(ctx, s, l.Ref); err != nil || have.Digest != l.Digest {
			return nil, false
		}
	}
	return img, true
}

type noProgress struct{}

func (noProgress) Add(int64) {}

// fetchJSON reads a manifest, an index or a config whole, bounded, and
// checks it against its descriptor.
func fetchJSON(ctx context.Context, repo *orasremote.Repository, d ocispec.Descriptor) ([]byte, error) {
	if d.Size > maxJSON {
		return nil, fmt.Errorf("%w: %s is %d bytes, more than a manifest or config may be", layer.ErrBadSource, d.Digest, d.Size)
	}
	var rc io.ReadCloser
	var err error
	if isIndex(d.MediaType) || d.MediaType == ocispec.MediaTypeImageManifest || d.MediaType == dockerManifest {
		rc, err = repo.Manifests().Fetch(ctx, d)
	} else {
		rc, err = repo.Blobs().Fetch(ctx, d)
	}
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	b, err := content.ReadAll(rc, d)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", layer.ErrBadSource, d.Digest, err)
	}
	return b, nil
}

// convertSpooled is convert with the compressed bytes kept as they come
// (the store's resumable ingest of the blob's digest), so that an import
// killed or cut in the middle of a layer takes it up there the next
// time: what the spool holds is read again from the disk, the rest asked
// of the registry from that byte on. The spool goes once the layer is
// stored, or once its bytes prove bad (the layer is then converted once
// more, from the registry alone). Removed before the kernel's writeback
// comes to it (some 30 s), a spool costs no writes. resumed is the
// bytes of the blob read from the spool. keep false drops the spool
// whatever the failure.
func convertSpooled(ctx context.Context, s *store.Store, repo *orasremote.Repository, d ocispec.Descriptor, l Layer, under []digest.Digest, p layer.Progress, b *budget, cv layerConversion, keep bool) (_ *layer.Info, resumed int64, _ error) {
	spool, err := s.ResumeIngest(d.Digest)
	if err != nil {
		return nil, 0, err
	}
	held := spool.Size()
	if held > d.Size { // more than the blob: not its bytes
		spool.Discard()
		if spool, err = s.ResumeIngest(d.Digest); err != nil {
			return nil, 0, err
		}
		held = 0
	}
	if !keep && held == 0 { // nothing to read again, nothing to keep: no spool
		spool.Discard()
		info, _, err := convert(ctx, s, repo, d, l, under, p, b, cv, nil)
		return info, 0, err
	}
	used := b.used
	first := &counted{p: p}
	info, broke, err := convert(ctx, s, repo, d, l, under, first, b, cv, spool)
	switch {
	case err == nil:
		spool.Discard()
		return info, held, nil
	case !keep || errors.Is(err, errBudget) || errors.Is(err, errdefs.ErrOutOfRange) || !spool.Resumable():
		spool.Discard() // not to be kept, it would fail again, or it is another pull's
	case broke || ctx.Err() != nil || !errors.Is(err, layer.ErrBadSource):
		spool.Abort() // the transfer stopped, not its bytes: kept for the next try
	case held > 0 && !b.spent():
		// The bytes kept, or the registry's, are bad: the registry's
		// alone now, counted once.
		spool.Discard()
		b.used = used
		info, _, err = convert(ctx, s, repo, d, l, under, &counted{p: p, skip: first.n}, b, cv, nil)
	default:
		spool.Discard()
	}
	return info, 0, err
}

// counted tells p of the bytes added past the first skip, and counts
// them all (n): a layer converted again tells the progress only what
// its first try did not.
type counted struct {
	p       layer.Progress
	n, skip int64
}

func (c *counted) Add(n int64) {
	c.n += n
	if c.skip > 0 {
		d := min(n, c.skip)
		c.skip, n = c.skip-d, n-d
	}
	if n > 0 {
		c.p.Add(n)
	}
}

// convert streams one OCI layer from the registry into an EROFS layer
// tagged by its chain: the compressed bytes are checked against the
// blob's digest and the tar against the diff ID before the layer is
// stored. under are the EROFS layers below it, bottom first. With a
// spool (a resumable ingest; nil: none), the blob's bytes it holds are
// read from there, and those asked of the registry appended to it.
// broke says the transfer failed (not the bytes it brought).
// layerConversion is how an OCI layer becomes an EROFS layer: the entries it
// may hold (0: any), and whether its files are compressed.
type layerConversion struct {
	entries  int
	compress bool
}

func convert(ctx context.Context, s *store.Store, repo *orasremote.Repository, d ocispec.Descriptor, l Layer, under []digest.Digest, p layer.Progress, b *budget, cv layerConversion, spool *store.Ingest) (_ *layer.Info, broke bool, _ error) {
	info, rc, err := convertFrom(ctx, s, repo, d, l, under, p, b, cv, spool)
	return info, rc != nil && rc.broke != nil, err
}

func convertFrom(ctx context.Context, s *store.Store, repo *orasremote.Repository, d ocispec.Descriptor, l Layer, under []digest.Digest, p layer.Progress, b *budget, cv layerConversion, spool *store.Ingest) (*layer.Info, *resuming, error) {
	diffID := l.DiffID
	st, err := openStack(s, under)
	if err != nil {
		return nil, nil, err
	}
	defer st.Close()
	var held int64
	if spool != nil && spool.Resumable() {
		held = spool.Size()
	}
	rc, err := resume(ctx, func(off int64) (io.ReadCloser, error) { return fetchFrom(ctx, repo, d, off) }, held)
	if err != nil {
		return nil, &resuming{broke: err}, err
	}
	defer rc.Close()
	var blob io.Reader = &counting{r: rc, p: p}
	if spool != nil && spool.Resumable() {
		p.Add(held)
		blob = io.MultiReader(io.NewSectionReader(spool.File, 0, held), io.TeeReader(blob, &spooling{f: spool.File}))
	}
	vr := content.NewVerifyReader(blob, d)
	plain, done, err := layer.Decompress(vr)
	if err != nil {
		return nil, rc, err
	}
	defer done()
	diffHash := sha256.New()
	tar := io.TeeReader(b.reader(plain), diffHash)
	verify := func() error {
		if _, err := io.Copy(io.Discard, tar); err != nil {
			return fmt.Errorf("%w: read the layer: %v", layer.ErrBadSource, err)
		}
		if _, err := io.Copy(io.Discard, vr); err != nil {
			return fmt.Errorf("%w: read the layer: %v", layer.ErrBadSource, err)
		}
		if err := vr.Verify(); err != nil {
			return fmt.Errorf("%w: the blob is not what its digest says (corrupt in the registry or on the way): %v", layer.ErrBadSource, err)
		}
		if got := digest.NewDigest(digest.SHA256, diffHash); got != diffID {
			return fmt.Errorf("%w: the layer's tar has digest %s, the image config says %s", layer.ErrBadSource, got, diffID)
		}
		return nil
	}
	info, err := layer.Build(ctx, s, layer.BuildOptions{
		Source: "-", Stdin: tar, SourceKind: "oci-layer", Kind: layer.KindBase, Ref: LayerTag(l.Chain, cv.compress),
		Verify: verify, Implied: st.implied, MaxEntries: cv.entries, Compress: cv.compress,
		// The same bytes on every host: the layer's manifest too.
		Now: func() time.Time { return time.Unix(0, 0) },
	})
	if b.spent() {
		return nil, rc, errBudget // what the tar reader made of it hides why
	}
	if errors.Is(err, erofs.ErrTooMany) {
		return nil, rc, fmt.Errorf("the layer holds more than the %d entries an import may here: ask the worker's admin to dsec image pull it: %w", cv.entries, errdefs.ErrOutOfRange)
	}
	if errors.Is(err, layer.ErrBadSource) {
		// A blob that does not decompress or untar may just not be
		// its digest's: say that, which says where the fault is.
		if _, cerr := io.Copy(io.Discard, vr); cerr == nil && vr.Verify() != nil {
			return nil, rc, fmt.Errorf("%w: the blob is not what its digest says (corrupt in the registry or on the way)", layer.ErrBadSource)
		}
	}
	return info, rc, err
}

// record writes the image's record and tags it by its reference.
func record(ctx context.Context, s *store.Store, ref Reference, img *Image) error {
	tag, err := ref.StoreTag()
	if err != nil {
		return err
	}
	release, err := s.Writer()
	if err != nil {
		return err
	}
	defer release()
	rb, _ := json.Marshal(img.Record)
	cfg, err := s.WriteBlob(MediaTypeRecord, rb)
	if err != nil {
		return err
	}
	man := ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest,
		ArtifactType: ArtifactType, Config: cfg,
	}
	for _, l := range img.Layers {
		d, err := s.Resolve(ctx, l.Ref)
		if err != nil {
			return fmt.Errorf("%s: layer %s left the store during the import (a gc?): import again: %w", ref, l.Ref, err)
		}
		man.Layers = append(man.Layers, ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: d.Digest, Size: d.Size})
	}
	mb, _ := json.Marshal(man)
	md, err := s.WriteBlob(ocispec.MediaTypeImageManifest, mb)
	if err != nil {
		return err
	}
	md.ArtifactType = ArtifactType
	md.Annotations = map[string]string{layer.AnnotationKind: string(layer.KindImage)}
	// A tag pulled again moves to what the registry says now; the
	// layers only the image it named had go with it.
	var old *Image
	if d, err := s.Resolve(ctx, tag.String()); err == nil {
		if d.Annotations[layer.AnnotationKind] != string(layer.KindImage) {
			return fmt.Errorf("%s: the store's tag %s names a layer, not an image: remove it (dsec layer rm) to import the image: %w", ref, tag, errdefs.ErrAlreadyExists)
		}
		if old, err = load(s, d); err != nil {
			old = nil
		}
	}
	if err := s.Tag(ctx, tag.String(), md, true); err != nil {
		return err
	}
	img.Tag, img.ID = tag.String(), md.Digest
	if old != nil && old.ID != img.ID {
		return untagUnshared(ctx, s, old)
	}
	return nil
}

// counting tells p of the bytes read.
type counting struct {
	r io.Reader
	p layer.Progress
}

func (c *counting) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.p.Add(int64(n))
	return n, err
}

// maxResumes bounds how often one blob's transfer is taken up again.
const maxResumes = 5

// resuming reads a blob, taking a cut transfer up again where it
// stopped: a new request for the bytes from there. What it reads is
// checked against the blob's digest all the same.
type resuming struct {
	ctx   context.Context
	fetch func(off int64) (io.ReadCloser, error)
	rc    io.ReadCloser
	off   int64
	tries int
	broke error // how the transfer failed, if it did
}

// resume reads the blob from byte from on.
func resume(ctx context.Context, fetch func(off int64) (io.ReadCloser, error), from int64) (*resuming, error) {
	rc, err := fetch(from)
	if err != nil {
		return nil, err
	}
	return &resuming{ctx: ctx, fetch: fetch, rc: rc, off: from}, nil
}

// fetchFrom is blob d's bytes from byte off on: an HTTP Range request
// where off > 0, the first bytes read and dropped where the registry
// serves the whole blob all the same. (oras' Fetch asks for the whole
// blob, and only its Seek then for a range: a transfer taken up again
// would start the whole blob's first.)
func fetchFrom(ctx context.Context, repo *orasremote.Repository, d ocispec.Descriptor, off int64) (io.ReadCloser, error) {
	switch {
	case off == 0:
		return repo.Blobs().Fetch(ctx, d)
	case off == d.Size: // all of it is at hand (a registry answers such a range 416)
		return io.NopCloser(strings.NewReader("")), nil
	}
	ref := repo.Reference
	ref.Reference = d.Digest.String()
	scheme := "https"
	if repo.PlainHTTP {
		scheme = "http"
	}
	u := fmt.Sprintf("%s://%s/v2/%s/blobs/%s", scheme, ref.Host(), ref.Repository, ref.Reference)
	req, err := http.NewRequestWithContext(auth.AppendRepositoryScope(ctx, ref, auth.ActionPull), http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Range", fmt.Sprintf("bytes=%d-", off))
	client := repo.Client
	if client == nil {
		client = auth.DefaultClient
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	switch resp.StatusCode {
	case http.StatusPartialContent:
		if !strings.HasPrefix(resp.Header.Get("Content-Range"), fmt.Sprintf("bytes %d-", off)) {
			resp.Body.Close()
			return nil, fmt.Errorf("GET %s from byte %d: the registry answered the range %q", u, off, resp.Header.Get("Content-Range"))
		}
		return resp.Body, nil
	case http.StatusOK: // no ranges here: read up to there
		if resp.ContentLength != -1 && resp.ContentLength != d.Size {
			resp.Body.Close()
			return nil, fmt.Errorf("GET %s: %d bytes, the blob is %d", u, resp.ContentLength, d.Size)
		}
		if _, err := io.CopyN(io.Discard, resp.Body, off); err != nil {
			resp.Body.Close()
			return nil, err
		}
		return resp.Body, nil
	case http.StatusNotFound:
		resp.Body.Close()
		return nil, fmt.Errorf("%s: %w", d.Digest, errdefs.ErrNotFound)
	default: // classified as oras' own answers are (remote.Classify)
		resp.Body.Close()
		return nil, &errcode.ErrorResponse{Method: req.Method, URL: req.URL, StatusCode: resp.StatusCode}
	}
}

func (r *resuming) Read(b []byte) (int, error) {
	n, err := r.rc.Read(b)
	r.off += int64(n)
	if err != nil && err != io.EOF {
		r.broke = err
	}
	if err == nil || err == io.EOF || r.tries >= maxResumes || r.ctx.Err() != nil {
		return n, err
	}
	r.tries++
	r.rc.Close()
	select { // a moment for what cut it to pass
	case <-time.After(time.Duration(r.tries) * 100 * time.Millisecond):
	case <-r.ctx.Done():
	}
	rc, ferr := r.fetch(r.off)
	if ferr != nil {
		r.rc = io.NopCloser(eofReader{})
		return n, fmt.Errorf("%w (taken up again at byte %d: %v)", err, r.off, ferr)
	}
	r.rc, r.broke = rc, nil
	return n, nil
}

// spooling appends what it is given to a spool, until a write fails
// (a full disk): then it keeps no more, so the spool stays the blob's
// first bytes, and the import goes on without it.
type spooling struct {
	f      *os.File
	failed bool
}

func (w *spooling) Write(b []byte) (int, error) {
	if !w.failed {
		if _, err := w.f.Write(b); err != nil {
			w.failed = true
		}
	}
	return len(b), nil
}

func (r *resuming) Close() error { return r.rc.Close() }

type eofReader struct{}

func (eofReader) Read([]byte) (int, error) { return 0, io.ErrUnexpectedEOF }

// budget is what an import may unpack in all (limit 0: no bound).
type budget struct{ limit, used int64 }

var errBudget = fmt.Errorf("the image unpacks to more than an import may write here: ask the worker's admin to dsec image pull it: %w", errdefs.ErrOutOfRange)

func (b *budget) reader(r io.Reader) io.Reader {
	if b.limit <= 0 {
		return r
	}
	return &spending{r: r, b: b}
}

func (b *budget) spent() bool { return b.limit > 0 && b.used > b.limit }

type spending struct {
	r io.Reader
	b *budget
}

func (s *spending) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	if s.b.used += int64(n); s.b.spent() {
		return n, errBudget
	}
	return n, err
}
