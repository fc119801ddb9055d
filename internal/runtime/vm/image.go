package vm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// Media types of a VM image in the store: an OCI manifest of artifact
// type ArtifactType whose config is the Record and whose layers are its
// disk, as qcow2 images (what its partitions hold, however large the
// disk): one for an image built, the image's and then one block diff
// per snapshot for a snapshot of a VM (Snapshot), base first. A diff
// names no backing file of its own (its bytes are the same on every
// host): the backend stacks the chain itself.
const (
	ArtifactType    = "application/vnd.dsec.vm.image.v1"
	MediaTypeRecord = "application/vnd.dsec.vm.image.record.v1+json"
	MediaTypeDisk   = "application/vnd.dsec.vm.disk.v1.qcow2"
	// MediaTypeState is a saved guest's device state and RAM (QEMU's
	// migration stream): a memory snapshot's last layer, after its disk.
	MediaTypeState = "application/vnd.dsec.vm.state.v1"
	maxJSON        = 1 << 20
	// MaxChain bounds a disk's chain: QEMU opens every image of it, and
	// reads walk it down to where a block was last written.
	MaxChain = 64
)

// Record is what the store keeps of a VM image beside its disk.
type Record struct {
	Created time.Time `json:"created"`
	Source  string    `json:"source"` // the trees it was built from, topmost first, ", " between
	Disk    Disk      `json:"disk"`
	// A snapshot's: the sandbox it was taken of, and the VM image or
	// snapshot it was taken over (the chain less its last diff).
	Sandbox string `json:"sandbox,omitempty"`
	Parent  string `json:"parent,omitempty"`
	// Memory: a memory snapshot's guest, saved running (its state the
	// manifest's last layer, Image.State).
	Memory *Memory `json:"memory,omitempty"`
}

// Memory is what a branch needs to continue a saved guest: the machine
// it ran on (the same QEMU, firmware, RAM and vCPUs) and the nonce its
// agent waits for.
type Memory struct {
	Machine layer.Machine `json:"machine"`
	Nonce   string        `json:"nonce"`
	// Policy is the sandbox's when it was saved: the guest holds its
	// file rules in its memory, which a branch's policy may only add to.
	Policy *api.Policy `json:"policy,omitempty"`
}

// Image is a VM image in the store.
type Image struct {
	Tag string        `json:"name"`
	ID  digest.Digest `json:"id"` // its manifest's digest
	// Blob is the disk's top (a snapshot's diff), Path its file in the
	// store (read-only); Chain the whole disk, base first.
	Blob  ocispec.Descriptor   `json:"blob"`
	Path  string               `json:"path"`
	Chain []ocispec.Descriptor `json:"chain,omitempty"`
	// State is a memory snapshot's saved guest (Record.Memory).
	State *ocispec.Descriptor `json:"state,omitempty"`
	// Tables are its disks' window tables (windows.go).
	Tables []ocispec.Descriptor `json:"tables,omitempty"`
	Record
}

// Files are the image's disk's files in the store, topmost first.
func (img *Image) Files(s *store.Store) []string {
	out := make([]string, len(img.Chain))
	for i, d := range img.Chain {
		out[len(out)-1-i] = s.BlobPath(d.Digest)
	}
	return out
}

// Digests are the image's disk's blobs, topmost first.
func (img *Image) Digests() []string {
	out := make([]string, len(img.Chain))
	for i, d := range img.Chain {
		out[len(out)-1-i] = d.Digest.String()
	}
	return out
}

// BuildOptions are a build's: the disk's shape, and whether the tag
// may move from another VM image.
type BuildOptions struct {
	DiskOptions
	Force bool
}

