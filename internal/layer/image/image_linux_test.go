package image_test

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/crypto/bcrypt"
	"golang.org/x/sys/unix"
	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/content/oci"
	orasremote "oras.land/oras-go/v2/registry/remote"
	"oras.land/oras-go/v2/registry/remote/auth"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/image"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/mount"
)

// layout is layertest's, failing the test on an error.
type layout struct {
	t *testing.T
	*layertest.Layout
}

func newLayout(t *testing.T) *layout {
	t.Helper()
	l, err := layertest.NewLayout(filepath.Join(t.TempDir(), "layout"))
	if err != nil {
		t.Fatal(err)
	}
	return &layout{t, l}
}

func (l *layout) umoci(args ...string) {
	l.t.Helper()
	if err := l.Umoci(args...); err != nil {
		l.t.Fatal(err)
	}
}

func (l *layout) layer(from, tag string, change func(root string)) {
	l.t.Helper()
	if err := l.Layer(from, tag, func(root string) error { change(root); return nil }); err != nil {
		l.t.Fatal(err)
	}
}

func (l *layout) unpack(tag string) string {
	l.t.Helper()
	bundle := filepath.Join(l.t.TempDir(), "bundle")
	if err := l.Unpack(tag, bundle); err != nil {
		l.t.Fatal(err)
	}
	return filepath.Join(bundle, "rootfs")
}

func (l *layout) push(addr, repo, tag string) {
	l.t.Helper()
	if err := l.Push(addr, repo, tag); err != nil {
		l.t.Fatal(err)
	}
}

func remoteRepo(t *testing.T, addr, repo string) *orasremote.Repository {
	r, err := orasremote.NewRepository(addr + "/" + repo)
	if err != nil {
		t.Fatal(err)
	}
	r.PlainHTTP = true
	return r
}

func write(t *testing.T, path, body string) {
	t.Helper()
	os.MkdirAll(filepath.Dir(path), 0o755)
	if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
}

func randomFile(t *testing.T, path string, n int) {
	t.Helper()
	b := make([]byte, n)
	rand.Read(b)
	write(t, path, string(b))
}

// mountImage stacks img's layers read-only as a sandbox's root does and
// returns where.
func mountImage(t *testing.T, s *store.Store, img *image.Image) string {
	t.Helper()
	var lowers []string
	for _, ref := range img.Refs() {
		i, err := layer.Resolve(context.Background(), s, ref)
		if err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		if err := mount.EROFS(s.BlobPath(i.Digest)).Mount(dir); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { mount.Unmount(dir) })
		lowers = append(lowers, dir)
	}
	if len(lowers) == 1 {
		return lowers[0]
	}
	merged := t.TempDir()
	if err := mount.Overlay(lowers, "", "").Mount(merged); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mount.Unmount(merged) })
	return merged
}

