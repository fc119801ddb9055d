package layer

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer/erofs"
)

// goodConfig is a config as a build writes it, for an image of size
// bytes with its metadata in the last block.
func goodConfig(size int64) Config {
	return Config{Kind: KindBase, BlockSize: erofs.BlockSize, Source: "dir",
		Data:     erofs.Region{Offset: erofs.BlockSize, Size: size - 2*erofs.BlockSize},
		Metadata: erofs.Region{Offset: size - erofs.BlockSize, Size: erofs.BlockSize},
		Windows:  Windows{Size: WindowSize, Count: int((size + WindowSize - 1) / WindowSize), Digest: digest.FromString("table")}}
}

// TestParseConfigBounds: every region and the window table a config
// names must fit the image its manifest says; each way one can lie is
// refused as data loss with a one-line error (issue 29, item 9).
func TestParseConfigBounds(t *testing.T) {
	const size = 3 << 20
	good := goodConfig(size)
	b, _ := json.Marshal(good)
	if _, err := ParseConfig(b, size); err != nil {
		t.Fatalf("a good config: %v", err)
	}
	for what, c := range map[string]func(*Config){
		"window size 0":            func(c *Config) { c.Windows.Size = 0 },
		"window size not a power":  func(c *Config) { c.Windows.Size = 3 << 20 },
		"window size 1 GiB":        func(c *Config) { c.Windows.Size, c.Windows.Count = 1<<30, 1 },
		"too few windows":          func(c *Config) { c.Windows.Count = 1 },
		"too many windows":         func(c *Config) { c.Windows.Count = 1 << 30 },
		"metadata past the image":  func(c *Config) { c.Metadata.Offset = size },
		"metadata overflowing":     func(c *Config) { c.Metadata.Size = 1<<63 - 1 },
		"metadata at block 0":      func(c *Config) { c.Metadata.Offset = 0 },
		"metadata unaligned":       func(c *Config) { c.Metadata.Offset = size - erofs.BlockSize - 1 },
		"negative metadata":        func(c *Config) { c.Metadata.Size = -1 },
		"data over the metadata":   func(c *Config) { c.Data.Size = size },
		"hot region past the data": func(c *Config) { c.Hot = &erofs.Region{Offset: erofs.BlockSize, Size: size} },
		"other block size":         func(c *Config) { c.BlockSize = 512 },
		"a lineage of 5,000 layers": func(c *Config) {
			c.Kind = KindSnapshot
			c.Snapshot = &Lineage{Lowers: make([]Lower, 5000)}
		},
	} {
		cfg := goodConfig(size)
		c(&cfg)
		b, _ := json.Marshal(cfg)
		_, err := ParseConfig(b, size)
		if !errdefs.IsDataLoss(err) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: %v", what, err)
		}
	}
	b, _ = json.Marshal(good)
	for _, sz := range []int64{0, erofs.BlockSize, size + 1, 1 << 50} {
		if _, err := ParseConfig(b, sz); !errdefs.IsDataLoss(err) {
			t.Errorf("an image of %d bytes: %v", sz, err)
		}
	}
}

// FuzzParseConfig: whatever a remote serves, ParseConfig returns a config
// whose regions and windows the fetcher can walk without a panic or a
// division by zero, or an error.
func FuzzParseConfig(f *testing.F) {
	b, _ := json.Marshal(goodConfig(3 << 20))
	f.Add(b, int64(3<<20))
	hot := goodConfig(8 << 20)
	hot.Hot = &erofs.Region{Offset: erofs.BlockSize, Size: 1 << 20}
	b, _ = json.Marshal(hot)
	f.Add(b, int64(8<<20))
	f.Add([]byte(`{"windows":{"size":0,"count":0}}`), int64(4096))
	b, _ = json.Marshal(memoryConfig(3 << 20))
	f.Add(b, int64(3<<20))
	f.Fuzz(func(t *testing.T, b []byte, size int64) {
		cfg, err := ParseConfig(b, size)
		if err != nil {
			return
		}
		w := cfg.Windows
		if w.Size <= 0 || int64(w.Count)*w.Size < size || int64(w.Count-1)*w.Size >= size {
			t.Fatalf("windows %+v for %d bytes", w, size)
		}
		m := cfg.Metadata
		if m.Offset < 0 || m.Offset+m.Size > size || int(m.Offset/w.Size) >= w.Count {
			t.Fatalf("metadata %+v for %d bytes", m, size)
		}
		if h := cfg.Hot; h != nil && (h.Offset < 0 || h.Offset+h.Size > size) {
			t.Fatalf("hot %+v for %d bytes", h, size)
		}
	})
}