// Build makes a disk image of trees (BuildDisk), topmost first: one
// tree, or several seen as one through a read-only overlay (a tree of
// changes over a distribution's, say), in the store, tagged ref. A tree
// that is no path on the host may name the store's layer, snapshot or
// imported image, whose layers are then the trees (sources). The
// disk is written in the store's ingest area and becomes a blob named by
// its digest; nothing is left behind on a failure.
func Build(ctx context.Context, s *store.Store, trees []string, ref layer.Ref, o BuildOptions) (*Image, error) {
	release, err := s.Writer()
	if err != nil {
		return nil, err
	}
	defer release()
	if err := checkTag(ctx, s, ref, o.Force); err != nil {
		return nil, err
	}
	if len(trees) == 0 {
		return nil, fmt.Errorf("no tree to build a VM image of: %w", errdefs.ErrInvalidArgument)
	}
	trees, what, unmount, err := sources(ctx, s, trees, filepath.Join(s.Dir(), "ingest"))
	if err != nil {
		return nil, err
	}
	defer unmount()
	tree, unstack, err := stack(trees, filepath.Join(s.Dir(), "ingest"))
	if err != nil {
		return nil, err
	}
	defer unstack()
	// The raw disk is built beside the store's ingests (dsec layer gc
	// removes one a killed build left), then stored as qcow2: its bytes,
	// hashed for its digest, are what the partitions hold, not the size
	// the disk has.
	raw, err := os.CreateTemp(filepath.Join(s.Dir(), "ingest"), "blob.*.raw")
	if err != nil {
		return nil, err
	}
	defer os.Remove(raw.Name())
	d, err := BuildDisk(ctx, tree, raw, o.DiskOptions)
	raw.Close()
	if err != nil {
		return nil, err
	}
	blob, err := storeRaw(ctx, s, raw.Name())
	if err != nil {
		return nil, err
	}
	rec := Record{Created: time.Now().UTC(), Source: strings.Join(what, ", "), Disk: d}
	return record(ctx, s, ref, []ocispec.Descriptor{blob}, nil, rec, o.Force)
}

// storeRaw stores the raw disk image at path as a qcow2 blob of s (its
// bytes, hashed for its digest, are what the partitions hold, not the
// size the disk has), and removes path.
func storeRaw(ctx context.Context, s *store.Store, path string) (ocispec.Descriptor, error) {
	in, err := s.NewIngest()
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	defer in.Abort()
	if out, err := exec.CommandContext(ctx, "qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", path, in.File.Name()).CombinedOutput(); err != nil {
		if errors.Is(err, exec.ErrNotFound) {
			return ocispec.Descriptor{}, fmt.Errorf("store the disk: qemu-img is missing: install qemu-utils (make deps does)")
		}
		return ocispec.Descriptor{}, fmt.Errorf("store the disk as qcow2: qemu-img: %v: %s", err, strings.TrimSpace(string(out)))
	}
	os.Remove(path)
	blob, err := in.Commit("")
	blob.MediaType = MediaTypeDisk
	return blob, err
}

// Snapshot records the VM image ref (new) whose disk is chain, blobs
// of the store base first (the last a sandbox's block diff), as rec
// (its Sandbox and Parent) says; state is the saved guest's blob for a
// memory snapshot (rec.Memory), else nil; known are the window tables
// of the chain's disks its parent has. The caller holds the store's
// writer.
func Snapshot(ctx context.Context, s *store.Store, ref layer.Ref, chain []ocispec.Descriptor, state *ocispec.Descriptor, known []ocispec.Descriptor, rec Record) (*Image, error) {
	if _, err := s.Resolve(ctx, ref.String()); err == nil {
		return nil, fmt.Errorf("tag %s already exists: give the snapshot another NAME:STEP: %w", ref, errdefs.ErrAlreadyExists)
	}
	if (state == nil) != (rec.Memory == nil) {
		return nil, fmt.Errorf("a VM snapshot's memory needs both its state and its record: %w", errdefs.ErrInvalidArgument)
	}
	for i := range chain {
		chain[i].MediaType = MediaTypeDisk
	}
	layers := chain
	if state != nil {
		st := *state
		st.MediaType = MediaTypeState
		layers = append(slices.Clip(chain), st)
	}
	return record(ctx, s, ref, layers, known, rec, false)
}