func openStore(t *testing.T) *store.Store {
	s, err := store.Open(filepath.Join(t.TempDir(), "store"))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// sameAs holds img, as s mounts it, to the layout's tag unpacked by
// umoci, file by file (the root's own attributes aside).
func (l *layout) sameAs(t *testing.T, tag string, s *store.Store, img *image.Image, what string) {
	t.Helper()
	want := layertest.ScanDir(t, l.unpack(tag))
	got := layertest.ScanDir(t, mountImage(t, s, img))
	delete(want, "")
	delete(got, "")
	if d := layertest.Diff(want, got); len(d) > 0 {
		t.Errorf("%s: %s", what, strings.Join(d, "\n"))
	}
}

func mustRef(t *testing.T, s string) image.Reference {
	t.Helper()
	r, err := image.ParseReference(s)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestImportMatchesUnpack imports multi-layer images from a real
// registry and compares the stacked layers file by file with the same
// image unpacked by umoci: whiteouts, an opaque directory, hard links
// (one broken across layers), xattrs, symlinks, a fifo, and the config.
// A second image on the same base fetches only its own layer.
func TestImportMatchesUnpack(t *testing.T) {
	layertest.RequireRoot(t)
	ctx := context.Background()
	addr, _ := layertest.StartRegistry(t)
	l := newLayout(t)
	l.layer("", "base", func(root string) {
		write(t, root+"/etc/os-release", "ID=test\n")
		write(t, root+"/etc/keep", "kept\n")
		randomFile(t, root+"/usr/lib/python3/wheel.whl", 3<<20+17)
		write(t, root+"/usr/share/doc/notes.txt", strings.Repeat("compressible text, line after line\n", 10000))
		write(t, root+"/usr/bin/a", "linked\n")
		if err := os.Link(root+"/usr/bin/a", root+"/usr/bin/b"); err != nil {
			t.Fatal(err)
		}
		write(t, root+"/opt/app/old", "old\n")
		write(t, root+"/opt/app/sub/deep", "deep\n")
		os.Symlink("../lib/python3/wheel.whl", root+"/usr/bin/wheel")
		unix.Mkfifo(root+"/run-fifo", 0o600)
		if err := unix.Setxattr(root+"/etc/keep", "user.dsec", []byte("kept"), 0); err != nil {
			t.Fatal(err)
		}
		os.Chown(root+"/etc/keep", 1000, 1000)
		os.Chmod(root+"/opt/app/old", 0o4755)
	})
	l.layer("base", "app", func(root string) {
		os.Remove(root + "/etc/os-release") // a whiteout
		os.Remove(root + "/usr/bin/a")      // the link breaks: b keeps the old inode
		write(t, root+"/usr/bin/a", "new a\n")
		write(t, root+"/srv/data", "data\n")
	})
	// An opaque directory: everything /opt/app held below goes.
	opaque := t.TempDir()
	write(t, opaque+"/fresh", "fresh\n")
	l.umoci("insert", "--opaque", "--image", l.Dir+":app", opaque, "/opt/app")
	l.umoci("config", "--image", l.Dir+":app", "--config.env", "APP=1", "--config.workingdir", "/srv",
		"--config.user", "1000:1000", "--config.entrypoint", "/bin/sh", "--config.cmd", "-c", "--config.cmd", "true")
	l.layer("base", "other", func(root string) { write(t, root+"/other", "other\n") })
	l.push(addr, "test/env", "app")
	l.push(addr, "test/env", "other")

	s := openStore(t)
	var progress []int64
	img, err := image.Import(ctx, s, mustRef(t, addr+"/test/env:app"), image.Options{
		Progress: func(total int64) layer.Progress { progress = append(progress, total); return nil },
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(img.Layers) != 3 || img.Fetched != 3 || img.Reused != 0 {
		t.Fatalf("first import: %d layers, %d fetched, %d reused; want 3, 3, 0", len(img.Layers), img.Fetched, img.Reused)
	}
	if c := img.Config; strings.Join(c.Env, " ") == "" || !strings.Contains(strings.Join(c.Env, " "), "APP=1") ||
		c.WorkingDir != "/srv" || c.User != "1000:1000" || strings.Join(c.Entrypoint, " ") != "/bin/sh" || strings.Join(c.Cmd, " ") != "-c true" {
		t.Errorf("config: %+v", c)
	}
	got := layertest.ScanDir(t, mountImage(t, s, img))
	want := layertest.ScanDir(t, l.unpack("app"))
	delete(got, "")
	delete(want, "")
	if d := layertest.Diff(want, got); len(d) > 0 {
		t.Errorf("the imported image differs from umoci's unpack:\n%s", strings.Join(d, "\n"))
	}
	if got["usr/bin/b"].Link != "" || got["usr/bin/a"].Sum == got["usr/bin/b"].Sum {
		t.Errorf("a link broken across layers: a %+v, b %+v", got["usr/bin/a"], got["usr/bin/b"])
	}

	// The record is in the store, by its reference; layers by diff ID.
	again, err := image.Lookup(ctx, s, mustRef(t, addr+"/test/env:app"))
	if err != nil || again.ID != img.ID || strings.Join(again.Refs(), ",") != strings.Join(img.Refs(), ",") {
		t.Fatalf("lookup: %+v %v", again, err)
	}
	if _, err := layer.Resolve(ctx, s, img.Tag); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "is an image") {
		t.Errorf("an image named as a layer: %v", err)
	}

	// Another image on the same base: its base layer is not fetched.
	other, err := image.Import(ctx, s, mustRef(t, addr+"/test/env:other"), image.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if other.Fetched != 1 || other.Reused != 1 || other.Layers[0].Digest != img.Layers[0].Digest {
		t.Errorf("second image: %d fetched, %d reused, base %s vs %s", other.Fetched, other.Reused, other.Layers[0].Digest, img.Layers[0].Digest)
	}
	// Pulled again, nothing is fetched.
	if again, err := image.Import(ctx, s, mustRef(t, addr+"/test/env:app"), image.Options{}); err != nil || again.Fetched != 0 || again.ID != img.ID {
		t.Errorf("a pull of what the store holds: %+v %v", again, err)
	}
	// Converting is deterministic: another store gets the same layers.
	s2 := openStore(t)
	img2, err := image.Import(ctx, s2, mustRef(t, addr+"/test/env:app"), image.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range img.Layers {
		if img.Layers[i].Digest != img2.Layers[i].Digest {
			t.Errorf("layer %d: %s in one store, %s in another", i, img.Layers[i].Digest, img2.Layers[i].Digest)
		}
	}
	if img2.ID != img.ID {
		t.Errorf("the record: %s in one store, %s in another", img.ID, img2.ID)
	}

	// Compressed: the same tree, as the kernel reads it, in fewer bytes;
	// the layer above reads the compressed base's directories to convert.
	zs := openStore(t)
	zimg, err := image.Import(ctx, zs, mustRef(t, addr+"/test/env:app"), image.Options{Compress: true})
	if err != nil {
		t.Fatal(err)
	}
	l.sameAs(t, "app", zs, zimg, "the compressed import differs from umoci's unpack")
	size := func(s *store.Store, l image.Layer) int64 {
		info, err := layer.Resolve(ctx, s, l.Ref)
		if err != nil {
			t.Fatal(err)
		}
		return info.Size
	}
	if z, plain := size(zs, zimg.Layers[0]), size(s2, img2.Layers[0]); z > plain-(200<<10) {
		t.Errorf("the compressed base is %d bytes, uncompressed %d: want its text compressed", z, plain)
	}
	// Tagged as a conversion of their own (hosts that share a remote and
	// convert differently do not claim one tag), and taken as they are by
	// a pull that does not compress: nothing converted twice.
	if !strings.HasSuffix(zimg.Layers[0].Ref, ":erofs1-lz4") || strings.HasSuffix(img2.Layers[0].Ref, "-lz4") {
		t.Errorf("layer tags: %s compressed, %s not", zimg.Layers[0].Ref, img2.Layers[0].Ref)
	}
	if again, err := image.Import(ctx, zs, mustRef(t, addr+"/test/env:other"), image.Options{}); err != nil || again.Fetched != 1 || again.Layers[0].Ref != zimg.Layers[0].Ref {
		t.Errorf("an uncompressed pull over the compressed base: %+v %v, want its own layer fetched alone", again, err)
	}

	// Removing an image untags the layers only it had; gc keeps the
	// shared base for the other image.
	if _, err := image.Remove(ctx, s, mustRef(t, addr+"/test/env:app")); err != nil {
		t.Fatal(err)
	}
	if _, err := layer.GC(ctx, s, nil); err != nil {
		t.Fatal(err)
	}
	if !s.Exists(other.Layers[0].Digest) || !s.Exists(other.Layers[1].Digest) || s.Exists(img.Layers[2].Digest) {
		t.Errorf("after rm and gc: base %v, other's %v, app's own %v (want true, true, false)",
			s.Exists(other.Layers[0].Digest), s.Exists(other.Layers[1].Digest), s.Exists(img.Layers[2].Digest))
	}
	if _, err := image.Lookup(ctx, s, mustRef(t, addr+"/test/env:app")); !errdefs.IsNotFound(err) {
		t.Errorf("a removed image: %v", err)
	}
}

// TestImportConcurrent: creates that race to import one image pull it
// once.
func TestImportConcurrent(t *testing.T) {
	layertest.RequireRoot(t)
	addr, _ := layertest.StartRegistry(t)
	l := newLayout(t)
	l.layer("", "v1", func(root string) { randomFile(t, root+"/big", 8<<20) })
	l.push(addr, "conc", "v1")
	s := openStore(t)
	var wg sync.WaitGroup
	var pulls atomic.Int32
	imgs := make([]*image.Image, 4)
	errs := make([]error, 4)
	for i := range imgs {
		wg.Go(func() {
			imgs[i], errs[i] = image.Import(context.Background(), s, mustRef(t, addr+"/conc:v1"), image.Options{
				Progress: func(int64) layer.Progress { pulls.Add(1); return nil }})
		})
	}
	wg.Wait()
	for i := range imgs {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if imgs[i].ID != imgs[0].ID {
			t.Errorf("import %d: %s, import 0: %s", i, imgs[i].ID, imgs[0].ID)
		}
	}
	// An import that fetches says so once (Progress); the others shared
	// its pull, or found its layer in the store.
	if n := pulls.Load(); n != 1 {
		t.Errorf("4 concurrent imports pulled %d times, want once", n)
	}
	// Those that shared one say so (a worker logs what each fetched).
	var led int
	for _, img := range imgs {
		if !img.Joined {
			led++
		}
	}
	if led < 1 || led == 1 && imgs[0].Fetched+imgs[1].Fetched+imgs[2].Fetched+imgs[3].Fetched == 0 {
		t.Errorf("%d imports say they led, fetching %d %d %d %d", led, imgs[0].Fetched, imgs[1].Fetched, imgs[2].Fetched, imgs[3].Fetched)
	}
	// Imports that share no pull (another authority's, as another
	// process's) convert a layer once: the other waits for it and finds
	// it stored.
	s2 := openStore(t)
	var fetched, reused atomic.Int32
	for i, anon := range []bool{false, true, false, true} {
		wg.Go(func() {
			img, err := image.Import(context.Background(), s2, mustRef(t, addr+"/conc:v1"), image.Options{Anonymous: anon, Username: fmt.Sprint("user", i)})
			if err != nil {
				t.Error(err)
				return
			}
			fetched.Add(int32(img.Fetched))
			reused.Add(int32(img.Reused))
		})
	}
	wg.Wait()
	if fetched.Load() != 1 || reused.Load() != 3 {
		t.Errorf("4 imports of separate pulls fetched the layer %d times and reused it %d times, want 1 and 3", fetched.Load(), reused.Load())
	}
}

// TestImportPlatform resolves a multi-platform index to the host's
// platform or the one asked for, and says which platforms there are.
func TestImportPlatform(t *testing.T) {
	layertest.RequireRoot(t)
	ctx := context.Background()
	addr, _ := layertest.StartRegistry(t)
	l := newLayout(t)
	l.layer("", "amd", func(root string) { write(t, root+"/arch", "host\n") })
	l.layer("", "arm", func(root string) { write(t, root+"/arch", "arm64\n") })
	l.umoci("config", "--image", l.Dir+":arm", "--architecture", "arm64")
	l.push(addr, "multi", "amd")
	l.push(addr, "multi", "arm")
	repo := remoteRepo(t, addr, "multi")
	var ms []ocispec.Descriptor
	for tag, p := range map[string]ocispec.Platform{"amd": {OS: "linux", Architecture: "amd64"}, "arm": {OS: "linux", Architecture: "arm64", Variant: "v8"}} {
		d, err := repo.Resolve(ctx, tag)
		if err != nil {
			t.Fatal(err)
		}
		d.Platform = &p
		ms = append(ms, d)
	}
	idx, _ := json.Marshal(ocispec.Index{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageIndex, Manifests: ms})
	idxDesc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageIndex, Digest: digest.FromBytes(idx), Size: int64(len(idx))}
	if err := repo.Manifests().PushReference(ctx, idxDesc, strings.NewReader(string(idx)), "both"); err != nil {
		t.Fatal(err)
	}
	s := openStore(t)
	host, err := image.Import(ctx, s, mustRef(t, addr+"/multi:both"), image.Options{Platform: image.Platform{OS: "linux", Architecture: "amd64"}})
	if err != nil {
		t.Fatal(err)
	}
	arm, err := image.Import(ctx, s, mustRef(t, addr+"/multi:both"), image.Options{Platform: image.Platform{OS: "linux", Architecture: "arm64"}})
	if err != nil {
		t.Fatal(err)
	}
	if host.Platform != "linux/amd64" || arm.Platform != "linux/arm64" || host.Layers[0].DiffID == arm.Layers[0].DiffID {
		t.Errorf("platforms: %s %s, layers %s %s", host.Platform, arm.Platform, host.Layers[0].DiffID, arm.Layers[0].DiffID)
	}
	if b, _ := os.ReadFile(mountImage(t, s, arm) + "/arch"); string(b) != "arm64\n" {
		t.Errorf("the arm64 image holds %q", b)
	}
	_, err = image.Import(ctx, s, mustRef(t, addr+"/multi:both"), image.Options{Platform: image.Platform{OS: "linux", Architecture: "s390x"}})
	if !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), "linux/amd64") || !strings.Contains(err.Error(), "linux/arm64/v8") {
		t.Errorf("a platform the index lacks: %v", err)
	}
}

// TestImportCorruptBlob: a blob whose bytes are not its digest's is
// refused, and nothing of it stays in the store; the layers under it
// that were whole stay, so the pull, taken up again once the blob is
// sound, fetches only what it lacks.
func TestImportCorruptBlob(t *testing.T) {
	layertest.RequireRoot(t)
	ctx := context.Background()
	addr, data := layertest.StartRegistry(t)
	l := newLayout(t)
	l.layer("", "v1", func(root string) { randomFile(t, root+"/under", 1<<20) })
	l.layer("v1", "v1", func(root string) { randomFile(t, root+"/f", 1<<20) })
	l.push(addr, "bad", "v1")
	d, err := remoteRepo(t, addr, "bad").Resolve(ctx, "v1")
	if err != nil {
		t.Fatal(err)
	}
	mb, _ := os.ReadFile(filepath.Join(l.Dir, "blobs/sha256", d.Digest.Encoded()))
	var m ocispec.Manifest
	json.Unmarshal(mb, &m)
	top := m.Layers[1].Digest.Encoded()
	blob := filepath.Join(data, "docker/registry/v2/blobs/sha256", top[:2], top, "data")
	sound, err := os.ReadFile(blob)
	if err != nil {
		t.Fatal(err)
	}
	b := append([]byte(nil), sound...)
	b[len(b)/2] ^= 0xff
	os.WriteFile(blob, b, 0o644)
	s := openStore(t)
	_, err = image.Import(ctx, s, mustRef(t, addr+"/bad:v1"), image.Options{})
	if !errors.Is(err, layer.ErrBadSource) || !strings.Contains(err.Error(), "layer 2 of 2") {
		t.Fatalf("a corrupt blob: %v, want a bad source in layer 2", err)
	}
	tags, _ := s.Tags(ctx)
	ingest, _ := os.ReadDir(filepath.Join(s.Dir(), "ingest"))
	var left []string
	for _, e := range ingest {
		if strings.HasPrefix(e.Name(), "blob.") {
			left = append(left, e.Name())
		}
	}
	if len(tags) != 1 || len(left) != 0 {
		t.Errorf("a refused import left %d tags (want the sound layer's alone) and ingests %v", len(tags), left)
	}
	t.Logf("refused: %v", err)
	os.WriteFile(blob, sound, 0o644)
	img, err := image.Import(ctx, s, mustRef(t, addr+"/bad:v1"), image.Options{})
	if err != nil || img.Fetched != 1 || img.Reused != 1 {
		t.Fatalf("taken up again: %+v %v, want 1 fetched and 1 reused", img, err)
	}
}

// TestImportAuth: a private repository needs the credentials; without
// them the error says how to give them.
func TestImportAuth(t *testing.T) {
	layertest.RequireRoot(t)
	ctx := context.Background()
	hash, _ := bcrypt.GenerateFromPassword([]byte("s3cret"), bcrypt.MinCost)
	htpasswd := filepath.Join(t.TempDir(), "htpasswd")
	os.WriteFile(htpasswd, []byte("agent:"+string(hash)+"\n"), 0o600)
	addr, _ := layertest.StartRegistryWith(t, fmt.Sprintf("auth:\n  htpasswd:\n    realm: test\n    path: %s\n", htpasswd))
	l := newLayout(t)
	l.layer("", "v1", func(root string) { write(t, root+"/secret", "s\n") })
	src, _ := oci.New(l.Dir)
	dst := remoteRepo(t, addr, "private")
	dst.Client = remoteClient(addr, "agent", "s3cret")
	if _, err := oras.Copy(ctx, src, "v1", dst, "v1", oras.DefaultCopyOptions); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DOCKER_CONFIG", t.TempDir()) // no docker login here
	s := openStore(t)
	_, err := image.Import(ctx, s, mustRef(t, addr+"/private:v1"), image.Options{})
	if !errdefs.IsPermissionDenied(err) || !strings.Contains(err.Error(), "DSEC_REGISTRY_USERNAME") {
		t.Fatalf("no credentials: %v", err)
	}
	if _, err := image.Import(ctx, s, mustRef(t, addr+"/private:v1"), image.Options{Username: "agent", Password: "wrong", CredentialHost: addr}); !errdefs.IsPermissionDenied(err) {
		t.Fatalf("wrong credentials: %v", err)
	}
	if _, err := image.Import(ctx, s, mustRef(t, addr+"/private:v1"), image.Options{Username: "agent", Password: "s3cret", CredentialHost: addr}); err != nil {
		t.Fatal(err)
	}
	// Credentials are for the registry they name, no other.
	if _, err := image.Import(ctx, openStore(t), mustRef(t, addr+"/private:v1"), image.Options{Username: "agent", Password: "s3cret", CredentialHost: "registry.example"}); !errdefs.IsPermissionDenied(err) {
		t.Errorf("credentials for another registry: %v", err)
	}
	// As docker login leaves them: the config file.
	cfg := t.TempDir()
	auth := fmt.Sprintf(`{"auths":{%q:{"auth":%q}}}`, addr, b64("agent:s3cret"))
	os.WriteFile(filepath.Join(cfg, "config.json"), []byte(auth), 0o600)
	t.Setenv("DOCKER_CONFIG", cfg)
	if _, err := image.Import(ctx, openStore(t), mustRef(t, addr+"/private:v1"), image.Options{}); err != nil {
		t.Fatalf("with docker login's config: %v", err)
	}
}

func remoteClient(host, user, password string) *auth.Client {
	return remote.Client(host, remote.Options{Username: user, Password: password})
}

func b64(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }

// TestImportMirrors: a mirror the config names is asked first and
// serves the pull; one that lacks the image, or does not answer, is
// passed over for the next, the registry last.
func TestImportMirrors(t *testing.T) {
	layertest.RequireRoot(t)
	ctx := context.Background()
	origin, _ := layertest.StartRegistry(t)
	mirror, _ := layertest.StartRegistry(t)
	empty, _ := layertest.StartRegistry(t)
	l := newLayout(t)
	l.layer("", "v1", func(root string) { write(t, root+"/where", "mirror\n") })
	l.layer("", "v2", func(root string) { write(t, root+"/where", "origin\n") })
	l.push(mirror, "m", "v1")
	l.push(origin, "m", "v2")
	dead := freeAddr(t)
	o := image.Options{Mirrors: map[string][]string{origin: {dead, empty, mirror}}}
	s := openStore(t)
	img, err := image.Import(ctx, s, mustRef(t, origin+"/m:v1"), o)
	if err != nil {
		t.Fatal(err)
	}
	if img.From != mirror {
		t.Errorf("v1 came from %s, want the mirror %s", img.From, mirror)
	}
	if b, _ := os.ReadFile(mountImage(t, s, img) + "/where"); string(b) != "mirror\n" {
		t.Errorf("v1 holds %q", b)
	}
	// What no mirror has comes from the registry.
	img, err = image.Import(ctx, s, mustRef(t, origin+"/m:v2"), o)
	if err != nil || img.From != origin {
		t.Fatalf("v2: %+v %v, want it from %s", img, err, origin)
	}
	// What none has says what each said.
	_, err = image.Import(ctx, s, mustRef(t, origin+"/m:v3"), o)
	if !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), "mirrors: "+dead) {
		t.Errorf("v3: %v", err)
	}
}