// memoryConfig is a memory snapshot's config as pack-diff --memory
// writes it, over bb:1.
func memoryConfig(size int64) Config {
	c := goodConfig(size)
	c.Kind = KindSnapshot
	base := Lower{Ref: "bb:1", Digest: digest.FromString("bb")}
	blob := func(mt, s string) ocispec.Descriptor {
		return ocispec.Descriptor{MediaType: mt, Digest: digest.FromString(s), Size: 100}
	}
	ram := blob(MediaTypeVMRAM, "ram")
	c.Snapshot = &Lineage{Lowers: []Lower{base}, Sandbox: "vm", Memory: &Memory{
		State: blob(MediaTypeVMState, "state"), RAM: &ram, Disk: blob(MediaTypeVMDisk, "disk"),
		Layers: []Lower{base}, DiskBytes: 1 << 30, Nonce: "n",
		Machine: Machine{MemoryBytes: 256 << 20, CPUs: 1, RAMFile: true, Accel: "tcg", Kernel: "6.1",
			KernelDigest: digest.FromString("vmlinux"), QEMU: "7.2", QEMUDigest: digest.FromString("qemu")}}}
	return c
}

// TestParseConfigMemory: a memory snapshot's record is checked as the
// rest: its blobs of their media types, a machine of sane size, layer
// devices among its lineage's, a kernel, a QEMU and a nonce; and GC
// keeps its blobs.
func TestParseConfigMemory(t *testing.T) {
	const size = 3 << 20
	b, _ := json.Marshal(memoryConfig(size))
	if _, err := ParseConfig(b, size); err != nil {
		t.Fatalf("a good memory config: %v", err)
	}
	for what, c := range map[string]func(*Memory){
		"a state of another type":   func(m *Memory) { m.State.MediaType = MediaTypeLayer },
		"a disk without a digest":   func(m *Memory) { m.Disk.Digest = "" },
		"a RAM image of -1 bytes":   func(m *Memory) { m.RAM.Size = -1 },
		"a RAM image, no RAM file":  func(m *Memory) { m.RAMFile = false },
		"no RAM":                    func(m *Memory) { m.MemoryBytes = 0 },
		"2 PiB of RAM":              func(m *Memory) { m.MemoryBytes = 1 << 51 },
		"no vCPU":                   func(m *Memory) { m.CPUs = 0 },
		"a layer not in its lowers": func(m *Memory) { m.Layers = []Lower{{Ref: "other:1", Digest: digest.FromString("x")}} },
		"no layer":                  func(m *Memory) { m.Layers = nil },
		"no QEMU":                   func(m *Memory) { m.QEMUDigest = "" },
		"no nonce":                  func(m *Memory) { m.Nonce = "" },
	} {
		cfg := memoryConfig(size)
		c(cfg.Snapshot.Memory)
		b, _ := json.Marshal(cfg)
		_, err := ParseConfig(b, size)
		if !errdefs.IsDataLoss(err) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: %v", what, err)
		}
	}
	cb, _ := json.Marshal(memoryConfig(size))
	got, err := refs(ocispec.Descriptor{MediaType: MediaTypeConfig}, cb)
	if err != nil {
		t.Fatal(err)
	}
	kept := map[digest.Digest]bool{}
	for _, d := range got {
		kept[d.Digest] = true
	}
	for _, s := range []string{"state", "ram", "disk", "bb"} {
		if !kept[digest.FromString(s)] {
			t.Errorf("gc does not keep the memory snapshot's %s", s)
		}
	}
}
