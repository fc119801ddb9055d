//go:build !front

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"github.com/spf13/cobra"

	"github.com/dsec-project/dsec/internal/durable"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/lazy"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/mount"
)

type mountResult struct {
	Ref    string        `json:"name"`
	Digest digest.Digest `json:"digest"`
	Dir    string        `json:"dir"`
	Mode   string        `json:"mode"` // local: the store's blob, file-backed; lazy: fetched on demand; lazy-packed: its chunk blobs fetched on demand
	Remote string        `json:"remote,omitempty"`
}

func (a *app) layerMount() *cobra.Command {
	var from string
	var insecure, asJSON, record bool
	cmd := &cobra.Command{
		Use:   "mount REF DIR [--from REMOTE]",
		Short: "Mount a layer read-only, fetching a remote layer's bytes only when read",
		Long: `Mount mounts layer REF (NAME[:VERSION]) read-only on DIR with the kernel's EROFS.

A layer in the local store is mounted straight from its blob (file-backed, no loop device).
With --from REMOTE (dir:///PATH, oci://HOST/REPO or a configured name) the layer is mounted
lazily: block 0 and the metadata region are fetched first, so listing and stat never wait,
and file data is fetched on first read (what a read misses, in 64 KiB windows, with more
read ahead where reads go on), checked against the layer's window table and kept in the host cache (<root>/cache, bounded by cache.max_bytes). With
--record, the windows the run reads become the layer's prefetch hint on this host (later
fetchers of the layer fetch them in the background as soon as they start) and the byte
ranges it reads its access profile (dsec layer profile). One
fetcher process per layer serves every mount of it and outlives this command; it exits
when the last mount is gone. If the fetcher dies or the remote fails, reads fail with EIO:
never zeros, never stale bytes.

A layer that a dir: remote keeps packed (dsec layer dedup --remote) is mounted from its small
metadata image, fetched whole, with its chunk blobs as devices: one fetcher and one cache per
chunk blob serve every layer that reads it, so data two layers share is fetched once on this
host (mode lazy-packed; dsec layer stats sums its chunk blobs' figures). --record mounts the
whole image instead.

` + exitCodesHelp,
		Example: `  dsec layer mount debian/bookworm:2026.11 /mnt/base
  dsec layer mount myrepo:abc123 /mnt/ws --from dir:///mnt/3fs/dsec
  dsec layer umount /mnt/ws`,
		Args: exactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ref, err := layer.ParseRef(args[0])
			if err != nil {
				return usageError{err}
			}
			dir, err := filepath.Abs(args[1])
			if err != nil {
				return err
			}
			if st, err := os.Stat(dir); err != nil || !st.IsDir() {
				return fmt.Errorf("mount point %s is not a directory: create it first: %w", dir, errdefs.ErrNotFound)
			}
			if on, err := mount.IsMountPoint(dir); err != nil {
				return err
			} else if on {
				return fmt.Errorf("%s is a mount point already (a layer mounted there?): dsec layer umount %s first, or choose an empty directory: %w", dir, dir, errdefs.ErrAlreadyExists)
			}
			res := mountResult{Ref: ref.String(), Dir: dir}
			if from == "" {
				s, err := a.openStore()
				if err != nil {
					return err
				}
				info, err := layer.Resolve(cmd.Context(), s, ref.String())
				if errdefs.IsNotFound(err) {
					return fmt.Errorf("no layer %s in the store (dsec layer ls lists them); to mount a remote layer lazily, add --from REMOTE: %w", ref, errdefs.ErrNotFound)
				} else if err != nil {
					return err
				}
				if err := s.MountLayer(info.Digest, dir); err != nil {
					return err
				}
				res.Digest, res.Mode = info.Digest, "local"
			} else if err := a.mountLazy(cmd.Context(), &res, ref, from, insecure, record); err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(res)
			}
			_, err = fmt.Fprintln(a.stdout, res.Digest)
			return err
		},
	}
	cmd.Flags().StringVar(&from, "from", "", "mount lazily from this remote (URL or configured name)")
	cmd.Flags().BoolVar(&insecure, "insecure", false, "no longer needed: a registry on localhost is spoken to over plain HTTP without it")
	cmd.Flags().BoolVar(&record, "record", false, "record what this run reads: the layer's prefetch hint and access profile on this host")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

