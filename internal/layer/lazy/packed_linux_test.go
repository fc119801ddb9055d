package lazy_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"math/rand"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/lazy"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime/lower"
)

// TestPackedRemoteFetchesSharedChunksOnce: two layers pushed to a dir:
// remote that packs its layers hold the same 8 MiB file and 2 MiB of
// their own. A host mounts the first lazily and reads it all, then the
// second: for the second it fetches its own data, not the file the
// first brought (the chunk blobs are cached once per host, whichever
// layer reads them). Both read back as they were built, and a microVM's
// whole image of the second hashes to its digest.
func TestPackedRemoteFetchesSharedChunksOnce(t *testing.T) {
	layertest.RequireRoot(t)
	ctx := context.Background()
	root := t.TempDir()
	t.Cleanup(func() { detachLeft(t, root) })
	rnd := rand.New(rand.NewSource(49))
	random := func(n int) []byte { b := make([]byte, n); rnd.Read(b); return b }
	shared := random(8 << 20)
	srcs := map[string]map[string][]byte{
		"a": {"usr/lib/wheel.so": shared, "a/own": random(2 << 20), "etc/name": []byte("a\n")},
		"b": {"opt/wheel.so": shared, "b/own": random(2 << 20), "etc/name": []byte("b\n")},
	}
	local, err := store.Open(filepath.Join(root, "local"))
	if err != nil {
		t.Fatal(err)
	}
	rdir := filepath.Join(root, "remote")
	rs, err := store.Open(rdir)
	if err != nil {
		t.Fatal(err)
	}
	if err := rs.SetDedup(true); err != nil {
		t.Fatal(err)
	}
	target, err := remote.Open("dir://"+rdir, remote.Options{})
	if err != nil {
		t.Fatal(err)
	}
	infos := map[string]*layer.Info{}
	for _, name := range []string{"a", "b"} {
		src := filepath.Join(root, "src-"+name)
		for p, b := range srcs[name] {
			os.MkdirAll(filepath.Dir(filepath.Join(src, p)), 0o755)
			if err := os.WriteFile(filepath.Join(src, p), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		ref, _ := layer.ParseRef("packed/" + name + ":1")
		info, err := layer.Build(ctx, local, layer.BuildOptions{Source: src, Kind: layer.KindBase, Ref: ref})
		if err != nil {
			t.Fatal(err)
		}
		infos[name] = info
		if _, err := remote.Copy(ctx, remote.Local(local), target, ref, false, nil); err != nil {
			t.Fatal(err)
		}
		if !rs.Packed(info.Digest) {
			t.Fatalf("layer %s pushed to a store that packs is not packed", name)
		}
	}

	host := filepath.Join(root, "host")
	hs, err := store.Open(filepath.Join(host, "store"))
	if err != nil {
		t.Fatal(err)
	}
	src := lower.Source{Store: hs, Remote: target, Fetcher: lazy.Start{Path: os.Args[0]}, Cache: lazy.Tuning{ReadAheadKB: lazy.DefaultReadAheadKB}}
	ms := lower.New(host)
	byBlob := func() map[digest.Digest]int64 {
		out := map[digest.Digest]int64{}
		for _, name := range []string{"a", "b"} {
			_, devs, _, _ := rs.PackedLayer(infos[name].Digest)
			for _, d := range devs {
				if st, err := lazy.ReadStats(host, d); err == nil {
					out[d] = st.BytesFetched
				}
			}
		}
		return out
	}
	total := func(m map[digest.Digest]int64) (n int64) {
		for _, v := range m {
			n += v
		}
		return n
	}

	t.Setenv("DSEC_TEST_FETCHER", "1")
	read := func(name string) {
		t.Helper()
		mnt, f, err := ms.Acquire(ctx, src, "packed/"+name+":1", "user-"+name, "")
		if err != nil {
			t.Fatal(err)
		}
		for p, want := range srcs[name] {
			got, err := os.ReadFile(filepath.Join(mnt, p))
			if err != nil || !bytes.Equal(got, want) {
				t.Fatalf("layer %s, %s read lazily: %d bytes (want %d), %v", name, p, len(got), len(want), err)
			}
		}
		if name == "b" { // a microVM's file: the whole image, fetched lazily
			img, err := f.Whole()
			if err != nil {
				t.Fatal(err)
			}
			h := sha256.New()
			fh, err := os.Open(img)
			if err != nil {
				t.Fatal(err)
			}
			_, err = io.CopyN(h, fh, infos[name].Size)
			fh.Close()
			if err != nil || digest.NewDigest(digest.SHA256, h) != infos[name].Digest {
				t.Fatalf("the whole image of a packed remote layer: %v, want digest %s", err, infos[name].Digest)
			}
		}
	}
	read("a")
	afterA := byBlob()
	read("b")
	if err := ms.Release("user-a"); err != nil {
		t.Error(err)
	}
	if err := ms.Release("user-b"); err != nil {
		t.Error(err)
	}
	for _, name := range []string{"a", "b"} { // the fetchers exit: their figures are final
		_, devs, _, _ := rs.PackedLayer(infos[name].Digest)
		for _, d := range devs {
			waitGone(t, pidOf(lazy.Dir(host, d)))
		}
	}
	waitGone(t, pidOf(lazy.Dir(host, infos["b"].Digest)))
	afterB := byBlob()
	forA, forB := total(afterA), total(afterB)-total(afterA)
	t.Logf("chunk bytes fetched: %d for a (%d of file data), then %d for b (%d of its own, %d shared with a)", forA, 10<<20, forB, 2<<20, 8<<20)
	if forA < 10<<20 {
		t.Errorf("a's reads fetched %d bytes of chunks, less than its 10 MiB of file data", forA)
	}
	if forB < 2<<20 || forB > 3<<20 {
		t.Errorf("b's reads fetched %d bytes of chunks: want its own 2 MiB, not the 8 MiB it shares with a", forB)
	}

	// A chunk blob that rotted on the remote fails the read on a fresh
	// host: its window does not match the table, never served.
	_, devs, _, _ := rs.PackedLayer(infos["b"].Digest)
	p, size, _, err := rs.ChunkBlob(devs[0]) // b's own blob: its file of its own first
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(p, 0o644)
	bad, err := os.OpenFile(p, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	for off := int64(64 << 10); off < size; off += 64 << 10 { // (a bad first window fails the mount itself)
		bad.WriteAt([]byte{0xff, 0x00, 0xff}, off+17)
	}
	bad.Close()
	host2 := filepath.Join(root, "host2")
	hs2, err := store.Open(filepath.Join(host2, "store"))
	if err != nil {
		t.Fatal(err)
	}
	src.Store = hs2
	ms2 := lower.New(host2)
	defer func() {
		for _, d := range devs {
			waitGone(t, pidOf(lazy.Dir(host2, d)))
		}
	}()
	mnt, _, err := ms2.Acquire(ctx, src, "packed/b:1", "user-c", "")
	if err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(filepath.Join(mnt, "b", "own")); err == nil {
		t.Errorf("a file of a corrupt chunk blob read without an error (the same bytes: %v)", bytes.Equal(got, srcs["b"]["b/own"]))
	}
	if err := ms2.Release("user-c"); err != nil {
		t.Error(err)
	}
}

// TestPackedRemotePrefetchesHotRegion: a layer built with an access
// profile, mounted packed from a remote, has its chunk blob's fetcher
// prefetch the profile's files, not the rest, before anything reads.
func TestPackedRemotePrefetchesHotRegion(t *testing.T) {
	layertest.RequireRoot(t)
	ctx := context.Background()
	root := t.TempDir()
	t.Cleanup(func() { detachLeft(t, root) })
	rnd := rand.New(rand.NewSource(54))
	src := filepath.Join(root, "src")
	os.MkdirAll(src, 0o755)
	for _, n := range []string{"cold", "hot"} {
		b := make([]byte, 1<<20)
		rnd.Read(b)
		if err := os.WriteFile(filepath.Join(src, n), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	local, err := store.Open(filepath.Join(root, "local"))
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := layer.ParseRef("packed/hot:1")
	info, err := layer.Build(ctx, local, layer.BuildOptions{Source: src, Kind: layer.KindBase, Ref: ref, Order: []erofs.Hot{{Path: "hot"}}})
	if err != nil {
		t.Fatal(err)
	}
	rs, err := store.Open(filepath.Join(root, "remote"))
	if err != nil {
		t.Fatal(err)
	}
	rs.SetDedup(true)
	target, err := remote.Open("dir://"+rs.Dir(), remote.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := remote.Copy(ctx, remote.Local(local), target, ref, false, nil); err != nil {
		t.Fatal(err)
	}
	_, devs, _, err := rs.PackedLayer(info.Digest)
	if err != nil || len(devs) != 1 {
		t.Fatalf("the pushed layer is not packed in one blob: %v %v", devs, err)
	}
	host := filepath.Join(root, "host")
	hs, err := store.Open(filepath.Join(host, "store"))
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("DSEC_TEST_FETCHER", "1")
	ms := lower.New(host)
	if _, _, err := ms.Acquire(ctx, lower.Source{Store: hs, Remote: target, Fetcher: lazy.Start{Path: os.Args[0]}}, ref.String(), "u", ""); err != nil {
		t.Fatal(err)
	}
	var fetched int64
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline) && fetched < 1<<20; time.Sleep(100 * time.Millisecond) {
		if st, err := lazy.ReadStats(host, devs[0]); err == nil {
			fetched = st.BytesFetched
		}
	}
	if err := ms.Release("u"); err != nil {
		t.Error(err)
	}
	waitGone(t, pidOf(lazy.Dir(host, devs[0])))
	if st, err := lazy.ReadStats(host, devs[0]); err == nil {
		fetched = st.BytesFetched
	}
	t.Logf("fetched before any read: %d bytes of the blob (the hot file: %d, the cold one: %d)", fetched, 1<<20, 1<<20)
	if fetched < 1<<20 || fetched >= 3<<19 {
		t.Errorf("the chunk blob's fetcher prefetched %d bytes: want the hot file's 1 MiB, not the cold one", fetched)
	}
}
