package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/containerd/errdefs"
	"github.com/spf13/cobra"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/archive"
	"github.com/dsec-project/dsec/sdk"
)

// dsec cp: files and trees into and out of a sandbox.

// cpCommand copies files and trees between the host and a sandbox.
func (a *app) cpCommand() *cobra.Command {
	var o cpOptions
	cmd := &cobra.Command{
		Use:   "cp [-a] [-L] SRC DST",
		Short: "Copy files and directories into or out of a running sandbox",
		Long: `Cp copies a file, a symlink or a directory tree between the host and a running sandbox,
with docker cp's rules. The sandbox side is NAME:/ABSOLUTE/PATH, resolved inside the
sandbox's root as the sandbox would resolve it: a symlink the agent planted never leads
to a host file, and its /proc, /sys and /dev are not copied. The host side is a path, or -:
a tar stream on stdin (extracted into DST, a directory) or on stdout.

  SRC a file,      DST a directory: copied into it, under SRC's name
  SRC a file,      DST a file or nothing: DST is the copy (DST/ with a trailing slash
                   must be a directory that exists)
  SRC a directory, DST a directory: copied into it, under SRC's name; SRC/. copies
                   its entries into DST
  SRC a directory, DST nothing: DST is made, a copy of SRC; DST a file: an error

Modes and times are kept, symlinks stay symlinks (-L follows one at SRC itself), hard
links within the copy stay links. Owners: what is copied in belongs to the sandbox's root
and what is copied out to you; with -a (archive) both keep the source's uid and gid (the
sandbox's own ids, in a --userns sandbox too). Set-id bits are dropped on the way out
unless -a. A file replaces its target only once it is whole. Sockets, and device nodes and
fifos (on extraction), are left out with a warning on stderr.

` + exitCodesHelp,
		Example: `  dsec cp patch.diff rollout-7:/work/
  dsec cp ./src rollout-7:/work/src
  dsec cp rollout-7:/work/results/. ./results
  dsec cp rollout-7:/work/report.json -  | tar -xO
  tar -C fixtures -c . | dsec cp - rollout-7:/work/fixtures`,
		Args: exactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			srcBox, srcPath, srcIn := splitSandboxPath(args[0])
			dstBox, dstPath, dstIn := splitSandboxPath(args[1])
			if srcIn == dstIn {
				return usageError{errors.New("cp copies between the host and a sandbox: give exactly one side as NAME:/PATH")}
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			var rep api.CopyReport
			if dstIn {
				rep, err = copyIn(cmd.Context(), c.Sandbox(dstBox), srcPath, dstPath, a.stdin, o)
			} else {
				rep, err = copyOut(cmd.Context(), c.Sandbox(srcBox), srcPath, dstPath, a.stdout, o)
			}
			for _, s := range rep.Skipped {
				fmt.Fprintf(a.stderr, "dsec: cp: left out %s: %s\n", s.Name, s.Reason)
			}
			return cpError(err)
		},
	}
	cmd.Flags().BoolVarP(&o.archive, "archive", "a", false, "keep owners (uid and gid) and set-id bits")
	cmd.Flags().BoolVarP(&o.follow, "follow-link", "L", false, "follow a symlink at SRC itself")
	return cmd
}

type cpOptions struct{ archive, follow bool }

// copyIn copies the host's src (- : a tar stream on stdin) to dst in sb.
func copyIn(ctx context.Context, sb *sdk.Sandbox, src, dst string, stdin io.Reader, o cpOptions) (api.CopyReport, error) {
	st, err := sb.Stat(ctx, dst, true)
	exists := err == nil
	if err != nil && !errdefs.IsNotFound(err) {
		return api.CopyReport{}, err
	}
	if src == "-" {
		if !exists || !st.Mode.IsDir() {
			return api.CopyReport{}, usageError{fmt.Errorf("cp - extracts a tar stream into a directory: %s is not one in the sandbox", dst)}
		}
		return sb.CopyTo(ctx, dst, stdin, o.archive)
	}
	stat := os.Lstat
	if o.follow {
		stat = os.Stat
	}
	fi, err := stat(src)
	if err != nil {
		return api.CopyReport{}, err
	}
	dir, name, err := archive.Plan(src, fi.IsDir(), dst, exists, exists && st.Mode.IsDir())
	if err != nil {
		return api.CopyReport{}, err
	}
	root, top, err := hostSource(src, fi.IsDir())
	if err != nil {
		return api.CopyReport{}, err
	}
	defer root.Close()
	pr, pw := io.Pipe()
	go func() {
		_, err := archive.Write(pw, archive.Root{Root: root}, top, archive.WriteOptions{Name: name, Follow: o.follow})
		pw.CloseWithError(err)
	}()
	rep, err := sb.CopyTo(ctx, dir, pr, o.archive)
	pr.CloseWithError(err)
	return rep, err
}

// hostSource opens the directory a host source is archived from and
// names the source in it (".": a directory's entries, SRC/.).
func hostSource(src string, dir bool) (*os.Root, string, error) {
	clean := filepath.Clean(src)
	if dir && (strings.HasSuffix(src, "/.") || clean == "/") {
		r, err := os.OpenRoot(clean)
		return r, ".", err
	}
	r, err := os.OpenRoot(filepath.Dir(clean))
	return r, filepath.Base(clean), err
}

// copyOut copies src in sb to the host's dst (- : a tar stream on stdout).
func copyOut(ctx context.Context, sb *sdk.Sandbox, src, dst string, stdout io.Writer, o cpOptions) (api.CopyReport, error) {
	if dst == "-" {
		rc, _, err := sb.CopyFrom(ctx, src, sdk.CopyFromOptions{Follow: o.follow})
		if err != nil {
			return api.CopyReport{}, err
		}
		defer rc.Close()
		_, err = io.Copy(stdout, rc)
		return rc.Report(), err
	}
	st, err := sb.Stat(ctx, src, o.follow)
	if err != nil {
		return api.CopyReport{}, err
	}
	fi, err := os.Stat(dst)
	exists := err == nil
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return api.CopyReport{}, err
	}
	dir, name, err := archive.Plan(src, st.Mode.IsDir(), dst, exists, exists && fi.IsDir())
	if err != nil {
		return api.CopyReport{}, err
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return api.CopyReport{}, err
	}
	defer root.Close()
	rc, _, err := sb.CopyFrom(ctx, src, sdk.CopyFromOptions{Name: name, Follow: o.follow})
	if err != nil {
		return api.CopyReport{}, err
	}
	defer rc.Close()
	skipped, err := archive.Extract(rc, archive.Root{Root: root}, ".", archive.ExtractOptions{Owners: o.archive, NoSetID: !o.archive})
	return api.CopyReport{Skipped: append(rc.Report().Skipped, skipped...)}, err
}

// cpError classifies the host side's failures for the exit code.
func cpError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, syscall.ENOTDIR):
		return usageError{err}
	}
	return err
}

// splitSandboxPath splits NAME:/PATH; anything else is a host path.
func splitSandboxPath(arg string) (name, path string, inSandbox bool) {
	name, path, ok := strings.Cut(arg, ":")
	if !ok || !strings.HasPrefix(path, "/") || name == "" || strings.Contains(name, "/") {
		return "", arg, false
	}
	return name, path, true
}
