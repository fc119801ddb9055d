package layer

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/store"
	dlog "github.com/dsec-project/dsec/internal/log"
)

// Media types of what a layer is made of.
const (
	MediaTypeLayer    = "application/vnd.erofs.layer.v1" // containerd's native EROFS layer
	MediaTypeConfig   = "application/vnd.dsec.layer.config.v1+json"
	MediaTypeWindows  = "application/vnd.dsec.layer.windows.v1"
	ArtifactType      = "application/vnd.dsec.layer.v1"
	WindowSize        = 64 << 10 // see Windows
	AnnotationKind    = "dev.dsec.layer.kind"
	AnnotationMetaOff = "dev.dsec.layer.metadata.offset"
	AnnotationMetaLen = "dev.dsec.layer.metadata.size"
)

// Kind is what a layer holds.
type Kind string

// The kinds of layer a sandbox stacks: toolkit over workspace over base.
const (
	KindBase      Kind = "base"
	KindWorkspace Kind = "workspace"
	KindToolkit   Kind = "toolkit"
	// KindSnapshot is a sandbox's changes over the layers it ran on,
	// made by dsec snap pack-diff; its config names those layers.
	KindSnapshot Kind = "snapshot"
	// KindImage is no layer: an image's record (package image), its
	// layers in order and its config, tagged in the same index.
	KindImage Kind = "image"
	// KindVMImage is no layer either: a full VM's bootable disk image
	// (package vm), tagged in the same index.
	KindVMImage Kind = "vm-image"
)

// Kinds lists the valid kinds.
var Kinds = []Kind{KindBase, KindWorkspace, KindToolkit}

// ParseKind checks a kind name.
func ParseKind(s string) (Kind, error) {
	for _, k := range Kinds {
		if string(k) == s {
			return k, nil
		}
	}
	return "", fmt.Errorf("unknown layer kind %q (want base, workspace or toolkit): %w", s, errdefs.ErrInvalidArgument)
}

type badSource struct{}

func (badSource) Error() string   { return "bad source" }
func (badSource) Is(t error) bool { return t == errdefs.ErrInvalidArgument }
func (badSource) Unwrap() error   { return nil }
func (badSource) String() string  { return "bad source" }

// ErrBadSource is wrapped by errors about the source's content: a corrupt
// archive, an entry a layer cannot hold. It is an ErrInvalidArgument.
var ErrBadSource error = badSource{}

// Progress receives the bytes of file data converted so far.
type Progress interface{ Add(n int64) }

type noProgress struct{}

func (noProgress) Add(int64) {}

