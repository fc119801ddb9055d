//go:build !front

package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// dedupResult is what dsec layer dedup prints with --json.
type dedupResult struct {
	On       bool              `json:"on"`
	Packed   int               `json:"packed"`   // layers packed (or unpacked) now
	Unpacked int               `json:"unpacked"` // layers left whole: not packable
	Store    store.PackedStats `json:"store"`
}

func (a *app) layerDedup() *cobra.Command {
	var off, asJSON bool
	var remoteURL string
	cmd := &cobra.Command{
		Use:   "dedup",
		Short: "Store each layer's file data once across layers, in chunks shared by content",
		Long: `Dedup turns deduplication on for the store: every tagged layer it holds is packed now,
and every layer built, imported, pulled or snapshotted from then on as it is added. A packed
layer's files are split into 64 KiB chunks keyed by their sha256; a chunk another layer holds
already is not stored again (the same wheel, library or source file in two unrelated images is
stored once), and a chunk of zeros is not stored at all. The layer keeps a small metadata image whose files
point into the shared chunk blobs, and the kernel mounts that image with the blobs as its
devices: a sandbox reads the layer as before, and the page cache holds a shared chunk once.

A layer's digest, its pushes and its exports stay those of its whole image, which is made
again from the chunks (and checked) when it is read whole; a microVM, which maps each layer as
one file, keeps such a copy per layer and host. A layer reads the chunk blobs of at most 63
others (each is a device of its mount): a chunk only further ones hold is stored again. With
--off, every packed tagged layer is made whole again (which needs the free space of their whole
images) and new layers stay whole; dsec layer gc then removes the chunks no layer uses.
dsec layer du shows what packing saves.

With --remote dir:///PATH, the store of that dir: remote is packed instead (the path all hosts
mount): layers and images pushed to it from then on are packed there too, and a host that mounts
them lazily fetches and caches each chunk blob once, whichever layers read it. A registry keeps
its layers whole: it holds the image a digest names.

` + exitCodesHelp,
		Example: `  dsec layer dedup
  dsec layer du
  dsec layer dedup --off --json
  dsec layer dedup --remote dir:///mnt/3fs/dsec`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			res, err := a.dedup(cmd.Context(), remoteURL, off)
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(res)
			}
			return a.printDedup(res, off)
		},
	}
	cmd.Flags().BoolVar(&off, "off", false, "make every packed layer whole again and stop packing new ones")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.Flags().StringVar(&remoteURL, "remote", "", "pack the store of this dir: remote (dir:///PATH, or a configured name) instead of the root's")
	return cmd
}

// dedup packs every tagged layer of the store (off: makes every packed
// one whole again) and sets whether new layers are packed.
func (a *app) dedup(ctx context.Context, remoteURL string, off bool) (res dedupResult, err error) {
	s, err := a.dedupStore(remoteURL)
	if err != nil {
		return res, err
	}
	ls, err := layer.List(ctx, s)
	if err != nil {
		return res, err
	}
	seen := map[digest.Digest]bool{}
	var todo []digest.Digest
	for _, l := range ls {
		if !seen[l.Digest] && s.Packed(l.Digest) == off {
			seen[l.Digest] = true
			todo = append(todo, l.Digest)
		}
	}
	if !off {
		// On first, so a build that runs meanwhile packs its layer.
		if err := s.SetDedup(true); err != nil {
			return res, err
		}
	} else if err := s.SetDedup(false); err != nil {
		return res, err
	}
	var bar *progressbar.ProgressBar
	if a.showProgress() && len(todo) > 0 {
		what := "packing layers"
		if off {
			what = "making layers whole"
		}
		bar = progressbar.NewOptions(len(todo), progressbar.OptionSetWriter(a.stderr),
			progressbar.OptionSetDescription(what), progressbar.OptionThrottle(100*time.Millisecond),
			progressbar.OptionClearOnFinish())
	}
	res.On = !off
	for _, d := range todo {
		if off {
			err = s.Unpack(ctx, d)
		} else {
			_, err = s.Pack(ctx, d)
		}
		if bar != nil {
			bar.Add(1)
		}
		if err != nil {
			if off {
				return res, fmt.Errorf("make layer %s whole: %w", d, err)
			}
			a.log.Warn("layer kept whole: it could not be packed", "digest", d, "err", err)
			res.Unpacked++
			continue
		}
		res.Packed++
	}
	if bar != nil {
		bar.Finish()
	}
	res.Store, err = s.PackStats()
	return res, err
}

// printDedup says what dedup did.
func (a *app) printDedup(res dedupResult, off bool) error {
	var err error
	st := res.Store
	if off {
		_, err = fmt.Fprintf(a.stdout, "made %d layers whole; new layers stay whole (dsec layer gc removes the chunks no layer uses)\n", res.Packed)
		return err
	}
	fmt.Fprintf(a.stdout, "packed %d layers now", res.Packed)
	if res.Unpacked > 0 {
		fmt.Fprintf(a.stdout, ", %d kept whole (compressed, or not images dsec built: see the log)", res.Unpacked)
	}
	_, err = fmt.Fprintf(a.stdout, "; %d packed layers hold %s of file data, %s of it stored once in %s of chunk blobs (%s shared, %s zeros); new layers are packed as they are added\n",
		st.Layers, humanBytes(st.Logical), humanBytes(st.Logical-st.Shared-st.Holes), humanBytes(st.Chunks), humanBytes(st.Shared), humanBytes(st.Holes))
	return err
}

// dedupStore is the store dedup packs: the root's, or a dir: remote's.
func (a *app) dedupStore(remoteURL string) (*store.Store, error) {
	if remoteURL == "" {
		return a.openStore()
	}
	u := remoteURL
	if named, ok := a.cfg.Remotes[remoteURL]; ok && !strings.Contains(remoteURL, "://") {
		u = named // a configured remote's name
	}
	loc, err := remote.ParseLocation(u)
	if err != nil {
		return nil, fmt.Errorf("--remote %s: %w", remoteURL, errdefs.ErrInvalidArgument)
	}
	if loc.Scheme != remote.SchemeDir || loc.URL.Host != "" || !filepath.IsAbs(loc.Path) {
		return nil, fmt.Errorf("--remote %s: only a dir: remote's store packs its layers (a registry holds the image a digest names): give dir:///PATH: %w", remoteURL, errdefs.ErrInvalidArgument)
	}
	if _, err := os.Stat(filepath.Join(loc.Path, "blobs")); err != nil {
		return nil, fmt.Errorf("--remote %s: no store there (%v): push a layer to it first (dsec layer push): %w", remoteURL, err, errdefs.ErrNotFound)
	}
	return store.Open(loc.Path)
}
