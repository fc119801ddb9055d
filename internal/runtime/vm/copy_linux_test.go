package vm

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// TestCopy: a VM image and a snapshot over it go to a registry and a
// dir: remote and come back into a fresh store whole (record, chain,
// tag as a VM image); to a dir: remote the snapshot's push skips the
// base the image's push sent; pushing again copies nothing; a tag that
// names other content is not moved without force, a layer is no VM
// image to copy, a local layer's tag is not taken by a pull, and a
// remote's image whose disk would read a host's file, or that has no
// disk, is refused before it is tagged.
func TestCopy(t *testing.T) {
	ctx := context.Background()
	s, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	img, err := Build(ctx, s, []string{fakeTree(t, "6.1.0-9-amd64")}, must(layer.ParseRef("cp:1")), BuildOptions{DiskOptions: DiskOptions{Size: 400 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	diffFile := filepath.Join(t.TempDir(), "diff.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", diffFile, "400M").CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	b, _ := os.ReadFile(diffFile)
	diff, err := s.WriteBlob(MediaTypeDisk, b)
	if err != nil {
		t.Fatal(err)
	}
	rec := img.Record
	rec.Sandbox, rec.Parent = "sb", "cp:1"
	// A memory snapshot: a saved guest's state after its disk.
	state, err := s.WriteBlob(MediaTypeState, []byte("QEVM saved guest"))
	if err != nil {
		t.Fatal(err)
	}
	memRec := rec
	memRec.Memory = &Memory{Machine: layer.Machine{MemoryBytes: 512 << 20, CPUs: 1, Accel: "tcg"}, Nonce: "abc"}
	snapImg, err := Snapshot(ctx, s, must(layer.ParseRef("cp-snap:1")), []ocispec.Descriptor{img.Blob, diff}, &state, img.Tables, memRec)
	if err != nil {
		t.Fatal(err)
	}
	if snapImg.State == nil || snapImg.State.Digest != state.Digest || len(snapImg.Chain) != 2 || snapImg.Blob.Digest != diff.Digest {
		t.Fatalf("a memory snapshot: %+v, want its chain of 2 and its state", snapImg)
	}
	if _, err := Snapshot(ctx, s, must(layer.ParseRef("cp-snap:0")), []ocispec.Descriptor{img.Blob, diff}, &state, nil, rec); !errdefs.IsInvalidArgument(err) {
		t.Errorf("a state without its record: %v", err)
	}
	addr, _ := layertest.StartRegistry(t)
	for _, url := range []string{"oci://" + addr + "/dsec", "dir://" + t.TempDir()} {
		t.Run(url[:3], func(t *testing.T) {
			rem, err := remote.Open(url, remote.Options{})
			if err != nil {
				t.Fatal(err)
			}
			local := remote.Local(s)
			r1, err := Copy(ctx, local, rem, must(layer.ParseRef("cp:1")), false, nil)
			if err != nil || len(r1.Copied) != 4 || r1.Digest != img.Blob.Digest { // the disk, its window table, the record, the manifest
				t.Fatalf("push cp:1: %+v %v", r1, err)
			}
			// (A registry keeps blobs per repository, and cp-snap is
			// another than cp: there the base goes again.)
			r2, err := Copy(ctx, local, rem, must(layer.ParseRef("cp-snap:1")), false, nil)
			shared := strings.HasPrefix(url, "dir:")
			if err != nil || slices.Contains(r2.Skipped, img.Blob.Digest) != shared || !slices.Contains(r2.Copied, diff.Digest) || !slices.Contains(r2.Copied, state.Digest) {
				t.Fatalf("push cp-snap:1: %+v %v, want its diff copied, and its base skipped in a store of shared blobs (%v)", r2, err, shared)
			}
			if again, err := Copy(ctx, local, rem, must(layer.ParseRef("cp-snap:1")), false, nil); err != nil || len(again.Copied) != 0 {
				t.Fatalf("push again: %+v %v", again, err)
			}
			s2, err := store.Open(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			if _, err := Copy(ctx, rem, remote.Local(s2), must(layer.ParseRef("cp-snap:1")), false, nil); err != nil {
				t.Fatal(err)
			}
			got, err := Lookup(ctx, s2, "cp-snap:1")
			if err != nil || !slices.Equal(got.Digests(), snapImg.Digests()) || got.Sandbox != "sb" || got.Parent != "cp:1" || got.Disk != img.Disk ||
				got.State == nil || got.State.Digest != state.Digest || got.Memory == nil || got.Memory.Nonce != "abc" || !s2.Exists(state.Digest) {
				t.Fatalf("pulled %+v %v, want %+v", got, err, snapImg)
			}
			for _, f := range got.Files(s2) {
				if err := s2.VerifyBlob(digest.NewDigestFromEncoded(digest.SHA256, filepath.Base(f))); err != nil {
					t.Errorf("a pulled disk: %v", err)
				}
			}
			// A lazy pull leaves the disks in the remote, and takes the
			// record, their window tables and the saved guest.
			s4, err := store.Open(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			if _, err := CopyLazily(ctx, rem, remote.Local(s4), must(layer.ParseRef("cp-snap:1")), nil); err != nil {
				t.Fatal(err)
			}
			lz, err := Lookup(ctx, s4, "cp-snap:1")
			if err != nil || !lz.Lazy() || s4.Exists(img.Blob.Digest) || s4.Exists(diff.Digest) || !s4.Exists(state.Digest) {
				t.Fatalf("a lazy pull: %+v %v, want the tables and the state, and no disk", lz, err)
			}
			for _, d := range lz.Chain {
				w, _ := lz.Windows(d)
				if !s4.Exists(w.Digest) || w.Size != layer.WindowSize || w.Count != int((d.Size+w.Size-1)/w.Size) {
					t.Errorf("disk %s's window table %+v", d.Digest, w)
				}
				if lender, disk, _, ok := Lender(ctx, s4, d.Digest); !ok || lender.Tag != "cp-snap:1" || disk.Digest != d.Digest {
					t.Errorf("the lender of disk %s: %v %+v", d.Digest, lender, disk)
				}
			}
			// A tag of other content is not moved without force.
			other, err := Build(ctx, s2, []string{fakeTree(t, "6.1.0-9-amd64")}, must(layer.ParseRef("cp:1")), BuildOptions{DiskOptions: DiskOptions{Size: 400 << 20}})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := Copy(ctx, remote.Local(s2), rem, must(layer.ParseRef("cp:1")), false, nil); !errdefs.IsAlreadyExists(err) {
				t.Errorf("push over a tag of other content: %v", err)
			}
			if r, err := Copy(ctx, remote.Local(s2), rem, must(layer.ParseRef("cp:1")), true, nil); err != nil || r.Digest != other.Blob.Digest {
				t.Errorf("push --force: %+v %v", r, err)
			}
			// A layer is no VM image, and a pull takes no layer's tag.
			tree := t.TempDir()
			os.WriteFile(filepath.Join(tree, "f"), []byte("f"), 0o644)
			if _, err := layer.Build(ctx, s2, layer.BuildOptions{Source: tree, Kind: layer.KindBase, Ref: must(layer.ParseRef("bb:1"))}); err != nil {
				t.Fatal(err)
			}
			if _, err := Copy(ctx, remote.Local(s2), rem, must(layer.ParseRef("bb:1")), false, nil); !errdefs.IsInvalidArgument(err) {
				t.Errorf("push of a layer as a VM image: %v", err)
			}
			if _, err := Copy(ctx, rem, remote.Local(s2), must(layer.ParseRef("nosuch:1")), false, nil); !errdefs.IsNotFound(err) {
				t.Errorf("pull of a name the remote lacks: %v", err)
			}
			if _, err := Build(ctx, s, []string{fakeTree(t, "6.1.0-9-amd64")}, must(layer.ParseRef("bb:1")), BuildOptions{Force: true, DiskOptions: DiskOptions{Size: 400 << 20}}); err != nil {
				t.Fatal(err)
			}
			if _, err := Copy(ctx, local, rem, must(layer.ParseRef("bb:1")), true, nil); err != nil {
				t.Fatal(err)
			}
			if _, err := Copy(ctx, rem, remote.Local(s2), must(layer.ParseRef("bb:1")), true, nil); !errdefs.IsAlreadyExists(err) || !strings.Contains(err.Error(), "names a base layer, not a VM image") {
				t.Errorf("a pull over a layer's tag: %v", err)
			}
			// A remote's image is checked before it is tagged here: a
			// disk that names a backing file (a host's file, for QEMU
			// to read) and a manifest whose layers are no disks are not.
			s3, err := store.Open(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			bad := filepath.Join(t.TempDir(), "bad.qcow2")
			if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", "/etc/hostname", bad, "1M").CombinedOutput(); err != nil {
				t.Fatalf("%v: %s", err, out)
			}
			bb, _ := os.ReadFile(bad)
			badDisk, err := s3.WriteBlob(MediaTypeDisk, bb)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := Snapshot(ctx, s3, must(layer.ParseRef("evil:1")), []ocispec.Descriptor{badDisk}, nil, nil, rec); err != nil {
				t.Fatal(err)
			}
			if err := CheckDisk(ctx, s3.BlobPath(badDisk.Digest)); err == nil || !strings.Contains(err.Error(), "reads a backing file") {
				t.Errorf("a disk read lazily that names a backing file: %v", err)
			}
			// A saved guest's state its record does not describe, and
			// one whose machine no VM is.
			st3, _ := s3.WriteBlob(MediaTypeState, []byte("QEVM"))
			plant := func(name string, r Record, layers ...ocispec.Descriptor) {
				rb, _ := json.Marshal(r)
				cfg, _ := s3.WriteBlob(MediaTypeRecord, rb)
				mb, _ := json.Marshal(ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest,
					ArtifactType: ArtifactType, Config: cfg, Layers: layers})
				md, _ := s3.WriteBlob(ocispec.MediaTypeImageManifest, mb)
				md.Annotations = map[string]string{layer.AnnotationKind: string(layer.KindVMImage)}
				if err := s3.Tag(ctx, name, md, false); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := s3.WriteBlob(MediaTypeDisk, b); err != nil {
				t.Fatal(err)
			}
			if _, err := s3.WriteBlob(MediaTypeDisk, must(os.ReadFile(img.Path))); err != nil {
				t.Fatal(err)
			}
			plant("ghost:1", rec, img.Blob, diff, st3)
			plant("nostate:1", memRec, img.Blob, diff)
			huge := memRec
			huge.Memory = &Memory{Machine: layer.Machine{MemoryBytes: 1 << 50, CPUs: 1}, Nonce: "n"}
			plant("huge:1", huge, img.Blob, diff, st3)
			// A NIC's address is put on QEMU's command line: one that
			// adds an option (an option ROM of a host's file) is none.
			evilMAC := memRec
			evilMAC.Memory = &Memory{Machine: layer.Machine{MemoryBytes: 512 << 20, CPUs: 1, MAC: "02:00:00:00:00:01,romfile=/etc/shadow"}, Nonce: "n"}
			plant("mac:1", evilMAC, img.Blob, diff, st3)
			orphan := memRec
			orphan.Sandbox = ""
			plant("orphan:1", orphan, img.Blob, diff, st3)
			// Window tables of no disk of the chain, and of the wrong size.
			table := func(of ocispec.Descriptor, n int) ocispec.Descriptor {
				d, _ := s3.WriteBlob(MediaTypeWindows, make([]byte, n))
				d.Annotations = map[string]string{AnnotationWindowsOf: of.Digest.String(), AnnotationWindowSize: "65536"}
				return d
			}
			count := int((img.Blob.Size + layer.WindowSize - 1) / layer.WindowSize)
			plant("stray:1", rec, img.Blob, table(diff, 32))
			plant("short:1", rec, img.Blob, table(img.Blob, 32*count-32))
			plant("twice:1", rec, img.Blob, table(img.Blob, 32*count), table(img.Blob, 32*count))
			cfg, _ := s3.WriteBlob(MediaTypeRecord, []byte("{}"))
			notDisk, _ := s3.WriteBlob("application/octet-stream", []byte("x"))
			mb, _ := json.Marshal(ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest,
				ArtifactType: ArtifactType, Config: cfg, Layers: []ocispec.Descriptor{notDisk}})
			md, _ := s3.WriteBlob(ocispec.MediaTypeImageManifest, mb)
			md.Annotations = map[string]string{layer.AnnotationKind: string(layer.KindVMImage)}
			if err := s3.Tag(ctx, "odd:1", md, false); err != nil {
				t.Fatal(err)
			}
			for name, says := range map[string]string{"evil:1": "reads a backing file", "odd:1": "its disk has a application/octet-stream",
				"ghost:1": "holds a saved guest its record does not describe", "huge:1": "is no VM's",
				"nostate:1": "describes a saved guest it does not hold", "mac:1": "is not a hardware address",
				"orphan:1": "is no snapshot of a sandbox", "stray:1": "no disk of its chain", "short:1": "does not fit the disk",
				"twice:1": "(or a second)"} {
				// (Planted as another tool would push them: unchecked.)
				plain := remote.Artifact{Type: ArtifactType}
				if _, err := remote.CopyArtifact(ctx, remote.Local(s3), rem, must(layer.ParseRef(name)), plain, true, nil); err != nil {
					t.Fatal(err)
				}
				if _, err := Copy(ctx, rem, remote.Local(s2), must(layer.ParseRef(name)), true, nil); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), says) {
					t.Errorf("pull %s: %v, want it refused: %s", name, err, says)
				}
				if _, err := s2.Resolve(ctx, name); err == nil {
					t.Errorf("a refused pull tagged %s", name)
				}
			}
		})
	}
}
