//go:build !front

package main

import (
	"context"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/image"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/rootdir"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/units"
)

func (a *app) layerCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:         "layer",
		Short:       "Build and manage EROFS layers in the local store",
		Annotations: map[string]string{localAnnotation: "true"},
		Long: `A layer is one EROFS image (media type application/vnd.erofs.layer.v1, the type
containerd's EROFS snapshotter mounts natively; its files uncompressed unless it was built
with --compress) tagged NAME:VERSION in the store at
<root>/store, an OCI image layout. A sandbox stacks a toolkit layer over a workspace layer
over a base layer.`,
	}
	cmd.AddCommand(a.layerBuild(), a.layerList(), a.layerInspect(), a.layerRemove(), a.layerGC(), a.layerDu(),
		a.layerCopyCommand(true), a.layerCopyCommand(false), a.layerMount(), a.layerUmount(), a.layerStats(), a.layerProfile(),
		a.layerFetcher(), a.layerDedup())
	for _, c := range cmd.Commands() {
		switch c.Name() {
		case "inspect", "rm", "push", "mount", "stats", "profile":
			c.ValidArgsFunction = a.completeRefs
		}
	}
	return cmd
}

// openStore opens the root's store, the root made private first (a
// layer build may be the first thing done on a root).
func (a *app) openStore() (*store.Store, error) {
	if _, err := rootdir.Secure(a.cfg.Root); err != nil {
		return nil, err
	}
	return store.Open(a.storeDir())
}

type buildFlags struct {
	kind, tag, order, platform, window string
	force, json, compress              bool
}

