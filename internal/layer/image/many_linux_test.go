package image_test

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer/image"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// BenchmarkSWEBenchImages imports 20 images built as SWE-bench's are:
// one Debian root and one toolchain layer that every image shares, then
// per image an environment layer (8 of a pool of 30 packages of 2 MiB,
// overlapping with its neighbours', as images' dependencies do) and a
// repository layer of its own (5 MiB). The content is random, so no
// compression hides a copy. It reports what the store keeps against
// the images' compressed sizes summed as a registry lists them, and
// against the unique file content of all 20 (target: <= 1.1x), with
// whole layers and with layers packed into shared chunks.
func BenchmarkSWEBenchImages(b *testing.B) {
	layertest.RequireRoot(b)
	debian, addr, regDir, l := benchImages(b)
	must := func(err error) {
		if err != nil {
			b.Fatal(err)
		}
	}
	const images, pool, perImage = 20, 30, 8
	must(l.Layer("", "base", func(root string) error {
		return exec.Command("cp", "-a", debian+"/.", root).Run()
	}))
	must(l.Layer("base", "base", func(root string) error {
		return layertest.RandomTree(filepath.Join(root, "opt/python"), "toolchain", 40, 1<<20)
	}))
	for i := range images {
		tag := fmt.Sprintf("task%02d", i)
		must(l.Layer("base", tag, func(root string) error {
			for k := range perImage {
				p := (i + k) % pool
				if err := layertest.RandomTree(filepath.Join(root, "opt/python/site-packages", fmt.Sprintf("pkg%02d", p)), fmt.Sprintf("pkg%d", p), 8, 256<<10); err != nil {
					return err
				}
			}
			return nil
		}))
		must(l.Layer(tag, tag, func(root string) error {
			return layertest.RandomTree(filepath.Join(root, "testbed"), tag, 20, 256<<10)
		}))
		must(l.Push(addr, "swe", tag))
	}
	// The unique file content of the 20, unpacked as umoci does.
	unique := map[[32]byte]int64{}
	var logical int64
	for i := range images {
		bundle := filepath.Join(b.TempDir(), "b")
		must(l.Unpack(fmt.Sprintf("task%02d", i), bundle))
		must(filepath.WalkDir(filepath.Join(bundle, "rootfs"), func(p string, d fs.DirEntry, err error) error {
			if err != nil || !d.Type().IsRegular() {
				return err
			}
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			unique[sha256.Sum256(data)] = int64(len(data))
			logical += int64(len(data))
			return nil
		}))
		os.RemoveAll(bundle)
	}
	var uniqueBytes int64
	for _, n := range unique {
		uniqueBytes += n
	}
	listed, err := layoutSizes(l.Dir, "task") // what a registry lists: each image's compressed size
	must(err)
	// Each store imports the 20, whole layers and then packed ones
	// (dsec layer dedup: chunks shared across layers).
	var stored, packed float64
	for range b.N {
		for _, dedup := range []bool{false, true} {
			dir := b.TempDir()
			s, err := store.Open(filepath.Join(dir, "store"))
			must(err)
			if dedup {
				must(s.SetDedup(true))
			}
			for i := range images {
				_, err := image.Import(context.Background(), s, mustParse(b, fmt.Sprintf("%s/swe:task%02d", addr, i)), image.Options{})
				must(err)
			}
			if dedup {
				packed += float64(du(b, dir))
			} else {
				stored += float64(du(b, dir))
			}
			os.RemoveAll(dir)
		}
	}
	stored /= float64(b.N)
	packed /= float64(b.N)
	b.ReportMetric(stored/1e6, "stored-MB")
	b.ReportMetric(packed/1e6, "packed-MB")
	b.ReportMetric(packed/float64(uniqueBytes), "packed/unique")
	b.ReportMetric(float64(listed)/1e6, "listed-MB")
	b.ReportMetric(float64(du(b, regDir))/1e6, "registry-MB")
	b.ReportMetric(float64(uniqueBytes)/1e6, "unique-MB")
	b.ReportMetric(float64(logical)/1e6, "logical-MB")
	b.ReportMetric(stored/float64(uniqueBytes), "stored/unique")
}

// layoutSizes sums the compressed sizes of the layers of the images an
// OCI layout tags with prefix, each image whole (as a registry lists
// their sizes).
func layoutSizes(dir, prefix string) (int64, error) {
	var index ocispec.Index
	if err := readJSON(filepath.Join(dir, "index.json"), &index); err != nil {
		return 0, err
	}
	var sum int64
	for _, d := range index.Manifests {
		if !strings.HasPrefix(d.Annotations[ocispec.AnnotationRefName], prefix) {
			continue
		}
		var m ocispec.Manifest
		if err := readJSON(filepath.Join(dir, "blobs", d.Digest.Algorithm().String(), d.Digest.Encoded()), &m); err != nil {
			return 0, err
		}
		for _, ly := range m.Layers {
			sum += ly.Size
		}
	}
	return sum, nil
}

func readJSON(path string, v any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}
