package remote_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"golang.org/x/crypto/bcrypt"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
)

func newLocal(t *testing.T) *store.Store {
	s, err := store.Open(filepath.Join(t.TempDir(), "store"))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func buildLayer(t *testing.T, s *store.Store, tag string) *layer.Info {
	t.Helper()
	src := t.TempDir()
	for i := range 20 {
		os.WriteFile(filepath.Join(src, fmt.Sprint("f", i)), bytes.Repeat([]byte{byte(i)}, 100000*i), 0o644)
	}
	ref, _ := layer.ParseRef(tag)
	info, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: src, Kind: layer.KindToolkit, Ref: ref})
	if err != nil {
		t.Fatal(err)
	}
	return info
}

// roundTrip pushes a layer to target, pulls it into a fresh store and
// checks it arrives whole, and that a second push copies nothing.
func roundTrip(t *testing.T, target remote.Target) {
	ctx := context.Background()
	a, b := newLocal(t), newLocal(t)
	info := buildLayer(t, a, "tools/harness:1")
	ref, _ := layer.ParseRef("tools/harness:1")

	res, err := remote.Copy(ctx, remote.Local(a), target, ref, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Copied) != 4 || res.Bytes < info.Size {
		t.Fatalf("push copied %d blobs, %d bytes", len(res.Copied), res.Bytes)
	}
	again, err := remote.Copy(ctx, remote.Local(a), target, ref, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(again.Copied) != 0 || len(again.Skipped) != 4 {
		t.Fatalf("second push copied %d blobs, want none", len(again.Copied))
	}
	if _, err := remote.Copy(ctx, target, remote.Local(b), ref, false, nil); err != nil {
		t.Fatal(err)
	}
	got, err := layer.Resolve(ctx, b, "tools/harness:1")
	if err != nil {
		t.Fatal(err)
	}
	if got.Digest != info.Digest || got.Kind != info.Kind || got.Files != info.Files {
		t.Fatalf("pulled %+v, pushed %+v", got, info)
	}
	for _, d := range []string{string(got.Digest), string(got.Windows.Digest)} {
		if err := b.VerifyBlob(digestOf(d)); err != nil {
			t.Fatal(err)
		}
	}
	// Other content under the same tag needs force.
	other := buildLayerFrom(t, a, "tools/harness:1", "different")
	if _, err := remote.Copy(ctx, remote.Local(a), target, ref, false, nil); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("push over another layer's tag: %v", err)
	}
	if _, err := remote.Copy(ctx, remote.Local(a), target, ref, true, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := remote.Copy(ctx, target, remote.Local(b), ref, true, nil); err != nil {
		t.Fatal(err)
	}
	if got, _ := layer.Resolve(ctx, b, "tools/harness:1"); got.Digest != other.Digest {
		t.Fatalf("forced pull did not move the tag")
	}
	missing, _ := layer.ParseRef("tools/none:1")
	if _, err := remote.Copy(ctx, target, remote.Local(b), missing, false, nil); !errdefs.IsNotFound(err) {
		t.Fatalf("pull of a missing layer: %v", err)
	}
}

func buildLayerFrom(t *testing.T, s *store.Store, tag, content string) *layer.Info {
	src := t.TempDir()
	os.WriteFile(filepath.Join(src, "only"), []byte(content), 0o644)
	ref, _ := layer.ParseRef(tag)
	info, err := layer.Build(context.Background(), s, layer.BuildOptions{Source: src, Kind: layer.KindToolkit, Ref: ref, Force: true})
	if err != nil {
		t.Fatal(err)
	}
	return info
}

func TestDirRemote(t *testing.T) {
	target, err := remote.Open("dir://"+filepath.Join(t.TempDir(), "shared"), remote.Options{})
	if err != nil {
		t.Fatal(err)
	}
	roundTrip(t, target)
	resumeTrip(t, target)
}

// TestOCIRemote: a registry on this host is spoken to over plain HTTP
// without --insecure, as Docker does and image pulls do.
func TestOCIRemote(t *testing.T) {
	addr, _ := layertest.StartRegistry(t)
	target, err := remote.Open("oci://"+addr+"/dsec", remote.Options{})
	if err != nil {
		t.Fatal(err)
	}
	roundTrip(t, target)
	resumeTrip(t, target)
}

// cancelAfter cancels a copy once it has moved n bytes.
type cancelAfter struct {
	n, seen int64
	cancel  func()
}

func (c *cancelAfter) Add(n int64) {
	if c.seen += n; c.seen >= c.n {
		c.cancel()
	}
}

// resumeTrip interrupts a pull from target mid-blob: the next pull
// fetches only the rest (a Range request to a registry), and the blob
// arrives whole. Garbage in the kept part fails the pull with data loss
// and is dropped, so the pull after that starts over and succeeds.
func resumeTrip(t *testing.T, target remote.Target) {
	ctx := context.Background()
	a := newLocal(t)
	info := buildLayer(t, a, "tools/resume:1")
	ref, _ := layer.ParseRef("tools/resume:1")
	if _, err := remote.Copy(ctx, remote.Local(a), target, ref, false, nil); err != nil {
		t.Fatal(err)
	}
	pull := func(b *store.Store, stopAt int64) (*remote.Result, error) {
		cctx, cancel := context.WithCancel(ctx)
		defer cancel()
		var p remote.Progress
		if stopAt > 0 {
			p = &cancelAfter{n: stopAt, cancel: cancel}
		}
		return remote.Copy(cctx, target, remote.Local(b), ref, false, p)
	}
	partial := func(b *store.Store) string {
		m, _ := filepath.Glob(filepath.Join(b.Dir(), "ingest", "partial-*"))
		if len(m) != 1 {
			t.Fatalf("ingest holds %v, want one partial blob", m)
		}
		return m[0]
	}

	b := newLocal(t)
	if _, err := pull(b, 4<<20); err == nil {
		t.Fatal("a pull cancelled mid-blob succeeded")
	}
	kept, _ := os.Stat(partial(b))
	if kept.Size() == 0 || kept.Size() >= info.Size {
		t.Fatalf("the interrupted pull kept %d of %d bytes", kept.Size(), info.Size)
	}
	res, err := pull(b, 0)
	if err != nil {
		t.Fatal(err)
	}
	if res.Resumed != kept.Size() || res.Bytes+res.Resumed < info.Size || res.Bytes >= info.Size {
		t.Fatalf("resumed %d bytes and copied %d of a %d-byte image; %d were kept", res.Resumed, res.Bytes, info.Size, kept.Size())
	}
	if err := b.VerifyBlob(info.Digest); err != nil {
		t.Fatal(err)
	}

	c := newLocal(t)
	if _, err := pull(c, 4<<20); err == nil {
		t.Fatal("a pull cancelled mid-blob succeeded")
	}
	p := partial(c)
	if err := os.WriteFile(p, bytes.Repeat([]byte{0xee}, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := pull(c, 0); !errdefs.IsDataLoss(err) {
		t.Fatalf("resuming on garbage: %v, want a data loss error", err)
	}
	if _, err := os.Stat(p); !os.IsNotExist(err) {
		t.Fatalf("the garbage was kept: %v", err)
	}
	if _, err := pull(c, 0); err != nil {
		t.Fatal(err)
	}
	if err := c.VerifyBlob(info.Digest); err != nil {
		t.Fatal(err)
	}
}

func TestOCIRemoteCorruptBlob(t *testing.T) {
	ctx := context.Background()
	addr, data := layertest.StartRegistry(t)
	target, _ := remote.Open("oci://"+addr+"/dsec", remote.Options{Insecure: true})
	a, b := newLocal(t), newLocal(t)
	info := buildLayer(t, a, "x:1")
	ref, _ := layer.ParseRef("x:1")
	if _, err := remote.Copy(ctx, remote.Local(a), target, ref, false, nil); err != nil {
		t.Fatal(err)
	}
	blob := filepath.Join(data, "docker/registry/v2/blobs/sha256", info.Digest.Encoded()[:2], info.Digest.Encoded(), "data")
	raw, err := os.ReadFile(blob)
	if err != nil {
		t.Fatal(err)
	}
	raw[len(raw)/2] ^= 0xff
	os.Chmod(blob, 0o644)
	if err := os.WriteFile(blob, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = remote.Copy(ctx, target, remote.Local(b), ref, false, nil)
	if err == nil {
		t.Fatal("pulled a corrupt blob")
	}
	if b.Exists(info.Digest) {
		t.Fatal("corrupt blob is in the local store")
	}
	if _, err := b.Resolve(ctx, "x:1"); !errdefs.IsNotFound(err) {
		t.Fatalf("tag after failed pull: %v", err)
	}
}

func TestBadRemotes(t *testing.T) {
	for _, u := range []string{"nope", "ftp://x/y", "dir://host/path", "dir:relative", "oci://", "oci://host"} {
		if _, err := remote.Open(u, remote.Options{}); !errdefs.IsInvalidArgument(err) {
			t.Errorf("Open(%q) = %v", u, err)
		}
	}
	if _, err := remote.Open("oci://registry.example.com/x", remote.Options{Insecure: true}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("insecure to a non-loopback host: %v", err)
	}
	// A registry that is not there: a clear error, quickly.
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := l.Addr().String()
	l.Close()
	target, _ := remote.Open("oci://"+addr+"/dsec", remote.Options{Insecure: true})
	ref, _ := layer.ParseRef("x:1")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := remote.Copy(ctx, target, remote.Local(newLocal(t)), ref, false, nil)
	if err == nil || !bytes.Contains([]byte(err.Error()), []byte("connection refused")) {
		t.Fatalf("unreachable registry: %v", err)
	}
}

func digestOf(s string) digest.Digest { return digest.Digest(s) }

func TestOCIRemoteAuth(t *testing.T) {
	hash, err := bcrypt.GenerateFromPassword([]byte("s3cret"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	htpasswd := filepath.Join(t.TempDir(), "htpasswd")
	os.WriteFile(htpasswd, []byte("agent:"+string(hash)+"\n"), 0o644)
	addr, _ := layertest.StartRegistryWith(t, fmt.Sprintf("auth:\n  htpasswd:\n    realm: dsec-test\n    path: %s\n", htpasswd))
	ctx := context.Background()
	a := newLocal(t)
	buildLayer(t, a, "x:1")
	ref, _ := layer.ParseRef("x:1")
	t.Setenv("DOCKER_CONFIG", t.TempDir()) // no stored credentials
	anon, _ := remote.Open("oci://"+addr+"/dsec", remote.Options{Insecure: true})
	if _, err := remote.Copy(ctx, remote.Local(a), anon, ref, false, nil); !errdefs.IsPermissionDenied(err) {
		t.Fatalf("push without credentials: %v", err)
	}
	wrong, _ := remote.Open("oci://"+addr+"/dsec", remote.Options{Insecure: true, Username: "agent", Password: "nope"})
	if _, err := remote.Copy(ctx, remote.Local(a), wrong, ref, false, nil); !errdefs.IsPermissionDenied(err) {
		t.Fatalf("push with a wrong password: %v", err)
	}
	good, _ := remote.Open("oci://"+addr+"/dsec", remote.Options{Insecure: true, Username: "agent", Password: "s3cret"})
	if _, err := remote.Copy(ctx, remote.Local(a), good, ref, false, nil); err != nil {
		t.Fatalf("push with credentials: %v", err)
	}
}

// TestSnapshotCarriesLineage: pushing a snapshot pushes the layers it
// stands on, bottom first; pulling brings them; a remote tag of a lower
// naming other content is an error that leaves the snapshot's tag
// where it was; a lower whose tag moved at the source still travels.
func TestSnapshotCarriesLineage(t *testing.T) {
	ctx := context.Background()
	addr, _ := layertest.StartRegistry(t)
	target, err := remote.Open("oci://"+addr+"/dsec", remote.Options{Insecure: true})
	if err != nil {
		t.Fatal(err)
	}
	a, b := newLocal(t), newLocal(t)
	nope, _ := layer.ParseRef("nope:1")
	if _, err := remote.Copy(ctx, target, remote.Local(b), nope, false, nil); !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), "layer nope:1 not found in oci://") {
		t.Fatalf("pull of a tag the registry lacks: %v", err)
	}
	base := buildLayer(t, a, "base:1")
	src := t.TempDir()
	os.WriteFile(filepath.Join(src, "step"), []byte("1"), 0o644)
	snapRef, _ := layer.ParseRef("run/r:1")
	snap, err := layer.Build(ctx, a, layer.BuildOptions{Source: src, Kind: layer.KindSnapshot, Ref: snapRef,
		Snapshot: &layer.Lineage{Lowers: []layer.Lower{{Ref: "base:1", Digest: base.Digest}}, Sandbox: "sb"}})
	if err != nil {
		t.Fatal(err)
	}
	res, err := remote.Copy(ctx, remote.Local(a), target, snapRef, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Lowers) != 1 || res.Lowers[0].Ref != "base:1" || len(res.Lowers[0].Copied) != 4 {
		t.Fatalf("push of a snapshot: lowers %+v", res.Lowers)
	}
	if c, s, _ := res.Totals(); c != 8 || s != 0 {
		t.Fatalf("totals %d copied, %d skipped", c, s)
	}
	if _, err := remote.Copy(ctx, target, remote.Local(b), snapRef, false, nil); err != nil {
		t.Fatal(err)
	}
	for ref, want := range map[string]digest.Digest{"base:1": base.Digest, "run/r:1": snap.Digest} {
		if got, err := layer.Resolve(ctx, b, ref); err != nil || got.Digest != want {
			t.Fatalf("pulled %s: %v %v", ref, got, err)
		}
	}

	// The source's base:1 moves, and gc runs: the snapshot still stands
	// on the old base, which the store keeps for it (untagged), and a
	// push carries it under the tag the snapshot knows (issue 29, item 2).
	buildLayerFrom(t, a, "base:1", "moved")
	if _, err := layer.GC(ctx, a, nil); err != nil {
		t.Fatal(err)
	}
	other, err := remote.Open("dir://"+filepath.Join(t.TempDir(), "other"), remote.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := remote.Copy(ctx, remote.Local(a), other, snapRef, false, nil); err != nil {
		t.Fatalf("push of a snapshot whose lower moved: %v", err)
	}
	if l, err := remote.Describe(ctx, other, baseRef(t)); err != nil || l.Blob.Digest != base.Digest {
		t.Fatalf("the pushed lower: %+v %v, want %s", l, err, base.Digest)
	}
	// Pulled into a store whose base:1 names other content: the lower
	// comes untagged, the store's tag stays, and the snapshot finds its
	// lower by digest.
	c := newLocal(t)
	moved := buildLayerFrom(t, c, "base:1", "local")
	if _, err := remote.Copy(ctx, other, remote.Local(c), snapRef, false, nil); err != nil {
		t.Fatalf("pull of a snapshot over a local tag of other content: %v", err)
	}
	if got, err := layer.Resolve(ctx, c, "base:1"); err != nil || got.Digest != moved.Digest {
		t.Fatalf("the pull moved the local base:1: %v %v", got, err)
	}
	if got, err := layer.ResolveImage(ctx, c, "base:1", base.Digest); err != nil || got.Digest != base.Digest {
		t.Fatalf("the snapshot's lower by digest: %v %v", got, err)
	}
	if _, err := layer.GC(ctx, c, nil); err != nil {
		t.Fatal(err)
	}
	if got, err := layer.ResolveImage(ctx, c, "base:1", base.Digest); err != nil || got.Digest != base.Digest {
		t.Fatalf("gc freed the snapshot's untagged lower: %v %v", got, err)
	}
	// The remote's base:1 names other content: never forced, even with --force.
	if _, err := remote.Copy(ctx, remote.Local(a), target, baseRef(t), true, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := remote.Copy(ctx, remote.Local(b), target, snapRef, true, nil); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("push of a snapshot over a moved remote lower: %v", err)
	}
}

func baseRef(t *testing.T) layer.Ref {
	r, err := layer.ParseRef("base:1")
	if err != nil {
		t.Fatal(err)
	}
	return r
}
