package image_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/layer/image"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// cutting is a proxy in front of a registry that cuts the first cut
// blob transfers half way (the connection ends), and counts the ranged
// requests that take them up again.
type cutting struct {
	proxy        *httputil.ReverseProxy
	cut, resumed atomic.Int32
	cuts         int32
}

func (c *cutting) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if strings.Contains(r.URL.Path, "/blobs/") && r.Header.Get("Range") != "" {
		c.resumed.Add(1)
	}
	c.proxy.ServeHTTP(w, r)
}

type cutBody struct {
	io.ReadCloser
	left int64
}

func (b *cutBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		return 0, errors.New("cut")
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	return n, err
}

// TestImportResumes: a transfer cut half way is taken up again where it
// stopped (a Range request), and the image is whole.
func TestImportResumes(t *testing.T) {
	layertest.RequireRoot(t)
	ctx := context.Background()
	addr, _ := layertest.StartRegistry(t)
	l := newLayout(t)
	l.layer("", "v1", func(root string) { randomFile(t, root+"/big", 6<<20) })
	l.push(addr, "cut", "v1")
	target, _ := url.Parse("http://" + addr)
	c := &cutting{proxy: httputil.NewSingleHostReverseProxy(target), cuts: 2}
	c.proxy.ErrorLog = log.New(io.Discard, "", 0)
	c.proxy.ModifyResponse = func(resp *http.Response) error {
		if resp.Request.Method == http.MethodGet && strings.Contains(resp.Request.URL.Path, "/blobs/") && resp.ContentLength > 1<<20 &&
			resp.Request.Header.Get("Range") == "" && c.cut.Add(1) <= c.cuts {
			resp.Body = &cutBody{ReadCloser: resp.Body, left: resp.ContentLength / 2}
		}
		return nil
	}
	srv := httptest.NewServer(c)
	defer srv.Close()
	s := openStore(t)
	img, err := image.Import(ctx, s, mustRef(t, strings.TrimPrefix(srv.URL, "http://")+"/cut:v1"), image.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if c.resumed.Load() == 0 {
		t.Error("no transfer was taken up again with a Range request")
	}
	l.sameAs(t, "v1", s, img, "after a resumed pull")
	t.Logf("%d transfers taken up again", c.resumed.Load())
}

// stalling is a proxy in front of a registry that, while stall is set,
// serves half of a large blob and then nothing more (a transfer the
// importer is killed in the middle of), and records the Range of every
// blob request.
type stalling struct {
	proxy   *httputil.ReverseProxy
	stall   atomic.Bool
	halfway chan int64 // the bytes served before a stall
	mu      sync.Mutex
	ranges  []string // "DIGEST RANGE" of each blob request
}

// reset forgets the requests seen so far.
func (st *stalling) reset() {
	st.mu.Lock()
	st.ranges = nil
	st.mu.Unlock()
}

// asked is the Range of each request of blob d (hex), "" for a whole one.
func (st *stalling) asked(d string) []string {
	st.mu.Lock()
	defer st.mu.Unlock()
	var out []string
	for _, r := range st.ranges {
		if got, rng, _ := strings.Cut(r, " "); got == d {
			out = append(out, rng)
		}
	}
	return out
}

func newStalling(t *testing.T, addr string) *stalling {
	target, _ := url.Parse("http://" + addr)
	st := &stalling{proxy: httputil.NewSingleHostReverseProxy(target), halfway: make(chan int64, 1)}
	st.proxy.ErrorLog = log.New(io.Discard, "", 0)
	st.proxy.FlushInterval = -1 // every byte served reaches the importer before the stall
	st.proxy.ModifyResponse = func(resp *http.Response) error {
		if resp.Request.Method == http.MethodGet && strings.Contains(resp.Request.URL.Path, "/blobs/") && resp.ContentLength > 1<<20 && st.stall.Load() {
			resp.Body = &stallBody{ReadCloser: resp.Body, left: resp.ContentLength / 2, ctx: resp.Request.Context(), halfway: st.halfway, n: resp.ContentLength / 2}
		}
		return nil
	}
	return st
}

func (st *stalling) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if strings.Contains(r.URL.Path, "/blobs/") && r.Method == http.MethodGet {
		st.mu.Lock()
		st.ranges = append(st.ranges, strings.TrimPrefix(path.Base(r.URL.Path), "sha256:")+" "+r.Header.Get("Range"))
		st.mu.Unlock()
	}
	st.proxy.ServeHTTP(w, r)
}

