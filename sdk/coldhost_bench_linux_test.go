package sdk_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/image"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/lazy"
	layerremote "github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// BenchmarkColdHostImages: a host that ran a sandbox on image A makes
// one on image B. Both are built as SWE-bench's are: a Debian root and a
// toolchain layer (40 files of 1 MiB) both share, an environment layer
// each of 8 packages (8 files of 256 KiB), 7 of them the same bytes in
// both, and a repository layer each (20 files of 256 KiB); contents are
// random, so no compression hides a copy. Another host imported both
// and pushed them to the shared remote, which this host's worker mounts
// lazily (--pull never: the registry is never asked). Each first exec
// reads its environment's packages and its repository. Reported: B's
// create to first exec done, what the host fetched for it, the size of
// B's own layers (those A does not share), and what A did not have (the
// package and the repository only B holds): the target is to fetch that
// alone.
func BenchmarkColdHostImages(b *testing.B) {
	layertest.RequireRoot(b)
	ctx := context.Background()
	must := func(err error) {
		b.Helper()
		if err != nil {
			b.Fatal(err)
		}
	}
	debian, err := layertest.DebianRoot()
	must(err)
	exe, err := layertest.Registry()
	must(err)
	addr, stop, err := layertest.RunRegistry(exe, b.TempDir(), "")
	must(err)
	b.Cleanup(stop)
	l, err := layertest.NewLayout(filepath.Join(b.TempDir(), "layout"))
	must(err)
	const perEnv, pkgFiles, pkgFile, repoFiles, repoFile = 8, 8, 256 << 10, 20, 256 << 10
	must(l.Layer("", "base", func(root string) error { return exec.Command("cp", "-a", debian+"/.", root).Run() }))
	must(l.Layer("base", "base", func(root string) error {
		return layertest.RandomTree(filepath.Join(root, "opt/python"), "toolchain", 40, 1<<20)
	}))
	tags := []string{"a", "b"}
	for i, tag := range tags {
		must(l.Layer("base", tag, func(root string) error {
			for k := range perEnv {
				p := i + k // A: packages 0-7, B: 1-8
				if err := layertest.RandomTree(filepath.Join(root, "opt/python/site-packages", fmt.Sprintf("pkg%02d", p)), fmt.Sprintf("pkg%d", p), pkgFiles, pkgFile); err != nil {
					return err
				}
			}
			return nil
		}))
		must(l.Layer(tag, tag, func(root string) error {
			return layertest.RandomTree(filepath.Join(root, "testbed"), tag, repoFiles, repoFile)
		}))
		must(l.Push(addr, "cold", tag))
	}
	// Another host imports both and pushes them to the shared remote.
	shared := "dir://" + b.TempDir()
	s, err := store.Open(filepath.Join(b.TempDir(), "store"))
	must(err)
	target, err := layerremote.Open(shared, layerremote.Options{})
	must(err)
	imgs := map[string]*image.Image{}
	for _, tag := range tags {
		ref, err := image.ParseReference(addr + "/cold:" + tag)
		must(err)
		img, err := image.Import(ctx, s, ref, image.Options{})
		must(err)
		_, _, err = image.Push(ctx, s, target, ref, false, nil)
		must(err)
		imgs[tag] = img
	}
	var ownB int64 // the size of B's layers that A does not have
	shares := map[string]bool{}
	for _, lo := range imgs["a"].Layers {
		shares[lo.Digest.String()] = true
	}
	for _, lo := range imgs["b"].Layers {
		if !shares[lo.Digest.String()] {
			info, err := layer.Resolve(ctx, s, lo.Ref)
			must(err)
			ownB += info.Size
		}
	}
	unseen := int64(pkgFiles*pkgFile + repoFiles*repoFile) // B's one package of its own, its repository

	var took time.Duration
	var fetchedA, fetchedB int64
	read := "cat /opt/python/site-packages/*/* /testbed/* >/dev/null"
	for range b.N {
		root := b.TempDir()
		w := runtimetest.StartWorkerWith(b, root, runtimetest.Config{RemoteURL: shared})
		c, err := sdk.New(sdk.Options{Root: root})
		must(err)
		first := func(tag string) time.Duration {
			t0 := time.Now()
			sb, err := c.Create(ctx, api.SandboxSpec{Image: addr + "/cold:" + tag, Pull: api.PullNever})
			must(err)
			res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"sh", "-c", read}})
			if err != nil || res.ExitCode != 0 {
				b.Fatalf("the first exec on %s: %v %+v", tag, err, res)
			}
			d := time.Since(t0)
			time.Sleep(time.Second) // what its reads started in the background is part of it
			must(sb.Remove(ctx, true))
			return d
		}
		first("a")
		a := fetchedOn(b, root)
		took += first("b")
		fetchedA += a
		fetchedB += fetchedOn(b, root) - a
		w.Kill()
		runtimetest.Clean(root)
	}
	n := float64(b.N)
	b.ReportMetric(float64(took.Microseconds())/1000/n, "B-first-exec-ms")
	b.ReportMetric(float64(fetchedA)/n/(1<<20), "A-fetched-MiB")
	b.ReportMetric(float64(fetchedB)/n/(1<<20), "B-fetched-MiB")
	b.ReportMetric(float64(ownB)/(1<<20), "B-own-layers-MiB")
	b.ReportMetric(float64(unseen)/(1<<20), "B-unseen-MiB")
	b.ReportMetric(float64(fetchedB)/n/float64(unseen), "fetched/unseen")
}

// fetchedOn is what the lazy mounts of root's worker fetched so far, as
// their fetchers last counted it.
func fetchedOn(b *testing.B, root string) int64 {
	files, _ := filepath.Glob(filepath.Join(root, "cache", "*", "stats.json"))
	var sum int64
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			b.Fatal(err)
		}
		var st lazy.Stats
		if err := json.Unmarshal(data, &st); err != nil {
			b.Fatal(err)
		}
		sum += st.BytesFetched
	}
	return sum
}