// mountLazy mounts ref on res.Dir from remote from, through a fetcher
// process that outlives the command.
func (a *app) mountLazy(ctx context.Context, res *mountResult, ref layer.Ref, from string, insecure, record bool) error {
	target, err := a.openRemote(from, insecure)
	if err != nil {
		return err
	}
	l, err := remote.Describe(ctx, target, ref)
	if err != nil {
		return err
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	spec := lazy.SpecFor(ref.String(), l, target, insecure, a.cfg.Cache.tuning())
	spec.Record = record
	start := lazy.Start{Path: exe, Args: []string{"--root", a.cfg.Root, "--log-level", "info", "layer", "fetcher"}}
	res.Digest, res.Mode, res.Remote = l.Blob.Digest, "lazy", target.String()
	if d, ok := target.(*remote.Dir); ok && !record && d.Store().Packed(l.Blob.Digest) {
		// A dir: remote that packs: each chunk blob fetched
		// once on this host (a recording needs the whole image).
		err = lazy.MountPacked(ctx, a.cfg.Root, d.Store(), spec, res.Dir, start)
		res.Mode = "lazy-packed"
	} else {
		err = lazy.Mount(ctx, a.cfg.Root, spec, l.Windows, res.Dir, start)
	}
	return err
}

func (a *app) layerUmount() *cobra.Command {
	return &cobra.Command{
		Use:     "umount DIR",
		Aliases: []string{"unmount"},
		Short:   "Unmount a layer; its fetcher exits when no mount uses it",
		Example: `  dsec layer umount /mnt/ws`,
		Args:    exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			dir, err := filepath.Abs(args[0])
			if err != nil {
				return err
			}
			err = lazy.Unmount(dir)
			if errors.Is(err, syscall.EINVAL) {
				return fmt.Errorf("%s is not a mount point: %w", dir, errdefs.ErrNotFound)
			}
			return err
		},
	}
}

func (a *app) layerStats() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "stats REF",
		Short: "Show what a lazily mounted layer fetched and served from the host cache",
		Long: `Stats prints the counters of a layer's fetcher since it started: bytes_total (the image
size), bytes_fetched, windows_fetched, cache_hits, fetch_errors, bytes_cached and evictions.
REF is NAME[:VERSION] or the layer digest.

` + exitCodesHelp,
		Example: `  dsec layer stats myrepo:abc123 --json`,
		Args:    exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			d, name, err := a.cachedLayer(args[0])
			if err != nil {
				return err
			}
			st, err := lazy.ReadStats(a.cfg.Root, d)
			if err != nil {
				return fmt.Errorf("layer %s has no fetcher statistics yet: %w", args[0], errdefs.ErrNotFound)
			}
			out := struct {
				Ref    string        `json:"name"`
				Digest digest.Digest `json:"digest"`
				*lazy.Stats
			}{name, d, st}
			if asJSON {
				return a.printJSON(out)
			}
			fmt.Fprintf(a.stdout, "%s %s\nfetched %s in %d windows (%d requests) of %s, %d cache hits, %d fetch errors, %s cached, %d evictions\n",
				name, d, humanBytes(st.BytesFetched), st.WindowsFetched, st.Requests, humanBytes(st.BytesTotal), st.CacheHits, st.FetchErrors,
				humanBytes(st.BytesCached), st.Evictions)
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func (a *app) layerProfile() *cobra.Command {
	var out string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "profile REF [-o FILE]",
		Short: "Print the files a recorded run of a lazily mounted layer read, in first read order",
		Long: `Profile turns what the last run recorded on this host (dsec layer mount --record, until
its fetcher exited) into the files it read, in the order it first read them, one a line:
the path for a file read whole, else the path, a tab and the blocks read (START+COUNT in
4 KiB blocks of the file, comma-separated). That is the profile dsec layer build --order
takes: rebuilt with it, the layer holds exactly those blocks together at the front of its
data (its hot region), so the same kind of run fetches far fewer windows and every host
that mounts the layer prefetches them. REF is NAME[:VERSION] or the layer digest.

` + exitCodesHelp,
		Example: `  dsec layer mount debian:12 /mnt/base --from dir:///mnt/3fs/dsec --record
  # ... run the agent step against /mnt/base, then:
  dsec layer umount /mnt/base
  dsec layer profile debian:12 -o step.profile`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			d, _, err := a.cachedLayer(args[0])
			if err != nil {
				return err
			}
			hot, err := lazy.Profile(a.cfg.Root, d)
			if err != nil {
				return err
			}
			b := layer.FormatProfile(hot)
			if asJSON {
				j, _ := json.MarshalIndent(profileJSON(hot), "", "  ")
				b = append(j, '\n')
			}
			if out == "" {
				_, err = a.stdout.Write(b)
				return err
			}
			return durable.WriteFile(out, b, 0o600)
		},
	}
	cmd.Flags().StringVarP(&out, "output", "o", "", "write to FILE (replaced whole) instead of stdout")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON array of {path, blocks: [[start, count], ...]}")
	return cmd
}