var (
	nameRE = sync.OnceValue(func() *regexp.Regexp {
		return regexp.MustCompile(`^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$`)
	})
	versionRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$`) })
)

// Ref is a layer's tag, NAME:VERSION.
type Ref struct{ Name, Version string }

func (r Ref) String() string { return r.Name + ":" + r.Version }

// ParseRef parses NAME:VERSION; a missing version is "latest".
func ParseRef(s string) (Ref, error) {
	name, version, ok := strings.Cut(s, ":")
	if !ok {
		version = "latest"
	}
	if len(name) > 255 || !nameRE().MatchString(name) {
		return Ref{}, fmt.Errorf("bad layer name %q: use lowercase letters, digits, '.', '_', '-' and '/' (e.g. debian/bookworm:2026.11): %w", name, errdefs.ErrInvalidArgument)
	}
	if !versionRE().MatchString(version) {
		return Ref{}, fmt.Errorf("bad layer version %q: use up to 128 letters, digits, '.', '_' and '-', not starting with '.' or '-': %w", version, errdefs.ErrInvalidArgument)
	}
	return Ref{name, version}, nil
}

// Config is the layer's config blob: what a host needs to mount it
// lazily and what the CLI reports.
type Config struct {
	Kind      Kind         `json:"kind"`
	Created   time.Time    `json:"created"`
	Source    string       `json:"source"` // dir, tar or image-archive
	BlockSize int          `json:"block_size"`
	Files     uint64       `json:"files"`  // paths, hard links counted, root included
	Inodes    uint64       `json:"inodes"` // distinct inodes
	Data      erofs.Region `json:"data"`
	Metadata  erofs.Region `json:"metadata"`
	Windows   Windows      `json:"windows"`
	Snapshot  *Lineage     `json:"snapshot,omitempty"` // KindSnapshot only
	// Hot is the start of the data region holding the files of the access
	// profile the layer was built with (build --order), in profile order:
	// lazy mounts fetch it in the background. Nil without a profile.
	Hot *erofs.Region `json:"hot,omitempty"`
	// Compressed counts the regular files stored compressed (LZ4: build
	// --compress); 0 for a layer whose files are all as they are.
	Compressed uint64 `json:"compressed_files,omitempty"`
}

// Lineage is where a snapshot layer comes from: the layers it stands on
// (its parent first, the base last) and the sandbox it was packed from.
// Stacking the snapshot over Lowers gives the sandbox's view when it was
// packed.
type Lineage struct {
	Lowers  []Lower `json:"lowers"`
	Sandbox string  `json:"sandbox"`
	// Incremental: only what changed since the parent snapshot, which
	// came from the same sandbox; else everything the sandbox wrote.
	Incremental bool `json:"incremental,omitempty"`
	// The sandbox's environment, working directory and user for every
	// exec, which sandboxes started on the snapshot inherit unless given.
	Env     []string `json:"env,omitempty"`
	Workdir string   `json:"workdir,omitempty"`
	User    string   `json:"user,omitempty"`
	// Memory: a memory snapshot's guest (pack-diff --memory of a
	// microVM), which a microVM starts again where it stopped.
	Memory *Memory `json:"memory,omitempty"`
}

// Parent is the layer the snapshot was taken over; none for one that
// stands on no layer (a full VM's flattened disk).
func (l *Lineage) Parent() Lower {
	if len(l.Lowers) == 0 {
		return Lower{}
	}
	return l.Lowers[0]
}

// Lower is one layer under a snapshot, by tag and by layer digest: a
// snapshot stands on exactly those bytes, whatever the tag names later.
type Lower struct {
	Ref    string        `json:"ref"`
	Digest digest.Digest `json:"digest"`
}

// Windows describes the per-window sha256 table stored beside the image:
// Count hashes of Size-byte windows (the last may be short), 32 bytes
// each, in a blob of its own. A window is the least a lazy mount fetches
// and checks: layers are built with WindowSize (64 KiB) windows, so a
// fetch takes about what a read needs, and the fetcher fetches several
// in one request where reads go on; layers of 1 MiB windows, built
// before, mount as they are.
type Windows struct {
	Size   int64         `json:"size"`
	Count  int           `json:"count"`
	Digest digest.Digest `json:"digest"`
}

// Info describes a stored layer.
type Info struct {
	Ref      string        `json:"name"`
	Kind     Kind          `json:"kind"`
	Digest   digest.Digest `json:"digest"`
	Size     int64         `json:"size"`
	Manifest digest.Digest `json:"manifest"`
	Created  time.Time     `json:"created"`
	Files    uint64        `json:"files"`
	Inodes   uint64        `json:"inodes"`
	Metadata erofs.Region  `json:"metadata"`
	Windows  Windows       `json:"windows"`
	Source   string        `json:"source,omitempty"`
	Snapshot *Lineage      `json:"snapshot,omitempty"`
	Hot      *erofs.Region `json:"hot,omitempty"`
	// Compressed counts its files stored LZ4-compressed (Config.Compressed).
	Compressed uint64 `json:"compressed_files,omitempty"`
}

// BuildOptions says what to build.
type BuildOptions struct {
	Source   string    // a directory, a tar or image archive file, or "-"
	Stdin    io.Reader // read when Source is "-"
	Kind     Kind
	Ref      Ref
	Force    bool // replace an existing tag that names other content
	Progress Progress
	Now      func() time.Time

	// Walk, when set, is the source instead of Source: it plans every
	// regular file (erofs.Writer.Plan), so the image is hashed as it is
	// written. SourceKind names it in the config.
	Walk       func(context.Context, *erofs.Writer) error
	SourceKind string // also names a stream (Source "-") in the config
	// Verify, when set, runs once the source was converted and before
	// anything is stored: an error (a digest that does not match) keeps
	// the layer out of the store.
	Verify func() error
	// Implied gives the attributes of directories a tar holds only
	// because it adds something below them (erofs.Writer.SetImplied).
	Implied func(p string) (erofs.Attr, bool)
	// MaxEntries bounds the entries a source may add (0: none).
	MaxEntries int
	Snapshot   *Lineage // a snapshot layer's lineage

	// Order lists the files (or parts of them) whose data goes first, in
	// this order: an access profile (see lazy.Profile and ParseProfile).
	// Only a directory source can be ordered.
	Order []erofs.Hot
	// WindowSize is the layer's window (see Windows): 0 is WindowSize;
	// otherwise a power of two from MinWindowSize to MaxWindowSize.
	WindowSize int64
	// Compress stores a stream's regular files LZ4-compressed where that
	// saves a block (erofs.Writer.SetCompress): fewer bytes written,
	// stored and fetched, for the CPU of decompressing what is read. A
	// directory source (planned) is refused; a store that packs layers
	// into shared chunks (Store.Dedup) keeps them uncompressed.
	Compress bool
}

// The bounds of BuildOptions.WindowSize: a window is whole blocks, and
// one is fetched in one request.
const (
	MinWindowSize = 4 << 10
	MaxWindowSize = 4 << 20
)

// CheckWindowSize says what is wrong with a window size, if anything.
func CheckWindowSize(n int64) error {
	if n < MinWindowSize || n > MaxWindowSize || n&(n-1) != 0 {
		return fmt.Errorf("window size %d: use a power of two from 4KiB to 4MiB", n)
	}
	return nil
}

// Build converts the source into an EROFS layer, stores it and tags it.
// The store is unchanged unless the whole layer was written and synced.
func Build(ctx context.Context, s *store.Store, o BuildOptions) (*Info, error) {
	if err := o.prepare(); err != nil {
		return nil, err
	}
	existing, err := existingTag(ctx, s, o)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	src, err := buildSource(o)
	if err != nil {
		return nil, err
	}
	defer src.close()
	if len(o.Order) > 0 && !src.planned {
		return nil, fmt.Errorf("--order needs a directory source: a %s is written as it is read: %w", src.kind, errdefs.ErrInvalidArgument)
	}
	if o.Compress && src.planned {
		return nil, fmt.Errorf("--compress needs a stream or an archive: a directory is laid out before it is read, and stays uncompressed (tar -C DIR -c . | dsec layer build - compresses it): %w", errdefs.ErrInvalidArgument)
	}

	release, err := s.Writer()
	if err != nil {
		return nil, err
	}
	defer release()
	in, err := s.NewIngest()
	if err != nil {
		return nil, err
	}
	defer in.Abort()
	w, err := erofs.NewWriter(in)
	if err != nil {
		return nil, storeErr(err)
	}
	// A directory is planned then written in one pass that is hashed as
	// it goes; a stream is written as it arrives and hashed afterwards.
	var h *hasher
	win := o.window()
	if src.planned {
		h = newHasher(0, win)
		defer h.Close()
		h.onData = func(n int) { o.Progress.Add(int64(n)) }
		w.Observe(h)
	}
	w.SetImplied(o.Implied)
	w.SetMaxEntries(o.MaxEntries)
	w.SetCompress(o.Compress && !s.Dedup()) // a directory (planned) was refused above
	if err := w.SetOrder(o.Order); err != nil {
		return nil, fmt.Errorf("--order: %w", err)
	}
	if err := src.add(ctx, w, o.Progress); err != nil {
		return nil, storeErr(err)
	}
	if o.Verify != nil {
		if err := o.Verify(); err != nil {
			return nil, err
		}
	}
	st, err := w.Finish()
	if err != nil {
		return nil, storeErr(err)
	}
	lg := dlog.From(ctx)
	lg.Debug("image written", "bytes", st.Size, "inodes", st.Inodes, "seconds", time.Since(start).Seconds())
	if h == nil {
		if h, err = hashFile(in.File, st.Size, win); err != nil {
			return nil, err
		}
		defer h.Close()
	}
	dgst, n, wins := h.Sum()
	blob, err := in.CommitDigest(dgst, n)
	if err != nil {
		return nil, storeErr(err)
	}
	if existing != nil {
		if have := existing.Annotations[annotationLayer]; have != blob.Digest.String() {
			return nil, fmt.Errorf("tag %s already exists for other content (layer %s, this build %s); pass --force to replace it: %w", o.Ref, have, blob.Digest, errdefs.ErrAlreadyExists)
		}
		return Resolve(ctx, s, o.Ref.String())
	}
	lg.Debug("image committed", "digest", blob.Digest, "seconds", time.Since(start).Seconds())
	if s.Dedup() {
		pack(ctx, s, blob.Digest) // before it is tagged: nothing has mounted it yet
	}
	return tagLayer(ctx, s, o, src.kind, st, blob, wins)
}

// prepare fills o's defaults and checks its kind and window size.
func (o *BuildOptions) prepare() error {
	if o.Progress == nil {
		o.Progress = noProgress{}
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if _, err := ParseKind(string(o.Kind)); err != nil && (o.Kind != KindSnapshot || o.Snapshot == nil) {
		return err
	}
	if o.WindowSize != 0 {
		if err := CheckWindowSize(o.WindowSize); err != nil {
			return fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// pack packs a new layer's blob into the store's shared chunks; a layer
// that cannot be is kept whole, with a warning.
func pack(ctx context.Context, s *store.Store, d digest.Digest) {
	lg := dlog.From(ctx)
	if res, err := s.Pack(ctx, d); err != nil {
		lg.Warn("layer kept whole: it could not be packed into shared chunks", "digest", d, "err", err)
	} else if res != nil {
		lg.Debug("layer packed", "digest", d, "logical", res.Logical, "shared", res.Shared, "new", res.BlobBlocks*erofs.BlockSize)
	}
}

// existingTag is the layer o.Ref names already, when the build may give
// it again. A tag that names a layer already is refused unless the build
// gives that very layer again (of the same kind): then the build is a
// no-op, as re-running it should be.
// A tag that names an image or a VM image is never taken, --force or
// not: those are removed by their own commands.
func existingTag(ctx context.Context, s *store.Store, o BuildOptions) (*ocispec.Descriptor, error) {
	d, err := s.Resolve(ctx, o.Ref.String())
	if err != nil {
		return nil, nil
	}
	switch kind := Kind(d.Annotations[AnnotationKind]); kind {
	case KindImage:
		return nil, fmt.Errorf("%s names an image, not a layer: give the layer another name (dsec image rm removes the image): %w", o.Ref, errdefs.ErrAlreadyExists)
	case KindVMImage:
		return nil, fmt.Errorf("%s names a VM image, not a layer: give the layer another name (dsec vm image rm removes the VM image): %w", o.Ref, errdefs.ErrAlreadyExists)
	default:
		if o.Force {
			return nil, nil
		}
		if o.Kind == KindSnapshot || kind != o.Kind {
			return nil, fmt.Errorf("tag %s already exists (a %s layer, %s); pass --force to replace it: %w", o.Ref, kind, d.Annotations[annotationLayer], errdefs.ErrAlreadyExists)
		}
	}
	return &d, nil
}

// buildSource is what a build reads: o.Walk's plan, else o.Source
// opened.
func buildSource(o BuildOptions) (*source, error) {
	var src *source
	if o.Walk != nil {
		src = &source{kind: o.SourceKind, close: func() {}, planned: true,
			add: func(ctx context.Context, w *erofs.Writer, _ Progress) error { return o.Walk(ctx, w) }}
	} else {
		var err error
		if src, err = openSource(o.Source, o.Stdin); err != nil {
			return nil, err
		}
		if o.SourceKind != "" {
			src.kind = o.SourceKind
		}
	}
	return src, nil
}

// tagLayer stores what describes the layer blob committed (its windows'
// digests, its config, its manifest) and tags it o.Ref.
func tagLayer(ctx context.Context, s *store.Store, o BuildOptions, kind string, st erofs.Stats, blob ocispec.Descriptor, wins []byte) (*Info, error) {
	blob.MediaType = MediaTypeLayer
	winDesc, err := s.WriteBlob(MediaTypeWindows, wins)
	if err != nil {
		return nil, storeErr(err)
	}
	cfg := Config{
		Kind: o.Kind, Created: o.Now().UTC().Round(time.Second), Source: kind, BlockSize: erofs.BlockSize,
		Files: st.Entries, Inodes: st.Inodes, Data: st.Data, Metadata: st.Metadata,
		Windows:  Windows{Size: o.window(), Count: len(wins) / sha256.Size, Digest: winDesc.Digest},
		Snapshot: o.Snapshot, Compressed: st.Compressed,
	}
	if st.Hot.Size > 0 {
		cfg.Hot = &st.Hot
	}
	cb, _ := json.Marshal(cfg)
	cfgDesc, err := s.WriteBlob(MediaTypeConfig, cb)
	if err != nil {
		return nil, storeErr(err)
	}
	blob.Annotations = map[string]string{
		AnnotationKind:    string(o.Kind),
		AnnotationMetaOff: strconv.FormatInt(st.Metadata.Offset, 10),
		AnnotationMetaLen: strconv.FormatInt(st.Metadata.Size, 10),
	}
	m := ocispec.Manifest{
		Versioned:    specs.Versioned{SchemaVersion: 2},
		MediaType:    ocispec.MediaTypeImageManifest,
		ArtifactType: ArtifactType,
		Config:       cfgDesc,
		Layers:       []ocispec.Descriptor{blob},
		Annotations:  map[string]string{ocispec.AnnotationCreated: cfg.Created.Format(time.RFC3339)},
	}
	mb, _ := json.Marshal(m)
	mDesc, err := s.WriteBlob(ocispec.MediaTypeImageManifest, mb)
	if err != nil {
		return nil, storeErr(err)
	}
	mDesc.ArtifactType = ArtifactType
	mDesc.Annotations = TagAnnotations(o.Kind, blob.Digest)
	if err := s.Tag(ctx, o.Ref.String(), mDesc, o.Force); err != nil {
		return nil, err
	}
	return info(o.Ref.String(), mDesc, blob, cfg), nil
}

const annotationLayer = "dev.dsec.layer.digest"

func info(ref string, m, blob ocispec.Descriptor, cfg Config) *Info {
	return &Info{
		Ref: ref, Kind: cfg.Kind, Digest: blob.Digest, Size: blob.Size, Manifest: m.Digest,
		Created: cfg.Created, Files: cfg.Files, Inodes: cfg.Inodes, Metadata: cfg.Metadata,
		Windows: cfg.Windows, Source: cfg.Source, Snapshot: cfg.Snapshot, Hot: cfg.Hot, Compressed: cfg.Compressed,
	}
}

// WindowTable is the window table (Windows) of the size bytes of f in
// windows of window bytes: what a lazy reader of f's blob checks each
// window it fetches against.
func WindowTable(f *os.File, size, window int64) ([]byte, error) {
	h, err := hashFile(f, size, window)
	if err != nil {
		return nil, err
	}
	_, _, table := h.Sum()
	return table, nil
}

// hashFile reads what was written back through a hasher.
func hashFile(f *os.File, size, window int64) (*hasher, error) {
	h := newHasher(size, window)
	buf := make([]byte, hashChunk)
	for off := int64(0); off < size; off += hashChunk {
		n := min(hashChunk, size-off)
		if _, err := f.ReadAt(buf[:n], off); err != nil {
			h.Sum()
			return nil, fmt.Errorf("hash layer: %w", err)
		}
		h.Write(buf[:n])
	}
	return h, nil
}

// storeErr marks a full file system, wherever the write failed.
func storeErr(err error) error {
	if !errors.Is(err, store.ErrNoSpace) && (errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT)) {
		return fmt.Errorf("%w: %w", store.ErrNoSpace, err)
	}
	return err
}

// window is the layer's window size.
func (o BuildOptions) window() int64 { return cmp.Or(o.WindowSize, WindowSize) }

// windowHasher hashes a stream in windows of size.
type windowHasher struct {
	h    hash.Hash
	size int64
	n    int64
	out  []byte
}

func newWindowHasher(hint, size int64) *windowHasher {
	return &windowHasher{h: sha256.New(), size: size, out: make([]byte, 0, (hint+size-1)/size*sha256.Size)}
}

func (w *windowHasher) Write(p []byte) {
	for len(p) > 0 {
		k := min(int64(len(p)), w.size-w.n)
		w.h.Write(p[:k])
		w.n += k
		p = p[k:]
		if w.n == w.size {
			w.out = w.h.Sum(w.out)
			w.h.Reset()
			w.n = 0
		}
	}
}

// Sum returns the table, closing a short last window.
func (w *windowHasher) Sum() []byte {
	if w.n > 0 {
		w.out = w.h.Sum(w.out)
		w.h.Reset()
		w.n = 0
	}
	return w.out
}
