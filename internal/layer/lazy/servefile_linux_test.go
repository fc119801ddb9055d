package lazy_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/lazy"
)

// TestServeFile: a blob that is no EROFS image (a full VM's disk) is
// served as a file a reader opens by its path: only its first window is
// fetched before it is served, and then what is read; the fetcher
// serves while the file is open anywhere, past its idle time, and exits
// once no handle is left; a window that does not match its table is an
// I/O error, and the others read.
func TestServeFile(t *testing.T) {
	layertest.RequireRoot(t)
	rdir := t.TempDir()
	blob := make([]byte, 3<<20+12345)
	rand.New(rand.NewSource(1)).Read(blob)
	d := digest.FromBytes(blob)
	path := filepath.Join(rdir, "blobs", "sha256", d.Encoded())
	os.MkdirAll(filepath.Dir(path), 0o755)
	if err := os.WriteFile(path, blob, 0o644); err != nil {
		t.Fatal(err)
	}
	f, _ := os.Open(path)
	table, err := layer.WindowTable(f, int64(len(blob)), layer.WindowSize)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	spec := lazy.Spec{Ref: "vm/disk:1", Digest: d, Size: int64(len(blob)), Remote: "dir://" + rdir, Raw: true,
		Windows: layer.Windows{Size: layer.WindowSize, Count: len(table) / 32, Digest: digest.FromBytes(table)}}
	serve := func() (string, *os.File) {
		t.Helper()
		t.Setenv("DSEC_TEST_FETCHER", "1")
		p, h, err := lazy.ServeFile(context.Background(), root, spec, table, lazy.Start{Path: os.Args[0]})
		os.Unsetenv("DSEC_TEST_FETCHER")
		if err != nil {
			t.Fatal(err)
		}
		return p, h
	}
	stats := func() lazy.Stats {
		t.Helper()
		time.Sleep(400 * time.Millisecond) // (written every 250 ms)
		s, err := lazy.ReadStats(root, d)
		if err != nil {
			t.Fatal(err)
		}
		return *s
	}
	p, hold := serve()
	cache := lazy.Dir(root, d)
	pid := pidOf(cache)
	if s := stats(); s.BytesFetched == 0 || s.BytesFetched > 256<<10 {
		t.Errorf("served: %d bytes fetched, want its first window's (and no more than 256 KiB)", s.BytesFetched)
	}
	reader, err := os.Open(p) // as QEMU opens it
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Close()
	hold.Close()
	time.Sleep(time.Second) // past the fetcher's idle time (300 ms here)
	got := make([]byte, 8192)
	if _, err := reader.ReadAt(got, 2<<20+100); err != nil || !bytes.Equal(got, blob[2<<20+100:2<<20+100+8192]) {
		t.Fatalf("read past the idle time: %v", err)
	}
	if s := stats(); s.BytesFetched >= s.BytesTotal/2 {
		t.Errorf("%d of %d bytes fetched for two reads", s.BytesFetched, s.BytesTotal)
	}
	reader.Close()
	waitGone(t, pid)

	// A window of the remote's that is not what the table says.
	bad := bytes.Clone(blob)
	bad[1<<20+5] ^= 0xff
	if err := os.WriteFile(path, bad, 0o644); err != nil {
		t.Fatal(err)
	}
	p, hold = serve()
	defer func() { pid := pidOf(cache); hold.Close(); waitGone(t, pid) }()
	if _, err := hold.ReadAt(got, 1<<20); !errors.Is(err, syscall.EIO) {
		t.Errorf("read of a window that does not match its table: %v, want EIO", err)
	}
	if _, err := hold.ReadAt(got, 3<<20); err != nil || !bytes.Equal(got, blob[3<<20:3<<20+8192]) {
		t.Errorf("read of another window: %v", err)
	}
	if w, err := os.OpenFile(p, os.O_RDWR, 0); err == nil || !errors.Is(err, syscall.EROFS) {
		w.Close()
		t.Errorf("open for writing: %v, want EROFS", err)
	}
}
