//go:build !front

package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/containerd/errdefs"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/image"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
)

func (a *app) imageCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:         "image",
		Short:       "Import container images from registries as stacks of EROFS layers",
		Annotations: map[string]string{localAnnotation: "true"},
		Long: `An image is imported from an OCI distribution registry (Docker Hub, ghcr.io, a registry of
your own) into the store at <root>/store. Each of its layers becomes an EROFS layer of its own,
tagged oci/sha256/CHAINID:erofs1 by its OCI chain ID (the digests of its tar and of every
layer's under it), so two images that share their first layers store and fetch them once;
the image itself is a small record of its layers in order and its config, whose environment,
working directory and user dsec run --image and the SDKs take as defaults (its entrypoint and
command are recorded, not run: a sandbox runs the commands it is given).

Names are read as docker pull reads them: python:3.12 is docker.io/library/python:3.12.
Credentials are those docker login left (the config file and its credential helpers), or
DSEC_REGISTRY_USERNAME and DSEC_REGISTRY_PASSWORD, given to DSEC_REGISTRY_HOST alone (without it,
to the registry of the image pulled; a worker's pulls get them only with it). A registry on a loopback address is
spoken to over plain HTTP, as Docker does; any other over TLS unless the config file lists it
under registries.insecure.`,
	}
	cmd.AddCommand(a.imagePull(), a.imagePush(), a.imageList(), a.imageInspect(), a.imageRemove())
	return cmd
}

// registryOptions are the pull options of the config and environment.
// DSEC_REGISTRY_USERNAME and _PASSWORD go to DSEC_REGISTRY_HOST alone,
// or, without it, to the registry of the image a command names (a
// worker's pulls on first use, of images any client names, get them
// only with DSEC_REGISTRY_HOST).
func (a *app) registryOptions(platform string, named *image.Reference) (image.Options, error) {
	key := "--platform"
	if platform == "" {
		platform, key = a.cfg.Registries.Platform, "registries.platform"
	}
	p, err := image.ParsePlatform(platform)
	if err != nil {
		return image.Options{}, usageError{fmt.Errorf("%s: %w", key, err)}
	}
	var ro remote.Options
	remote.EnvCredentials(&ro)
	o := image.Options{Platform: p, Username: ro.Username, Password: ro.Password, Insecure: a.cfg.Registries.Insecure,
		CredentialHost: os.Getenv("DSEC_REGISTRY_HOST"), Compress: a.cfg.Registries.Compress}
	if o.CredentialHost == "" && named != nil {
		o.CredentialHost = named.Registry
	}
	for _, m := range a.cfg.Registries.Mirrors {
		if m.Registry == "" || len(m.Hosts) == 0 {
			return o, usageError{fmt.Errorf("registries.mirrors: each gives a registry (docker.io, HOST:PORT) and its hosts")}
		}
		for _, h := range m.Hosts {
			if h == "" || strings.ContainsAny(h, "/ ") {
				return o, usageError{fmt.Errorf("registries.mirrors: host %q of %s: give HOST[:PORT], without a scheme or a path (one on this host is spoken to over plain HTTP; registries.insecure names others)", h, m.Registry)}
			}
		}
		if o.Mirrors == nil {
			o.Mirrors = map[string][]string{}
		}
		o.Mirrors[m.Registry] = append(o.Mirrors[m.Registry], m.Hosts...)
	}
	return o, nil
}

// pullImage imports ref, with a progress bar on a terminal.
func (a *app) pullImage(cmd *cobra.Command, ref, platform string, compress bool) (*image.Image, error) {
	r, err := image.ParseReference(ref)
	if err != nil {
		return nil, usageError{err}
	}
	o, err := a.registryOptions(platform, &r)
	if err != nil {
		return nil, err
	}
	o.Compress = o.Compress || compress
	var bar *progressbar.ProgressBar
	if a.showProgress() {
		o.Progress = func(total int64) layer.Progress {
			bar = progressbar.NewOptions64(total, progressbar.OptionSetWriter(a.stderr),
				progressbar.OptionSetDescription("pulling "+r.String()), progressbar.OptionShowBytes(true),
				progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionClearOnFinish())
			return barProgress{bar}
		}
	}
	s, err := a.openStore()
	if err != nil {
		return nil, err
	}
	if err := compressible(s, compress); err != nil {
		return nil, err
	}
	start := time.Now()
	img, err := image.Import(cmd.Context(), s, r, o)
	if bar != nil {
		bar.Finish()
	}
	if err != nil {
		return nil, err
	}
	a.log.Info("imported image", "image", img.Reference, "layers", len(img.Layers), "fetched", img.Fetched,
		"reused", img.Reused, "resumed_bytes", img.Resumed, "seconds", time.Since(start).Seconds())
	return img, nil
}