func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// TestImportLimits: an import past its bounds (a tenant's) is refused,
// past what its blobs declare before anything is fetched, and past what
// it unpacks or the entries of a layer as it streams; the store keeps
// nothing of it.
func TestImportLimits(t *testing.T) {
	layertest.RequireRoot(t)
	ctx := context.Background()
	addr, _ := layertest.StartRegistry(t)
	l := newLayout(t)
	l.layer("", "v1", func(root string) {
		randomFile(t, root+"/big", 2<<20)
		for i := range 100 {
			write(t, fmt.Sprintf("%s/many/%d", root, i), "")
		}
	})
	l.push(addr, "lim", "v1")
	ref := mustRef(t, addr+"/lim:v1")
	for name, lim := range map[string]image.Limits{
		"compressed": {Compressed: 1 << 20}, "unpacked": {Bytes: 1 << 20}, "entries": {Entries: 50},
	} {
		s := openStore(t)
		_, err := image.Import(ctx, s, ref, image.Options{Limits: lim})
		if err == nil || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: %v, want a one-line refusal", name, err)
		}
		if !errdefs.IsOutOfRange(err) {
			t.Errorf("%s: %v, want out of range", name, err)
		}
		if tags, _ := s.Tags(ctx); len(tags) != 0 {
			t.Errorf("%s: the store kept %d tags", name, len(tags))
		}
		if kept := spools(t, s); len(kept) > 0 { // it would fail again: nothing to take up
			t.Errorf("%s: the store kept %v of the refused layer", name, kept)
		}
		t.Logf("%s: %v", name, err)
	}
	if _, err := image.Import(ctx, openStore(t), ref, image.Options{Limits: image.Limits{Compressed: 8 << 20, Bytes: 8 << 20, Entries: 200}}); err != nil {
		t.Errorf("within bounds: %v", err)
	}
	// A tag of the store that names a layer is not an image's to take.
	s := openStore(t)
	tag, _ := ref.StoreTag()
	p := filepath.Join(t.TempDir(), "l.tar")
	os.WriteFile(p, layertest.Tar(layertest.File{Name: "x", Body: "x"}), 0o644)
	if _, err := layer.Build(ctx, s, layer.BuildOptions{Source: p, Kind: layer.KindBase, Ref: tag}); err != nil {
		t.Fatal(err)
	}
	if _, err := image.Import(ctx, s, ref, image.Options{}); !errdefs.IsAlreadyExists(err) {
		t.Errorf("an image over a layer's tag: %v", err)
	}
}
