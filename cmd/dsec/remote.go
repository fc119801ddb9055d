//go:build !front

package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/containerd/errdefs"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/layer/store"
)

// openRemote turns a REMOTE argument (a URL, or a name under remotes: in
// the config file; the config's remote: when empty) into a target.
func (a *app) openRemote(arg string, insecure bool) (remote.Target, error) {
	if arg == "" {
		arg = a.cfg.Remote
	}
	if arg == "" {
		return nil, usageError{fmt.Errorf("no remote given: name one, give a URL (dir:///PATH, oci://HOST/REPO), or set remote: in the config file")}
	}
	u := arg
	if !strings.Contains(arg, "://") {
		var ok bool
		if u, ok = a.cfg.Remotes[arg]; !ok {
			return nil, usageError{fmt.Errorf("unknown remote %q: define it under remotes: in the config file or give a URL (dir:///PATH, oci://HOST/REPO)", arg)}
		}
	}
	o := remote.Options{Insecure: insecure}
	remote.EnvCredentials(&o)
	t, err := remote.Open(u, o)
	if errdefs.IsInvalidArgument(err) {
		return nil, usageError{err}
	}
	return t, err
}

type copyFlags struct {
	force, insecure, json bool
}

func (a *app) layerCopyCommand(push bool) *cobra.Command {
	var f copyFlags
	verb, short, long, example := "pull", "Copy a layer from a remote into the local store",
		`Pull copies layer REF (NAME[:VERSION]) from REMOTE into the local store: every blob the store
lacks (manifest, config, EROFS image, window table), each checked against its digest as it
arrives, then the tag. Blobs already present are skipped, and a blob an interrupted pull
left part of continues from where it stopped (an HTTP Range request to a registry; the
whole blob is still hashed before it is published), so pulling again resumes and costs
nothing when the layer is there. A snapshot comes with every layer it stands on.`,
		`  dsec layer pull debian/bookworm:2026.11 oci://registry.internal:5000/dsec
  dsec layer pull tools/harness:3 shared        # a remote named in the config file`
	if push {
		verb, short, long, example = "push", "Copy a layer from the local store to a remote",
			`Push copies layer REF (NAME[:VERSION]) from the local store to REMOTE: every blob the remote
lacks, then the tag, which moves last, so a remote never names a layer it does not hold whole.
Blobs already there are skipped: pushing again resumes an interrupted push (to a dir:
remote from inside the blob it stopped in; a registry takes that blob again). A tag that
names other content on the remote is replaced only with --force. A snapshot goes with every
layer it stands on, bottom first (their tags are never replaced: a remote tag naming other
content than the snapshot stands on is an error).

REMOTE is dir:///PATH (the store layout on any POSIX path: a 3FS, CephFS, JuiceFS or NFS
mount), oci://HOST[:PORT]/REPOSITORY (a registry; the layer goes to REPOSITORY/NAME:VERSION),
or a name under remotes: in the config file. Without REMOTE, the config's remote: is used.
Registry credentials come from the docker config file (docker login) or from
DSEC_REGISTRY_USERNAME and DSEC_REGISTRY_PASSWORD.`,
			`  dsec layer push debian/bookworm:2026.11 dir:///mnt/3fs/dsec
  dsec layer push tools/harness:3 oci://127.0.0.1:5000/dsec --insecure --json`
	}
	cmd := &cobra.Command{
		Use:     verb + " REF [REMOTE]",
		Short:   short,
		Long:    long + "\n\n" + exitCodesHelp,
		Example: example,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) < 1 || len(args) > 2 {
				return usageError{fmt.Errorf("layer %s takes REF and an optional REMOTE", verb)}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			ref, err := layer.ParseRef(args[0])
			if err != nil {
				return usageError{err}
			}
			res, err := a.copyRef(cmd, args[1:], ref, f, push, remote.Copy)
			if err != nil || f.json {
				return err
			}
			copied, skipped, n := res.Totals()
			with := ""
			if len(res.Lowers) > 0 {
				with = fmt.Sprintf(" with the %d layers it stands on", len(res.Lowers))
			}
			fmt.Fprintf(a.stderr, "%s %s%s: %d blobs copied (%s), %d already there\n", verb, res.Ref, with, copied, humanBytes(n), skipped)
			_, err = fmt.Fprintln(a.stdout, res.Digest)
			return err
		},
	}
	fl := cmd.Flags()
	fl.BoolVar(&f.force, "force", false, "replace a tag that names other content")
	fl.BoolVar(&f.insecure, "insecure", false, "no longer needed: a registry on localhost is spoken to over plain HTTP without it")
	fl.BoolVar(&f.json, "json", false, "print what was copied as JSON")
	return cmd
}

// copyRef copies ref between the local store and the remote args name
// (none: the config's) with do, pushing or pulling, with a progress bar
// on a terminal; with --json it prints what was copied.
func (a *app) copyRef(cmd *cobra.Command, args []string, ref layer.Ref, f copyFlags, push bool,
	do func(context.Context, remote.Target, remote.Target, layer.Ref, bool, remote.Progress) (*remote.Result, error)) (*remote.Result, error) {
	target, s, err := a.remoteAndStore(args, f.insecure)
	if err != nil {
		return nil, err
	}
	src, dst, verb := target, remote.Target(remote.Local(s)), "pull"
	if push {
		src, dst, verb = dst, src, "push"
	}
	p, done := a.copyProgress(verb + " " + ref.String())
	res, err := do(cmd.Context(), src, dst, ref, f.force, p)
	done()
	if err == nil && f.json {
		err = a.printJSON(res)
	}
	return res, err
}

// remoteAndStore opens the remote args name (none: the config's) and
// the local store.
func (a *app) remoteAndStore(args []string, insecure bool) (remote.Target, *store.Store, error) {
	target, err := a.openRemote(strings.Join(args, ""), insecure)
	if err != nil {
		return nil, nil, err
	}
	s, err := a.openStore()
	return target, s, err
}

// copyProgress is a byte bar described by what, on a terminal (nil
// elsewhere), and what ends it.
func (a *app) copyProgress(what string) (remote.Progress, func()) {
	if !a.showProgress() {
		return nil, func() {}
	}
	bar := progressbar.NewOptions64(-1, progressbar.OptionSetWriter(a.stderr),
		progressbar.OptionSetDescription(what), progressbar.OptionShowBytes(true),
		progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionClearOnFinish())
	return barProgress{bar}, func() { bar.Finish() }
}