// record tags ref as the VM image of layers (its disk's chain base
// first, then a saved guest's state) and rec, with its disks' window
// tables (known, or made of the disks).
func record(ctx context.Context, s *store.Store, ref layer.Ref, layers, known []ocispec.Descriptor, rec Record, force bool) (*Image, error) {
	disks := layers
	if n := len(layers); n > 1 && layers[n-1].MediaType == MediaTypeState {
		disks = layers[:n-1]
	}
	tabs, err := tables(ctx, s, disks, known)
	if err != nil {
		return nil, err
	}
	layers = append(slices.Clip(layers), tabs...)
	rb, err := json.Marshal(rec)
	if err != nil {
		return nil, err
	}
	cfg, err := s.WriteBlob(MediaTypeRecord, rb)
	if err != nil {
		return nil, err
	}
	man := ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest,
		ArtifactType: ArtifactType, Config: cfg, Layers: layers}
	mb, err := json.Marshal(man)
	if err != nil {
		return nil, err
	}
	md, err := s.WriteBlob(ocispec.MediaTypeImageManifest, mb)
	if err != nil {
		return nil, err
	}
	md.Annotations = map[string]string{layer.AnnotationKind: string(layer.KindVMImage)}
	if err := s.Tag(ctx, ref.String(), md, force); err != nil {
		return nil, err
	}
	img := split(&Image{Tag: ref.String(), ID: md.Digest, Chain: layers, Record: rec})
	img.Path = s.BlobPath(img.Blob.Digest)
	return img, nil
}

// split parts img.Chain, a manifest's layers, into the disk's chain,
// a saved guest's state after it and the disks' window tables after
// those, and sets Blob, the disk's top.
func split(img *Image) *Image {
	i := slices.IndexFunc(img.Chain, func(d ocispec.Descriptor) bool { return d.MediaType == MediaTypeWindows })
	if i > 0 {
		img.Chain, img.Tables = img.Chain[:i], img.Chain[i:]
	}
	if n := len(img.Chain); n > 1 && img.Chain[n-1].MediaType == MediaTypeState {
		st := img.Chain[n-1]
		img.State, img.Chain = &st, img.Chain[:n-1]
	}
	img.Blob = img.Chain[len(img.Chain)-1]
	return img
}

// checkTag refuses a tag that names anything but a VM image, and one
// that names a VM image without force.
func checkTag(ctx context.Context, s *store.Store, ref layer.Ref, force bool) error {
	d, err := s.Resolve(ctx, ref.String())
	if err != nil {
		return nil
	}
	switch kind := d.Annotations[layer.AnnotationKind]; {
	case kind != string(layer.KindVMImage):
		return fmt.Errorf("%s names a %s, not a VM image: give the VM image another name: %w", ref, kindName(kind), errdefs.ErrAlreadyExists)
	case !force:
		return fmt.Errorf("VM image %s exists: pass --force to replace it, or give another version: %w", ref, errdefs.ErrAlreadyExists)
	}
	return nil
}

func kindName(kind string) string {
	if kind == string(layer.KindImage) {
		return "container image"
	}
	return kind + " layer"
}

// Lookup finds the VM image named ref (NAME[:VERSION]).
func Lookup(ctx context.Context, s *store.Store, ref string) (*Image, error) {
	r, err := layer.ParseRef(ref)
	if err != nil {
		return nil, err
	}
	d, err := s.Resolve(ctx, r.String())
	if err != nil || d.Annotations[layer.AnnotationKind] != string(layer.KindVMImage) {
		return nil, fmt.Errorf("no VM image %s in the store (dsec vm image ls lists them; dsec vm image build makes one): %w", r, errdefs.ErrNotFound)
	}
	return load(s, d)
}