func (a *app) imagePull() *cobra.Command {
	var asJSON, compress bool
	var platform string
	cmd := &cobra.Command{
		Use:   "pull IMAGE",
		Short: "Import an image from a registry",
		Long: `Pull imports IMAGE (NAME[:TAG], NAME@DIGEST, docker://NAME or oci://HOST[:PORT]/REPO[:TAG]).
Every layer the store lacks is fetched once and converted to EROFS as it streams in (nothing
is unpacked to disk), checked against the blob's digest and the config's diff ID before it is
stored; a layer that fails its check leaves nothing behind. An image index is resolved to
--platform (default: the config's registries.platform, else this host's). Pulling a tag again
moves the image to what the registry names now, fetching only the layers that changed.

--compress (or registries.compress in the config) stores the layers' files LZ4-compressed
where that saves a block: fewer bytes written and stored, and fewer fetched by a host that
mounts them lazily, for the CPU of decompressing what is read (every kernel with EROFS
compression reads them, a microVM's guest too). A store that packs layers into shared chunks
(dsec layer dedup) keeps them uncompressed.

Stdout gets the image's layers as a sandbox stacks them (topmost first), or JSON with --json.

` + exitCodesHelp,
		Example: `  dsec image pull python:3.12
  dsec image pull ghcr.io/org/swe-env:django-11099 --platform linux/amd64
  dsec image pull python:3.12 --compress
  dsec image pull 127.0.0.1:5000/env@sha256:4f1c... --json | jq -r .layers[].ref`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			img, err := a.pullImage(cmd, args[0], platform, compress)
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(img)
			}
			_, err = fmt.Fprintln(a.stdout, strings.Join(img.Refs(), "\n"))
			return err
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the image as JSON (its layers, config and what was fetched)")
	cmd.Flags().BoolVar(&compress, "compress", false, "store the layers' files LZ4-compressed where that saves a block")
	cmd.Flags().StringVar(&platform, "platform", "", "OS/ARCH[/VARIANT] to take from a multi-platform image")
	return cmd
}

func (a *app) imageList() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the images in the store",
		Example: `  dsec image ls
  dsec image ls --json | jq -r '.[].reference'`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := a.openStore()
			if err != nil {
				return err
			}
			all, err := image.List(cmd.Context(), s)
			if err != nil {
				return err
			}
			if asJSON {
				if all == nil {
					all = []*image.Image{}
				}
				return a.printJSON(all)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "IMAGE\tPLATFORM\tLAYERS\tSIZE\tMANIFEST")
			for _, i := range all {
				var size int64
				for _, l := range i.Layers {
					size += l.Size
				}
				fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", i.Reference, i.Platform, len(i.Layers), humanBytes(size), i.Manifest.Encoded()[:12])
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON array")
	return cmd
}

func (a *app) imageInspect() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "inspect IMAGE",
		Short: "Show an imported image's layers and config",
		Long: `Inspect shows an image the store holds, named as it was pulled (NAME:TAG, or NAME@DIGEST of
its manifest) or by its ID: its layers, bottom first (each OCI layer's diff ID, blob and the
EROFS layer it became), and the config a sandbox takes from it.

` + exitCodesHelp,
		Example: `  dsec image inspect python:3.12
  dsec image inspect --json python:3.12 | jq .config.env`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.openStore()
			if err != nil {
				return err
			}
			var img *image.Image
			if layer.IsDigest(args[0]) { // its ID
				img, err = image.LookupID(cmd.Context(), s, args[0])
			} else {
				r, perr := image.ParseReference(args[0])
				if perr != nil {
					return usageError{perr}
				}
				img, err = image.Lookup(cmd.Context(), s, r)
			}
			if err != nil {
				return notAnImage(cmd.Context(), s, args[0], err)
			}
			if asJSON {
				return a.printJSON(img)
			}
			return printImage(a.stdout, img)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func printImage(w io.Writer, img *image.Image) error {
	tw := tabwriter.NewWriter(w, 0, 4, 1, ' ', 0)
	fmt.Fprintf(tw, "image:\t%s\n", img.Reference)
	fmt.Fprintf(tw, "manifest:\t%s\n", img.Manifest)
	fmt.Fprintf(tw, "platform:\t%s\n", img.Platform)
	fmt.Fprintf(tw, "env:\t%s\n", strings.Join(img.Config.Env, " "))
	fmt.Fprintf(tw, "workdir:\t%s\n", img.Config.WorkingDir)
	fmt.Fprintf(tw, "user:\t%s\n", img.Config.User)
	fmt.Fprintf(tw, "command:\t%s\n", strings.Join(append(append([]string{}, img.Config.Entrypoint...), img.Config.Cmd...), " "))
	for i, l := range img.Layers {
		fmt.Fprintf(tw, "layer %d:\t%s (%s, diff %s)\n", i+1, l.Ref, humanBytes(l.Size), l.DiffID.Encoded()[:12])
	}
	return tw.Flush()
}