// profileJSON is a profile as JSON: blocks are [start, count] pairs.
func profileJSON(hot []erofs.Hot) any {
	type entry struct {
		Path   string      `json:"path"`
		Blocks [][2]uint64 `json:"blocks,omitempty"`
	}
	out := make([]entry, 0, len(hot))
	for _, h := range hot {
		e := entry{Path: h.Path}
		for _, r := range h.Blocks {
			e.Blocks = append(e.Blocks, [2]uint64{r.Start, r.Count})
		}
		out = append(out, e)
	}
	return out
}

// readProfile reads an access profile file for --order.
func readProfile(p string) ([]erofs.Hot, error) {
	f, err := os.Open(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("--order: no file %s (dsec layer profile writes one): %w", p, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("--order: %w", err)
	}
	defer f.Close()
	hot, err := layer.ParseProfile(f)
	if err != nil {
		return nil, fmt.Errorf("--order %s: %w", p, err)
	}
	return hot, nil
}

// cachedLayer finds the digest of a layer in the host cache by name or
// digest.
func (a *app) cachedLayer(ref string) (digest.Digest, string, error) {
	ents, _ := os.ReadDir(filepath.Join(a.cfg.Root, "cache"))
	for _, e := range ents {
		var spec lazy.Spec
		b, err := os.ReadFile(filepath.Join(a.cfg.Root, "cache", e.Name(), "layer.json"))
		if err != nil {
			// A layer mounted packed: its name and digest are there.
			b, err = os.ReadFile(filepath.Join(a.cfg.Root, "cache", e.Name(), "packed.json"))
		}
		if err != nil || json.Unmarshal(b, &spec) != nil || spec.Chunk {
			continue
		}
		if spec.Ref == ref || spec.Digest.String() == ref || spec.Digest.Encoded() == ref {
			return spec.Digest, spec.Ref, nil
		}
	}
	err := fmt.Errorf("layer %s was never mounted lazily on this host: %w", ref, errdefs.ErrNotFound)
	if s, serr := a.openStore(); serr == nil {
		err = asImage(context.Background(), s, ref, err)
	}
	return "", "", err
}

func (a *app) layerFetcher() *cobra.Command {
	var idle time.Duration
	cmd := &cobra.Command{
		Use:    "fetcher CACHE-DIR",
		Short:  "Serve a lazily mounted layer (started by dsec layer mount)",
		Hidden: true,
		Args:   exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			// Not cmd.Context(): SIGTERM cancels that, and for a fetcher
			// SIGTERM means "exit soon if no mount uses the layer", which Serve
			// decides itself.
			err := lazy.Serve(context.Background(), args[0], idle, a.log)
			if errors.Is(err, lazy.ErrBusy) {
				return nil
			}
			return err
		},
	}
	cmd.Flags().DurationVar(&idle, "idle", 5*time.Second, "exit after no mount used the layer for this long")
	return cmd
}