type stallBody struct {
	io.ReadCloser
	left, n int64
	ctx     context.Context
	halfway chan int64
}

func (b *stallBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		select {
		case b.halfway <- b.n:
		default:
		}
		<-b.ctx.Done()
		return 0, b.ctx.Err()
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	return n, err
}

// spools lists the store's kept ingests (what an interrupted import
// left to take up) and their sizes.
func spools(t *testing.T, s *store.Store) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	es, _ := os.ReadDir(filepath.Join(s.Dir(), "ingest"))
	for _, e := range es {
		if fi, err := e.Info(); err == nil && strings.HasPrefix(e.Name(), "partial-") {
			out[e.Name()] = fi.Size()
		}
	}
	return out
}

// interrupt starts an import of ref into s through st, stalled half
// way through its large blob, and stops it there (as a kill would: it
// runs no step of its own on the way out, it only stops reading): what
// the importer read of the blob is left spooled.
func interrupt(t *testing.T, st *stalling, s *store.Store, ref image.Reference) (blob string, held int64) {
	t.Helper()
	st.stall.Store(true)
	defer st.stall.Store(false)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { _, err := image.Import(ctx, s, ref, image.Options{}); done <- err }()
	var half int64
	select {
	case half = <-st.halfway:
	case err := <-done:
		t.Fatalf("the import ended before its blob stalled: %v", err)
	case <-time.After(time.Minute):
		t.Fatal("the blob's transfer never stalled")
	}
	deadline := time.Now().Add(10 * time.Second)
	for sum(spools(t, s)) < half && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if err := <-done; err == nil {
		t.Fatal("an import stopped half way succeeded")
	}
	// The caller is answered at once; the pull itself lets go of its
	// spool (a lock on the file) as it sees its context end.
	for name := range spools(t, s) {
		waitUnlocked(t, filepath.Join(s.Dir(), "ingest", name))
	}
	kept := spools(t, s)
	if len(kept) != 1 || sum(kept) != half {
		t.Fatalf("the stopped import kept %v of its blob, want the %d bytes it read", kept, half)
	}
	for name := range kept {
		blob = strings.TrimPrefix(name, "partial-")
	}
	return blob, half
}

