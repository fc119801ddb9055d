package sdk_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
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
// alone. Measured twice in each round: from a remote that keeps its
// layers whole (each layer's bytes fetched for it), and from one that
// packs them (a chunk fetched once per host, whichever layer holds it).
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
	// Another host imports both and pushes them to the shared remote:
	// one that keeps its layers whole, and one that packs them into
	// chunks shared across layers (dsec layer dedup on it).
	remotes := map[string]string{"whole": b.TempDir(), "packed": b.TempDir()}
	rs, err := store.Open(remotes["packed"])
	must(err)
	must(rs.SetDedup(true))
	s, err := store.Open(filepath.Join(b.TempDir(), "store"))
	must(err)
	imgs := map[string]*image.Image{}
	for _, tag := range tags {
		ref, err := image.ParseReference(addr + "/cold:" + tag)
		must(err)
		img, err := image.Import(ctx, s, ref, image.Options{})
		must(err)
		for _, dir := range remotes {
			target, err := layerremote.Open("dir://"+dir, layerremote.Options{})
			must(err)
			_, _, err = image.Push(ctx, s, target, ref, false, nil)
			must(err)
		}
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

	modes := []string{"whole", "packed"}
	took := map[string]time.Duration{}
	fetchedA, fetchedB := map[string]int64{}, map[string]int64{}
	served := map[string]int{} // fetchers the host ran: one per layer, or per chunk blob
	rss := map[string]int64{}  // what those running take once B's first exec is done
	read := "cat /opt/python/site-packages/*/* /testbed/* >/dev/null"
	for range b.N {
		for _, mode := range modes {
			root := b.TempDir()
			w := runtimetest.StartWorkerWith(b, root, runtimetest.Config{RemoteURL: "dir://" + remotes[mode]})
			c, err := sdk.New(sdk.Options{Root: root})
			must(err)
			first := func(tag string) time.Duration {
				t0 := time.Now()
				sb, err := c.Create(ctx, api.SandboxSpec{Image: addr + "/cold:" + tag, Pull: api.PullNever})
				must(err)
				res, err := sb.Exec(ctx, sdk.ExecOptions{Args: []string{"sh", "-c", read}})
				if err != nil || res.ExitCode != 0 {
					b.Fatalf("the first exec on %s (%s remote): %v %+v", tag, mode, err, res)
				}
				d := time.Since(t0)
				time.Sleep(time.Second) // what its reads started in the background is part of it
				if tag == "b" {         // the fetchers serving A's and B's layers now
					rss[mode] += fetcherRSS(root)
				}
				must(sb.Remove(ctx, true))
				return d
			}
			first("a")
			a := fetchedOn(b, root)
			took[mode] += first("b")
			fetchers, _ := filepath.Glob(filepath.Join(root, "cache", "*", "stats.json"))
			served[mode] = len(fetchers)
			fetchedA[mode] += a
			fetchedB[mode] += fetchedOn(b, root) - a
			w.Kill()
			runtimetest.Clean(root)
		}
	}
	n := float64(b.N)
	for _, mode := range modes {
		pre := ""
		if mode == "whole" {
			pre = "whole-"
		}
		b.ReportMetric(float64(took[mode].Microseconds())/1000/n, pre+"B-first-exec-ms")
		b.ReportMetric(float64(fetchedA[mode])/n/(1<<20), pre+"A-fetched-MiB")
		b.ReportMetric(float64(fetchedB[mode])/n/(1<<20), pre+"B-fetched-MiB")
		b.ReportMetric(float64(served[mode]), pre+"fetchers")
		b.ReportMetric(float64(rss[mode])/n/(1<<20), pre+"fetchers-RSS-MiB")
	}
	b.ReportMetric(float64(ownB)/(1<<20), "B-own-layers-MiB")
	b.ReportMetric(float64(unseen)/(1<<20), "B-unseen-MiB")
	b.ReportMetric(float64(fetchedB["packed"])/n/float64(unseen), "fetched/unseen")
}

// fetcherRSS is the resident memory of the fetchers root's worker runs.
func fetcherRSS(root string) (sum int64) {
	pids, _ := filepath.Glob(filepath.Join(root, "cache", "*", "fetcher.pid"))
	for _, p := range pids {
		b, _ := os.ReadFile(p)
		status, err := os.ReadFile(filepath.Join("/proc", strings.TrimSpace(string(b)), "status"))
		if err != nil {
			continue // exited
		}
		for _, line := range strings.Split(string(status), "\n") {
			if f := strings.Fields(line); len(f) == 3 && f[0] == "VmRSS:" {
				kb, _ := strconv.ParseInt(f[1], 10, 64)
				sum += kb << 10
			}
		}
	}
	return sum
}

// fetchedOn is what the lazy mounts of root's worker fetched so far, as
// their fetchers last counted it, and the metadata images of packed
// layers, which a mount reads whole.
func fetchedOn(b *testing.B, root string) int64 {
	var sum int64
	metas, _ := filepath.Glob(filepath.Join(root, "cache", "*", "meta.erofs"))
	for _, m := range metas {
		if fi, err := os.Stat(m); err == nil {
			sum += fi.Size()
		}
	}
	files, _ := filepath.Glob(filepath.Join(root, "cache", "*", "stats.json"))
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