func load(s *store.Store, d ocispec.Descriptor) (*Image, error) {
	tag := d.Annotations[store.RefAnnotation]
	mb, err := s.ReadBlob(d.Digest, maxJSON)
	if err != nil {
		return nil, fmt.Errorf("VM image %s: %w", tag, err)
	}
	var man ocispec.Manifest
	if err := json.Unmarshal(mb, &man); err != nil || man.ArtifactType != ArtifactType || man.Config.MediaType != MediaTypeRecord ||
		len(man.Layers) == 0 || len(man.Layers) > 2*MaxChain+1 {
		return nil, fmt.Errorf("VM image %s: its manifest %s is no VM image's: %w", tag, d.Digest, errdefs.ErrDataLoss)
	}
	rb, err := s.ReadBlob(man.Config.Digest, maxJSON)
	if err != nil {
		return nil, fmt.Errorf("VM image %s: %w", tag, err)
	}
	img := split(&Image{Tag: tag, ID: d.Digest, Chain: man.Layers})
	img.Path = s.BlobPath(img.Blob.Digest)
	if err := json.Unmarshal(rb, &img.Record); err != nil {
		return nil, fmt.Errorf("VM image %s: its record does not parse: %w", tag, errdefs.ErrDataLoss)
	}
	if (img.State == nil) != (img.Memory == nil) {
		return nil, fmt.Errorf("VM image %s: its saved guest's state and record do not match: %w", tag, errdefs.ErrDataLoss)
	}
	return img, nil
}

// List returns the store's VM images in tag order.
func List(ctx context.Context, s *store.Store) ([]*Image, error) {
	return layer.LoadTagged(ctx, s, layer.KindVMImage, load)
}

// Remove untags the VM image ref; dsec layer gc frees its disk once no
// tag holds it.
func Remove(ctx context.Context, s *store.Store, ref string) (*Image, error) {
	img, err := Lookup(ctx, s, ref)
	if err != nil {
		return nil, err
	}
	if _, err := s.Untag(ctx, img.Tag); err != nil {
		return nil, err
	}
	return img, nil
}

// Copy copies the VM image ref from src to dst (a remote and the local
// store, either way): its record and its disk's chain, blobs dst holds
// already skipped (a snapshot's base, say), then its tag; a local tag
// that names a layer is not taken.
func Copy(ctx context.Context, src, dst remote.Target, ref layer.Ref, force bool, p remote.Progress) (*remote.Result, error) {
	if d, ok := dst.(*remote.Dir); ok {
		if s := d.Store(); s != nil {
			if d, err := s.Resolve(ctx, ref.String()); err == nil && d.Annotations[layer.AnnotationKind] != string(layer.KindVMImage) {
				return nil, fmt.Errorf("%s names a %s, not a VM image: give the VM image another name: %w", ref, kindName(d.Annotations[layer.AnnotationKind]), errdefs.ErrAlreadyExists)
			}
		}
	}
	return remote.CopyArtifact(ctx, src, dst, ref, artifact, force, p)
}

// CopyLazily copies the VM image ref from src, a remote, into the
// local store dst as Copy does, but for the disks whose window tables
// it holds: those are left in src, read lazily from there as the guest
// reads them (ServeDisk), and the record, the tables and a saved
// guest's state are copied.
func CopyLazily(ctx context.Context, src remote.Target, dst *remote.Dir, ref layer.Ref, p remote.Progress) (*remote.Result, error) {
	a := artifact
	a.Leave = func(man ocispec.Manifest, l ocispec.Descriptor) bool {
		_, ok := windowsOf(split(&Image{Chain: man.Layers}).Tables, l)
		return l.MediaType == MediaTypeDisk && ok
	}
	return remote.CopyArtifact(ctx, src, dst, ref, a, false, p)
}

var artifact = remote.Artifact{Type: ArtifactType, Annotations: map[string]string{layer.AnnotationKind: string(layer.KindVMImage)},
	Check: checkManifest, Verify: verifyDisks, Top: func(man ocispec.Manifest) digest.Digest {
		img := split(&Image{Chain: man.Layers}) // (the disk's top, or a saved guest's state)
		if img.State != nil {
			return img.State.Digest
		}
		return img.Blob.Digest
	}}

// Remote is a VM image as a remote holds it.
type Remote struct {
	Record
	Manifest digest.Digest
	Bytes    int64  // its disk's chain, saved guest and window tables
	Image    *Image // its chain, saved guest and tables (no Path: none here)
}