func (a *app) imageRemove() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "rm IMAGE...",
		Aliases: []string{"remove"},
		Short:   "Remove images, and the layers no other image has; dsec layer gc frees their blobs",
		Long: `Rm removes the images' records and the tags of their layers that no other image has.
Blobs stay until dsec layer gc, which keeps those a sandbox or a snapshot stands on.

` + exitCodesHelp,
		Example: `  dsec image rm python:3.12 && dsec layer gc`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError{fmt.Errorf("image rm needs at least one IMAGE")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := a.openStore()
			if err != nil {
				return err
			}
			for _, ref := range args {
				r, err := image.ParseReference(ref)
				if err != nil {
					return usageError{err}
				}
				img, err := image.Remove(cmd.Context(), s, r)
				if err != nil {
					return notAnImage(cmd.Context(), s, ref, err)
				}
				fmt.Fprintln(a.stdout, img.Reference)
			}
			return nil
		},
	}
	return cmd
}

func (a *app) imagePush() *cobra.Command {
	var f copyFlags
	cmd := &cobra.Command{
		Use:   "push IMAGE [REMOTE]",
		Short: "Copy an imported image to a shared remote, for other hosts' workers",
		Long: `Push copies an image the local store holds to REMOTE, as dsec layer push copies layers: its
layers first (what the remote lacks; the tags move last), then its record. A worker whose
remote (the config's remote:) holds the image makes sandboxes on it without asking its
registry: it takes the record from the remote and mounts the layers lazily from there.

REMOTE is dir:///PATH, oci://HOST[:PORT]/REPOSITORY or a name under remotes: in the config
file; without it, the config's remote:.

` + exitCodesHelp,
		Example: `  dsec image pull python:3.12 && dsec image push python:3.12 dir:///mnt/3fs/dsec
  # on every other host (remote: dir:///mnt/3fs/dsec in its config)
  dsec run --rm --image python:3.12 -- python3 -V`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) < 1 || len(args) > 2 {
				return usageError{fmt.Errorf("image push takes IMAGE and an optional REMOTE")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			r, err := image.ParseReference(args[0])
			if err != nil {
				return usageError{err}
			}
			target, s, err := a.remoteAndStore(args[1:], f.insecure)
			if err != nil {
				return err
			}
			p, done := a.copyProgress("push " + r.String())
			img, res, err := image.Push(cmd.Context(), s, target, r, f.force, p)
			done()
			if err != nil {
				return err
			}
			if f.json {
				if res == nil {
					res = []*remote.Result{}
				}
				return a.printJSON(struct {
					Image  *image.Image     `json:"image"`
					Copied []*remote.Result `json:"copied"`
				}{img, res})
			}
			var copied, skipped int
			var n int64
			for _, x := range res {
				c, s, b := x.Totals()
				copied, skipped, n = copied+c, skipped+s, n+b
			}
			fmt.Fprintf(a.stderr, "push %s: %d blobs copied (%s), %d already there\n", img.Reference, copied, humanBytes(n), skipped)
			_, err = fmt.Fprintln(a.stdout, img.Reference)
			return err
		},
	}
	fl := cmd.Flags()
	fl.BoolVar(&f.force, "force", false, "replace the image's tag on the remote if it names another image")
	fl.BoolVar(&f.insecure, "insecure", false, "no longer needed: a registry on localhost is spoken to over plain HTTP without it")
	fl.BoolVar(&f.json, "json", false, "print the image and what was copied as JSON")
	return cmd
}

// notAnImage says what ref names when it names no image but a layer or
// a VM image as typed (dsec image inspect debian-vm:12); else err.
func notAnImage(ctx context.Context, s *store.Store, ref string, err error) error {
	if !errdefs.IsNotFound(err) {
		return err
	}
	r, perr := layer.ParseRef(ref)
	if perr != nil {
		return err
	}
	d, rerr := s.Resolve(ctx, r.String())
	if rerr != nil {
		return err
	}
	switch kind := layer.Kind(d.Annotations[layer.AnnotationKind]); kind {
	case layer.KindImage:
		return err
	case layer.KindVMImage:
		return fmt.Errorf("%s is a VM image: dsec vm image inspect shows it: %w", ref, errdefs.ErrInvalidArgument)
	default:
		return fmt.Errorf("%s is a %s layer, not an image: dsec layer inspect shows it: %w", ref, kind, errdefs.ErrInvalidArgument)
	}
}

// compressible refuses an explicit --compress on a store that packs its
// layers into shared chunks, which hold file data uncompressed.
func compressible(s *store.Store, compress bool) error {
	if compress && s.Dedup() {
		return usageError{fmt.Errorf("--compress: this store packs layers into shared chunks (dsec layer dedup), whose data stays uncompressed: drop --compress, or dsec layer dedup --off first")}
	}
	return nil
}