// waitUnlocked waits until no process holds path's lock.
func waitUnlocked(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for deadline := time.Now().Add(10 * time.Second); unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil; {
		if time.Now().After(deadline) {
			t.Fatalf("%s is still held 10 s after its import stopped", path)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func sum(m map[string]int64) (n int64) {
	for _, v := range m {
		n += v
	}
	return n
}

// TestImportResumesAfterInterruption: an import stopped in the middle
// of a layer (its process killed, its context cancelled) leaves the
// blob's bytes it read spooled in the store; the next import reads them
// from there and asks the registry for the rest alone (a Range from that
// byte), converts the same EROFS layer as an import never stopped, and
// drops the spool. A spool whose bytes went bad is dropped and the layer
// fetched whole again.
func TestImportResumesAfterInterruption(t *testing.T) {
	layertest.RequireRoot(t)
	ctx := context.Background()
	addr, _ := layertest.StartRegistry(t)
	l := newLayout(t)
	l.layer("", "v1", func(root string) { randomFile(t, root+"/big", 6<<20) })
	l.push(addr, "big", "v1")
	st := newStalling(t, addr)
	srv := httptest.NewServer(st)
	defer srv.Close()
	ref := mustRef(t, strings.TrimPrefix(srv.URL, "http://")+"/big:v1")

	whole, err := image.Import(ctx, openStore(t), mustRef(t, addr+"/big:v1"), image.Options{})
	if err != nil {
		t.Fatal(err)
	}

	s := openStore(t)
	blob, half := interrupt(t, st, s, ref)
	st.reset()
	img, err := image.Import(ctx, s, ref, image.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if img.Resumed != half {
		t.Errorf("the import says it read %d bytes from what the interrupted one kept, want %d", img.Resumed, half)
	}
	if got, want := st.asked(blob), fmt.Sprintf("bytes=%d-", half); !slices.Equal(got, []string{want}) {
		t.Errorf("the layer's blob was asked for %q after the interruption, want %q alone", got, want)
	}
	if img.Layers[0].Digest != whole.Layers[0].Digest {
		t.Errorf("the layer converted in two goes is %s, in one %s", img.Layers[0].Digest, whole.Layers[0].Digest)
	}
	if left := spools(t, s); len(left) > 0 {
		t.Errorf("the spool outlived the layer: %v", left)
	}
	l.sameAs(t, "v1", s, img, "after an import taken up again")
	// Pulled again, the tag naming the same manifest: no blob is asked
	// for, not even the config.
	st.reset()
	if again, err := image.Import(ctx, s, ref, image.Options{}); err != nil || again.Reused != 1 || again.Fetched != 0 {
		t.Errorf("pulled again: %v, %+v", err, again)
	}
	st.mu.Lock()
	if len(st.ranges) > 0 {
		t.Errorf("pulled again, the tag naming what the store holds: blobs asked for %q", st.ranges)
	}
	st.mu.Unlock()

	// A spool gone bad (a byte flipped on the disk): the digest refuses
	// it, and the layer comes whole from the registry.
	s = openStore(t)
	blob, _ = interrupt(t, st, s, ref)
	for name := range spools(t, s) {
		f, err := os.OpenFile(filepath.Join(s.Dir(), "ingest", name), os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		f.WriteAt([]byte{0xff, 0x00, 0xff}, 1000)
		f.Close()
	}
	st.reset()
	img, err = image.Import(ctx, s, ref, image.Options{})
	if err != nil {
		t.Fatalf("an import over a bad spool: %v", err)
	}
	if got := st.asked(blob); img.Layers[0].Digest != whole.Layers[0].Digest || len(got) != 2 || !strings.HasPrefix(got[0], "bytes=") || got[1] != "" || img.Resumed != 0 {
		t.Errorf("over a bad spool: layer %s (want %s), its blob asked for %q (want its rest, then the whole), %d bytes resumed (want 0)", img.Layers[0].Digest, whole.Layers[0].Digest, got, img.Resumed)
	}
	if left := spools(t, s); len(left) > 0 {
		t.Errorf("the bad spool outlived the import: %v", left)
	}

	// A tenant's pull (NoResume) keeps nothing of a layer it has not
	// finished: not even while it runs.
	s = openStore(t)
	st.stall.Store(true)
	tctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { _, err := image.Import(tctx, s, ref, image.Options{NoResume: true}); done <- err }()
	select {
	case <-st.halfway:
	case <-time.After(time.Minute):
		t.Fatal("the tenant's transfer never stalled")
	}
	time.Sleep(200 * time.Millisecond)
	if kept := spools(t, s); len(kept) > 0 {
		t.Errorf("a tenant's pull spooled %v", kept)
	}
	cancel()
	<-done
	st.stall.Store(false)

	// A spool of the whole blob (killed while its layer was being
	// stored): nothing more is asked of the registry (which would
	// refuse a range past the end), and the layer is stored from it.
	resp, err := http.Get("http://" + addr + "/v2/big/blobs/sha256:" + blob)
	if err != nil {
		t.Fatal(err)
	}
	all, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	s = openStore(t)
	if err := os.WriteFile(filepath.Join(s.Dir(), "ingest", "partial-"+blob), all, 0o600); err != nil {
		t.Fatal(err)
	}
	st.reset()
	img, err = image.Import(ctx, s, ref, image.Options{})
	if err != nil {
		t.Fatalf("an import over a spool of the whole blob: %v", err)
	}
	if got := st.asked(blob); len(got) > 0 || img.Resumed != int64(len(all)) || img.Layers[0].Digest != whole.Layers[0].Digest {
		t.Errorf("over a spool of the whole blob: asked for %q (want nothing), %d bytes resumed (want %d), layer %s (want %s)",
			got, img.Resumed, len(all), img.Layers[0].Digest, whole.Layers[0].Digest)
	}
}