func (a *app) layerBuild() *cobra.Command {
	var f buildFlags
	cmd := &cobra.Command{
		Use:   "build SRC --kind base|workspace|toolkit -t NAME:VERSION",
		Short: "Build an EROFS layer from a directory, a tar stream or an image archive",
		Long: `Build converts SRC into a deterministic EROFS layer and tags it in the store.

SRC is one of:
  DIR        a directory tree, walked without following symlinks
  FILE       a tar, tar.gz or tar.zst archive, converted as a stream (nothing is extracted)
  FILE       an image archive (docker save output or an OCI image layout tarball),
             flattened in layer order with whiteouts applied
  -          a tar, tar.gz or tar.zst stream on standard input
  docker://IMAGE, oci://HOST[:PORT]/REPO[:TAG|@DIGEST]
             an image in a registry, imported as dsec image pull does: one EROFS layer
             for each of its layers (--kind and -t are not needed; the image is named by
             its reference), layers the store holds already not fetched again

Modes, owners, nanosecond mtimes, every xattr, hard links (one inode), symlinks, devices,
fifos, sockets and sparse files survive. AUFS whiteouts (.wh.NAME, .wh..wh..opq) in a plain
tar become overlayfs whiteouts (a 0/0 character device, trusted.overlay.opaque=y), so the
layer stacks under overlayfs as the tar meant. The same tree always gives the same digest.

--order FILE (an access profile, as dsec layer profile writes it: a path a line, with the
blocks read after a tab) puts that data first, in that order, ahead of everything else:
what a recorded run read becomes one contiguous range at the front of the image (the
layer's hot region; a file read in part is split, its other blocks stay behind), so a
lazy mount fetches it in few windows and prefetches it in the background on every host.
Only a directory source can be ordered.

--compress stores the files of a stream, an archive or a registry image LZ4-compressed where
that saves a block (a directory's are laid out before they are read, and stay as they are):
fewer bytes written, stored and fetched lazily, for the CPU of decompressing what is read.
A store that packs layers into shared chunks (dsec layer dedup) keeps them uncompressed.

Stdout gets the layer digest (or JSON with --json); progress goes to stderr.

` + exitCodesHelp,
		Example: `  # a base layer from a debootstrap'd tree
  dsec layer build ./rootfs --kind base -t debian/bookworm:2026.11

  # a workspace from a tarball on stdin, as JSON
  git archive HEAD | dsec layer build - --kind workspace -t myrepo:abc123 --json

  # import an image from a registry, one EROFS layer per image layer
  dsec layer build docker://python:3.12

  # the same, its files compressed
  dsec layer build docker://python:3.12 --compress

  # flatten an image saved with docker save
  dsec layer build ./python.tar --kind base -t python:3.12

  # lay out a base by what a recorded agent step read (see dsec layer profile)
  dsec layer profile debian/bookworm:2026.11 -o step.profile
  dsec layer build ./rootfs --kind base -t debian/bookworm:2026.11p --order step.profile`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.buildLayer(cmd, args[0], f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.kind, "kind", "", "layer kind: base, workspace or toolkit (required)")
	fl.StringVarP(&f.tag, "tag", "t", "", "tag NAME[:VERSION] for the layer, VERSION defaulting to latest (required)")
	fl.BoolVar(&f.force, "force", false, "replace an existing tag that names other content")
	fl.StringVar(&f.order, "order", "", "lay out the data the access profile FILE names first, in its order (see dsec layer profile)")
	fl.BoolVar(&f.json, "json", false, "print the layer as JSON (digest, size, name, kind, metadata, ...)")
	fl.StringVar(&f.window, "window-size", "64KiB", "the window a lazy mount fetches and checks at least: a power of two from 4KiB to 4MiB (larger for a remote far away, fewer round trips)")
	fl.StringVar(&f.platform, "platform", "", "OS/ARCH[/VARIANT] to take from a multi-platform image (docker:// and oci:// sources)")
	fl.BoolVar(&f.compress, "compress", false, "store the files LZ4-compressed where that saves a block (a stream, an archive or a registry image; not a directory)")
	_ = cmd.RegisterFlagCompletionFunc("kind", func(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
		return []string{"base", "workspace", "toolkit"}, cobra.ShellCompDirectiveNoFileComp
	})
	return cmd
}

// buildLayer is dsec layer build of src: an image from a registry, or a
// layer converted from a directory, an archive or a stream.
func (a *app) buildLayer(cmd *cobra.Command, src string, f buildFlags) error {
	if strings.HasPrefix(src, "docker://") || strings.HasPrefix(src, "oci://") {
		if cmd.Flags().Changed("window-size") {
			return usageError{fmt.Errorf("--window-size is for a layer built from a directory or an archive: an image's layers take the default")}
		}
		return a.buildFromRegistry(cmd, src, f)
	}
	if f.kind == "" {
		return usageError{fmt.Errorf("layer build needs --kind base, workspace or toolkit")}
	}
	kind, err := layer.ParseKind(f.kind)
	if err != nil {
		return usageError{err}
	}
	if f.tag == "" {
		return usageError{fmt.Errorf("layer build needs a tag: -t NAME:VERSION")}
	}
	ref, err := layer.ParseRef(f.tag)
	if err != nil {
		return usageError{err}
	}
	s, err := a.openStore()
	if err != nil {
		return err
	}
	if err := compressible(s, f.compress); err != nil {
		return err
	}
	opts := layer.BuildOptions{Source: src, Stdin: a.stdin, Kind: kind, Ref: ref, Force: f.force, Compress: f.compress}
	if opts.WindowSize, err = units.ParseBytes(f.window); err == nil {
		err = layer.CheckWindowSize(opts.WindowSize)
	}
	if err != nil {
		return usageError{fmt.Errorf("--window-size %s: use a power of two from 4KiB to 4MiB", f.window)}
	}
	if f.order != "" {
		if opts.Order, err = readProfile(f.order); err != nil {
			return err
		}
	}
	var bar *progressbar.ProgressBar
	if a.showProgress() {
		bar = progressbar.NewOptions64(-1, progressbar.OptionSetWriter(a.stderr),
			progressbar.OptionSetDescription("converting "+src), progressbar.OptionShowBytes(true),
			progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionClearOnFinish())
		opts.Progress = barProgress{bar}
	}
	start := time.Now()
	info, err := layer.Build(cmd.Context(), s, opts)
	if bar != nil {
		bar.Finish()
	}
	if err != nil {
		return err
	}
	a.log.Info("built layer", "name", info.Ref, "digest", info.Digest, "size", info.Size,
		"files", info.Files, "seconds", time.Since(start).Seconds())
	if f.json {
		return a.printJSON(info)
	}
	_, err = fmt.Fprintln(a.stdout, info.Digest)
	return err
}

// buildFromRegistry imports a docker:// or oci:// source as an image.
func (a *app) buildFromRegistry(cmd *cobra.Command, src string, f buildFlags) error {
	if f.kind != "" && f.kind != string(layer.KindBase) || f.tag != "" || f.order != "" {
		return usageError{fmt.Errorf("%s is an image: its layers are base layers named by their digests, and the image by its reference: drop --kind, -t and --order", src)}
	}
	img, err := a.pullImage(cmd, src, f.platform, f.compress)
	if err != nil {
		return err
	}
	if f.json {
		return a.printJSON(img)
	}
	_, err = fmt.Fprintln(a.stdout, strings.Join(img.Refs(), "\n"))
	return err
}

type barProgress struct{ bar *progressbar.ProgressBar }

func (b barProgress) Add(n int64) { _ = b.bar.Add64(n) }

func (a *app) layerList() *cobra.Command {
	var asJSON, all bool
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the layers in the store",
		Long: `Ls lists the layers in the store. The layers of imported images (tagged oci/sha256/CHAINID)
are left out unless --all: dsec image ls lists the images.`,
		Example: `  dsec layer ls
  dsec layer ls --all --json | jq -r '.[].name'`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := a.openStore()
			if err != nil {
				return err
			}
			listed, err := layer.List(cmd.Context(), s)
			if err != nil {
				return err
			}
			shown := listed[:0:0]
			for _, i := range listed {
				if all || !image.IsLayerTag(i.Ref) {
					shown = append(shown, i)
				}
			}
			if hidden := len(listed) - len(shown); hidden > 0 && !asJSON {
				fmt.Fprintf(a.stderr, "%d layers of imported images not shown (--all shows them; dsec image ls lists the images)\n", hidden)
			}
			if asJSON {
				return a.printJSON(shown)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tKIND\tDIGEST\tSIZE\tFILES\tCREATED")
			for _, i := range shown {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\n", i.Ref, i.Kind, i.Digest.Encoded()[:12],
					humanBytes(i.Size), i.Files, createdAt(i.Created, time.DateTime))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON array")
	cmd.Flags().BoolVarP(&all, "all", "a", false, "list the layers of imported images too")
	return cmd
}

func (a *app) layerInspect() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "inspect REF",
		Short: "Show a layer's digest, size, kind, metadata range and file count",
		Long: `Inspect shows one layer. REF is NAME[:VERSION] (VERSION defaults to latest), or the layer's
digest: sha256:HEX or a unique prefix of at least 12 hex digits.

` + exitCodesHelp,
		Example: `  dsec layer inspect debian/bookworm:2026.11
  dsec layer inspect --json 3f2a9c81d0e4`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.openStore()
			if err != nil {
				return err
			}
			i, err := layer.Resolve(cmd.Context(), s, args[0])
			if err != nil {
				return asImage(cmd.Context(), s, args[0], err)
			}
			if asJSON {
				return a.printJSON(i)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 1, ' ', 0)
			fmt.Fprintf(tw, "name:\t%s\n", i.Ref)
			fmt.Fprintf(tw, "kind:\t%s\n", i.Kind)
			fmt.Fprintf(tw, "digest:\t%s\n", i.Digest)
			fmt.Fprintf(tw, "size:\t%d (%s)\n", i.Size, humanBytes(i.Size))
			fmt.Fprintf(tw, "files:\t%d (%d inodes)\n", i.Files, i.Inodes)
			if i.Compressed > 0 {
				fmt.Fprintf(tw, "compressed files:\t%d (LZ4)\n", i.Compressed)
			}
			fmt.Fprintf(tw, "metadata:\tbytes %d-%d (%s)\n", i.Metadata.Offset, i.Metadata.Offset+i.Metadata.Size, humanBytes(i.Metadata.Size))
			fmt.Fprintf(tw, "windows:\t%d of %s, table %s\n", i.Windows.Count, humanBytes(i.Windows.Size), i.Windows.Digest)
			fmt.Fprintf(tw, "source:\t%s\n", i.Source)
			fmt.Fprintf(tw, "created:\t%s\n", createdAt(i.Created, time.RFC3339))
			fmt.Fprintf(tw, "manifest:\t%s\n", i.Manifest)
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func (a *app) layerRemove() *cobra.Command {
	var asJSON, force bool
	cmd := &cobra.Command{
		Use:     "rm REF...",
		Aliases: []string{"remove"},
		Short:   "Remove layer tags; dsec layer gc frees their blobs",
		Long: `Rm removes the tags NAME[:VERSION]. The blobs stay until dsec layer gc, so a layer that is
mounted or being pushed keeps its bytes. It refuses (exit 8) to remove a layer a snapshot
stands on, a sandbox of this root runs on or an image has, unless --force: then only the tag goes, and
gc keeps the layer, untagged, while they stand on it (they find it by its digest).

` + exitCodesHelp,
		Example: `  dsec layer rm myrepo:abc123 && dsec layer gc`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError{fmt.Errorf("layer rm needs at least one NAME:VERSION")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.openStore()
			if err != nil {
				return err
			}
			users := map[string][]string{}
			if us, err := runtime.SnapUsers(a.cfg.Root); err == nil {
				for _, u := range us {
					users["sandbox "+u.Name] = u.Digests
				}
			}
			imgs, err := image.List(cmd.Context(), s)
			if err != nil {
				return err
			}
			for _, img := range imgs {
				for _, l := range img.Layers {
					users["image "+img.Reference] = append(users["image "+img.Reference], l.Digest.String())
				}
			}
			var removed []*layer.Info
			for _, ref := range args {
				if !force {
					on, err := layer.StoodOn(cmd.Context(), s, ref, users)
					if err != nil {
						return err
					}
					if len(on) > 0 {
						return fmt.Errorf("layer %s is stood on by %s: remove those first, or --force (the tag goes; gc keeps the layer, untagged, while they stand on it): %w",
							ref, strings.Join(on, ", "), errdefs.ErrFailedPrecondition)
					}
				}
				i, err := layer.Remove(cmd.Context(), s, ref)
				if err != nil {
					return err
				}
				removed = append(removed, i)
				if !asJSON {
					fmt.Fprintln(a.stdout, i.Ref)
				}
			}
			if asJSON {
				return a.printJSON(removed)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the removed layers as JSON")
	cmd.Flags().BoolVarP(&force, "force", "f", false, "remove it even if snapshots or sandboxes stand on it")
	return cmd
}

func (a *app) layerGC() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "gc",
		Short: "Delete blobs that no tag reaches and leftovers of interrupted builds and pulls",
		Long: `Gc marks every blob reachable from a tag (manifest, config, EROFS image, window table),
from the lineage of every snapshot it keeps (the layers it stands on), from the layers
every sandbox of this root runs on and from what creates under way hold (their leases in
the store, which die with the process that took them), with the manifest, config and
window table of every image it keeps, and deletes the rest, with the files that killed
builds left in the store's ingest directory and the bytes that interrupted pulls kept to
take up later (unless a pull holds them now: a pull after gc starts over). A layer removed with rm --force that a
snapshot or sandbox stands on is kept, untagged, and still found by its digest. It waits
for running builds and for creates resolving their layers.

` + exitCodesHelp,
		Example: `  dsec layer gc --json`,
		Args:    exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := a.openStore()
			if err != nil {
				return err
			}
			keep := func() ([]digest.Digest, error) { // read once gc holds the store
				us, err := runtime.SnapUsers(a.cfg.Root)
				if err != nil {
					return nil, fmt.Errorf("gc: list the sandboxes whose layers it must keep: %w", err)
				}
				var keep []digest.Digest
				for _, u := range us {
					for _, d := range u.Digests {
						keep = append(keep, digest.Digest(d))
					}
				}
				return keep, nil
			}
			res, err := layer.GC(cmd.Context(), s, keep)
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(res)
			}
			_, err = fmt.Fprintf(a.stdout, "removed %d blobs and %d leftovers of interrupted builds and pulls (%s)\n", res.Blobs, res.Ingests, humanBytes(res.Bytes))
			return err
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func (a *app) layerDu() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "du",
		Short: "Show what the store holds: each image and layer, logical bytes and stored",
		Long: `Du lists each image and each tagged layer that is no image's: its layers, its logical bytes
(its layers' blobs, each counted once) and what only it holds (what removing it and dsec layer
gc would free, unless a sandbox or snapshot stands on it). Then the store's logical bytes (every
image and layer counted whole: a layer two images share counts in both) against what it stores
(each blob once, sparse ones by what they take), the bytes of blobs no tag reaches, and what
interrupted builds and pulls left. VM images (dsec vm image) are listed beside images and layers.

` + exitCodesHelp,
		Example: `  dsec layer du
  dsec layer du --json | jq '.stored_bytes'`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := a.openStore()
			if err != nil {
				return err
			}
			u, err := image.Du(cmd.Context(), s)
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(u)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tKIND\tLAYERS\tLOGICAL\tITS OWN")
			for _, e := range u.Entries {
				fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", e.Name, e.Kind, e.Layers, humanBytes(e.Logical), humanBytes(e.Own))
			}
			if err := tw.Flush(); err != nil {
				return err
			}
			ratio := "-"
			if u.Stored > 0 {
				ratio = fmt.Sprintf("%.2fx", float64(u.Logical)/float64(u.Stored))
			}
			_, err = fmt.Fprintf(a.stdout, "logical %s, stored %s (%s: what images and layers share is stored once); %s in blobs no tag reaches (dsec layer gc frees those no sandbox or snapshot stands on); %s left by interrupted builds and pulls (dsec layer gc removes those no pull holds)\n",
				humanBytes(u.Logical), humanBytes(u.Stored), ratio, humanBytes(u.Untagged), humanBytes(u.Leftovers))
			if p := u.Packed; err == nil && p.Layers > 0 {
				_, err = fmt.Fprintf(a.stdout, "packed into shared chunks (dsec layer dedup): %d layers, %s of file data, %s of chunk blobs (%s found stored already, %s zeros)\n",
					p.Layers, humanBytes(p.Logical), humanBytes(p.Chunks), humanBytes(p.Shared), humanBytes(p.Holes))
			}
			return err
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

// completeRefs completes the first argument with the layers in the store.
func (a *app) completeRefs(cmd *cobra.Command, args []string, _ string) ([]string, cobra.ShellCompDirective) {
	if len(args) > 0 {
		return nil, cobra.ShellCompDirectiveDefault
	}
	if err := a.configure(cmd); err != nil {
		return nil, cobra.ShellCompDirectiveError
	}
	s, err := a.openStore()
	if err != nil {
		return nil, cobra.ShellCompDirectiveError
	}
	tags, err := s.Tags(cmd.Context())
	if err != nil {
		return nil, cobra.ShellCompDirectiveError
	}
	var out []string
	for _, t := range tags {
		out = append(out, t.Annotations[store.RefAnnotation])
	}
	return out, cobra.ShellCompDirectiveNoFileComp
}

// asImage says so when ref, which names no layer, names an image the
// store holds (dsec layer inspect python:3.12); else err.
func asImage(ctx context.Context, s *store.Store, ref string, err error) error {
	r, perr := image.ParseReference(ref)
	if perr != nil || layer.IsDigest(ref) {
		return err
	}
	if _, lerr := image.Lookup(ctx, s, r); lerr != nil {
		return err
	}
	return fmt.Errorf("%s is an image, a stack of layers: dsec image inspect %s shows it and its layers: %w", ref, ref, errdefs.ErrInvalidArgument)
}

// createdAt is when a layer was built, as ls and inspect show it: "-"
// for one converted from an image's layer, whose config carries no time
// (two hosts converting one layer make the same config).
func createdAt(t time.Time, layout string) string {
	if t.Unix() <= 0 {
		return "-"
	}
	if layout == time.DateTime {
		t = t.Local()
	}
	return t.Format(layout)
}