// Describe reads the record of the VM image ref in t (a remote),
// checked as a pull checks it, without its disk.
func Describe(ctx context.Context, t remote.Target, ref layer.Ref) (*Remote, error) {
	mdesc, man, config, err := remote.DescribeArtifact(ctx, t, ref, artifact)
	if err != nil {
		return nil, err
	}
	out := &Remote{Manifest: mdesc.Digest}
	if err := json.Unmarshal(config, &out.Record); err != nil { // (checkManifest parsed it)
		return nil, err
	}
	img := split(&Image{Tag: ref.String(), ID: mdesc.Digest, Chain: man.Layers, Record: out.Record})
	out.Image = img
	for _, l := range man.Layers {
		out.Bytes += l.Size
	}
	return out, nil
}

// checkManifest refuses a VM image's manifest that is not one: its
// config a Record, its layers 1 to MaxChain disks.
func checkManifest(man ocispec.Manifest, config []byte) error {
	var rec Record
	switch {
	case man.Config.MediaType != MediaTypeRecord || man.Config.Size > maxJSON || json.Unmarshal(config, &rec) != nil:
		return fmt.Errorf("its record is no VM image's: %w", errdefs.ErrInvalidArgument)
	}
	img := split(&Image{Chain: man.Layers})
	disks := img.Chain
	if err := checkTables(disks, img.Tables); err != nil {
		return err
	}
	if img.State != nil {
		if rec.Memory == nil {
			return fmt.Errorf("it holds a saved guest its record does not describe: %w", errdefs.ErrInvalidArgument)
		}
		if rec.Sandbox == "" { // (its disk a chain of one image when a flatten made it)
			return fmt.Errorf("it holds a saved guest but is no snapshot of a sandbox: %w", errdefs.ErrInvalidArgument)
		}
		if err := rec.Memory.check(); err != nil {
			return err
		}
	} else if rec.Memory != nil {
		return fmt.Errorf("its record describes a saved guest it does not hold: %w", errdefs.ErrInvalidArgument)
	}
	if len(disks) == 0 || len(disks) > MaxChain {
		return fmt.Errorf("its disk is a chain of %d images, not 1 to %d: %w", len(disks), MaxChain, errdefs.ErrInvalidArgument)
	}
	for _, l := range disks {
		if l.MediaType != MediaTypeDisk {
			return fmt.Errorf("its disk has a %s, not a %s: %w", l.MediaType, MediaTypeDisk, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// verifyDisks refuses disks copied into a local store that QEMU would
// read more than themselves from (a backing or data file: a host's
// file), or cannot read: what an import refuses.
func verifyDisks(ctx context.Context, dst remote.Target, man ocispec.Manifest) error {
	d, ok := dst.(*remote.Dir)
	if !ok || d.Store() == nil {
		return nil
	}
	for _, l := range man.Layers {
		if l.MediaType != MediaTypeDisk { // (QEMU reads a state as a migration stream, checked as it loads)
			continue
		}
		p := d.Store().BlobPath(l.Digest)
		if _, err := os.Stat(p); err != nil {
			continue // (read lazily: checked where it is served, ServeDisk)
		}
		if _, err := probe(ctx, p, "qcow2"); err != nil {
			return fmt.Errorf("its disk %s: %w", l.Digest, err)
		}
	}
	return nil
}

// check refuses a saved guest's record that no branch could run: what
// a pulled image says is untrusted.
func (m *Memory) check() error {
	switch mc := m.Machine; {
	case m.Nonce == "" || len(m.Nonce) > 128:
		return fmt.Errorf("its saved guest has no nonce for its agent: %w", errdefs.ErrInvalidArgument)
	case mc.MemoryBytes < 256<<20 || mc.MemoryBytes > 1<<40 || mc.MemoryBytes%(1<<20) != 0 || mc.CPUs < 1 || mc.CPUs > 1024:
		return fmt.Errorf("its saved guest's machine (%d bytes of RAM, %d vCPUs) is no VM's: %w", mc.MemoryBytes, mc.CPUs, errdefs.ErrInvalidArgument)
	}
	if len(m.Machine.CPU) > layer.MaxCPU {
		return fmt.Errorf("its saved guest's processor is described in %d bytes: %w", len(m.Machine.CPU), errdefs.ErrInvalidArgument)
	}
	return layer.CheckMAC(m.Machine.MAC)
}
