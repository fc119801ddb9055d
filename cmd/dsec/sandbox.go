package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/units"
	"github.com/dsec-project/dsec/sdk"
)

// sdkOptions reach the worker the settings name: --host's, else the
// root's.
func (a *app) sdkOptions() sdk.Options {
	if a.cfg.Host != "" {
		return sdk.Options{Host: a.cfg.Host, Token: a.cfg.Token, TLSCA: a.cfg.TLSCA, ClientCert: a.cfg.ClientCert, ClientKey: a.cfg.ClientKey}
	}
	return sdk.Options{Root: a.cfg.Root}
}

// client connects to the worker: --host's, or the root's, starting one
// if none runs.
func (a *app) client() (*sdk.Client, error) {
	if a.cfg.Host != "" {
		return sdk.New(a.sdkOptions())
	}
	self, err := workerBinary()
	if err != nil { // a running worker is all a step needs
		c, cerr := sdk.New(sdk.Options{Root: a.cfg.Root})
		if cerr != nil {
			return nil, fmt.Errorf("no worker serves %s, and none can be started: %w", a.cfg.Root, err)
		}
		return c, nil
	}
	start := []string{self, "--root", a.cfg.Root, "--log-level", "info", "daemon", "--exit-idle", "10m"}
	if a.configFile != "" {
		start = append(start[:1], append([]string{"--config", a.configFile}, start[1:]...)...)
	}
	return sdk.New(sdk.Options{Root: a.cfg.Root, StartWorker: start, Started: func(pid int) {
		fmt.Fprintf(a.stderr, "dsec: no worker served %s; started one (pid %d, log %s/worker.log; it exits after 10 minutes without sandboxes)\n",
			a.cfg.Root, pid, a.cfg.Root)
	}})
}

// parseBytes reads a size flag.
func parseBytes(s string) (int64, error) {
	n, err := units.ParseBytes(s)
	if err != nil {
		return 0, usageError{err}
	}
	return n, nil
}

// humanBytes prints a size in binary units.
func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// sizes sets the spec's memory limit and disk quota from flags.
func sizes(spec *api.SandboxSpec, memory, disk string) error {
	for _, s := range []struct {
		flag, v string
		to      *int64
	}{{"memory", memory, &spec.Memory}, {"disk", disk, &spec.Disk}} {
		if s.v == "" {
			continue
		}
		if s.v == "unlimited" || s.v == "-1" {
			*s.to = api.Unlimited
			continue
		}
		n, err := parseBytes(s.v)
		if err != nil {
			return fmt.Errorf("--%s: %w", s.flag, err)
		}
		*s.to = n
	}
	return nil
}

type runFlags struct {
	specFlags
	name, backend, pool    string
	id                     string
	detach, rm, tty, stdin bool
	asJSON                 bool
}

func (a *app) runCommand() *cobra.Command {
	var f runFlags
	cmd := &cobra.Command{
		Use:   "run (--base REF | --image IMAGE) [--workspace REF] [--toolkit REF] [flags] [-- CMD [ARG...]]",
		Short: "Create a sandbox on layers and run a command in it",
		Long: `Run composes the layers (toolkit over workspace over base, each mounted from the local
store, or lazily from the configured remote when the store lacks it) under a writable upper
of the sandbox's own; --image puts a container image's layers at the bottom instead of a
base (imported from its registry on first use, as dsec image pull does; its environment and
working directory are the defaults of --env and --workdir, and CMD is run, not the image's
own command), starts the sandbox and runs CMD in it, streaming its output. The
sandbox lives on after CMD (its files and background processes persist for later
dsec exec steps) unless --rm is given: then the worker removes it when CMD ends, or when
this client goes away (interrupted or killed), and its name is free again; with -d, run prints the sandbox's name and returns,
CMD (if any) running in the background (dsec logs NAME shows its output).

The worker (dsec daemon) owns the sandbox; run starts one when none serves the root.
CMD's exec id is --id (default "run").

` + runExitHelp,
		Example: `  # one-shot: run the tests and throw the sandbox away
  dsec run --rm --base debian:12 --workspace repo:abc123 -- make test

  # a stateful sandbox for a rollout, then steps in it
  dsec run -d --name rollout-7 --base debian:12 --workspace repo:abc123 --toolkit harness:3 \
      --cpu 1 --memory 2G --disk 10G --env PYTHONDONTWRITEBYTECODE=1 --workdir /work
  dsec exec --id step-1 rollout-7 -- pytest -x

  # an environment named by its image, a workspace and a harness over it
  dsec run --rm --image python:3.12 --workspace repo:abc123 --toolkit harness:3 -- python -m pytest`,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runError(a.run(cmd.Context(), f, args))
		},
	}
	fl := cmd.Flags()
	f.register(fl)
	fl.StringVar(&f.name, "name", "", "the sandbox's name (default: generated)")
	fl.StringVar(&f.backend, "backend", "container", "the backend: container (namespaces on the host's kernel), microvm (a QEMU guest: a kernel of its own), vm (a full VM booted from a VM image: --base names it) or fncall (CMD in a warm sandbox of a pool, discarded after)")
	fl.StringVar(&f.pool, "pool", "", "with --backend fncall: the pool to take the sandbox from (default: the pool of the same template)")
	fl.StringVar(&f.id, "id", "run", "exec id of CMD")
	fl.BoolVarP(&f.detach, "detach", "d", false, "print the name and return; CMD (if any) runs in the background")
	fl.BoolVar(&f.rm, "rm", false, "remove the sandbox when CMD exits (the worker does, also if this client dies)")
	fl.BoolVarP(&f.stdin, "interactive", "i", false, "pass stdin to CMD")
	fl.BoolVarP(&f.tty, "tty", "t", false, "run CMD on a terminal")
	fl.BoolVar(&f.asJSON, "json", false, "with -d, print the sandbox as JSON")
	cmd.RegisterFlagCompletionFunc("base", a.completeRefs)
	cmd.RegisterFlagCompletionFunc("workspace", a.completeRefs)
	cmd.RegisterFlagCompletionFunc("toolkit", a.completeRefs)
	return cmd
}

func (a *app) run(ctx context.Context, f runFlags, args []string) error {
	if f.pool != "" && f.backend == "container" {
		f.backend = "fncall"
	}
	if f.backend == "fncall" {
		if len(args) == 0 || f.detach || f.name != "" || f.asJSON {
			return usageError{errors.New("--backend fncall runs CMD in a sandbox discarded after it: give a command, and no -d, --name or --json")}
		}
		if f.base == "" && f.image == "" && f.pool == "" {
			return usageError{errors.New("--backend fncall needs --pool NAME, --base REF or --image IMAGE (dsec pool ls lists the pools)")}
		}
		spec, err := a.spec(f.specFlags)
		if err != nil {
			return err
		}
		return a.call(ctx, f.pool, &spec, false, execFlags{tty: f.tty, stdin: f.stdin}, args)
	}
	if f.base == "" && f.image == "" {
		return usageError{errors.New("run needs --base REF (dsec layer ls lists the layers) or --image IMAGE (e.g. python:3.12)")}
	}
	if len(args) == 0 && !f.detach {
		return usageError{errors.New("give a command after --, or -d to keep the sandbox running idle")}
	}
	if f.asJSON && !f.detach {
		return usageError{errors.New("run --json prints the sandbox of a detached run: add -d (dsec exec --json prints a command's result)")}
	}
	if f.detach && (f.rm || f.tty || f.stdin) {
		return usageError{errors.New("-d runs in the background: it cannot be combined with --rm, -t or -i")}
	}
	spec, err := a.spec(f.specFlags)
	if err != nil {
		return err
	}
	spec.Name, spec.Backend = f.name, f.backend
	if f.rm {
		// One request: the worker makes the sandbox, runs CMD and removes
		// the sandbox when CMD ends or this client goes away.
		return a.call(ctx, "", &spec, true, execFlags{id: f.id, tty: f.tty, stdin: f.stdin}, args)
	}
	c, err := a.client()
	if err != nil {
		return err
	}
	sb, err := c.Create(ctx, spec)
	if err != nil {
		return err
	}
	if f.detach {
		if len(args) > 0 {
			if _, err := sb.Exec(ctx, sdk.ExecOptions{ID: f.id, Args: args, Detach: true}); err != nil {
				return err
			}
		}
		if f.asJSON {
			info, err := sb.Inspect(ctx)
			if err != nil {
				return err
			}
			return a.printJSON(info)
		}
		_, err := fmt.Fprintln(a.stdout, sb.Name)
		return err
	}
	return a.execute(ctx, sb, execFlags{id: f.id, tty: f.tty, stdin: f.stdin}, args)
}

func checkEnv(env []string) error {
	for _, kv := range env {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			return usageError{fmt.Errorf("bad --env %q: give K=V", kv)}
		}
	}
	return nil
}

type execFlags struct {
	id, workdir, user string
	env               []string
	tty, stdin, jsonO bool
}

func (a *app) execCommand() *cobra.Command {
	var f execFlags
	cmd := &cobra.Command{
		Use:   "exec [flags] NAME -- CMD [ARG...]",
		Short: "Run a command in a running sandbox",
		Long: `Exec runs CMD in the sandbox NAME, streams its stdout and stderr, and exits with its exit
code. Files, installed packages and background processes of earlier steps are all there.

--id names the step: a step runs at most once per sandbox. Running exec again with the
same --id (after a client crash, a timeout, a trainer's preemption) does not run the command
again: it replays the recorded output and exit code, or waits for them if the command is
still running. Without --id each exec gets a fresh id.

With --json the output is collected and printed with the result as one JSON object:
"stdout" and "stderr" hold the streams as text when they are UTF-8; a stream that is not
is in "stdout_base64" or "stderr_base64" instead, byte for byte.

The journal keeps up to exec.max_output (64M) of a command's output, stdout and stderr
together, and no more than the sandbox's disk bound; the rest is read and dropped, and exec
says so on stderr ("output_truncated", "output_truncated_bytes" with --json). What the
command's processes write after it ended is not kept. To stay within its disk bound, the
journal drops the outputs of a sandbox's oldest steps first ("output_dropped").

` + runExitHelp,
		Example: `  dsec exec rollout-7 -- ls /work
  dsec exec --id rollout-7/step-12 rollout-7 -- sh -c 'pip install -e . && pytest -x'
  echo 'print(1)' | dsec exec -i rollout-7 -- python3
  dsec exec -u nobody rollout-7 -- id
  dsec exec -it rollout-7 -- sh`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) < 2 {
				return usageError{errors.New("exec needs a sandbox and a command: dsec exec NAME -- CMD [ARG...]")}
			}
			return nil
		},
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkEnv(f.env); err != nil {
				return runError(err)
			}
			c, err := a.client()
			if err != nil {
				return runError(err)
			}
			return runError(a.execute(cmd.Context(), c.Sandbox(args[0]), f, args[1:]))
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.id, "id", "", "the step's id: the same id never runs twice (default: fresh)")
	fl.StringArrayVarP(&f.env, "env", "e", nil, "K=V added to the sandbox's environment (repeatable)")
	fl.StringVarP(&f.workdir, "workdir", "w", "", "working directory (default: the sandbox's)")
	fl.StringVarP(&f.user, "user", "u", "", "run as this user of the sandbox: a name of its /etc/passwd, uid or uid:gid (default root)")
	fl.BoolVarP(&f.stdin, "interactive", "i", false, "pass stdin to the command")
	fl.BoolVarP(&f.tty, "tty", "t", false, "run the command on a terminal")
	fl.BoolVar(&f.jsonO, "json", false, "print the output and the result as JSON")
	return cmd
}

// execResult is exec --json's output: each stream as text when it is
// UTF-8, else base64 under its _base64 name (never mangled).
type execResult struct {
	api.ExecResult
	Stdout       *string `json:"stdout,omitempty"`
	StdoutBase64 string  `json:"stdout_base64,omitempty"`
	Stderr       *string `json:"stderr,omitempty"`
	StderrBase64 string  `json:"stderr_base64,omitempty"`
}

// textOr returns b as text if it is UTF-8, else as base64.
func textOr(b []byte) (*string, string) {
	if utf8.Valid(b) {
		s := string(b)
		return &s, ""
	}
	return nil, base64.StdEncoding.EncodeToString(b)
}

// execute runs args in sb and turns its end into dsec's exit.
func (a *app) execute(ctx context.Context, sb *sdk.Sandbox, f execFlags, args []string) error {
	opts := sdk.ExecOptions{ID: f.id, Args: args, Env: f.env, Cwd: f.workdir, User: f.user}
	defer a.streams(&opts, f)()
	var outBuf, errBuf bytes.Buffer
	if f.jsonO {
		opts.Stdout, opts.Stderr = &outBuf, &errBuf
	}
	res, err := sb.Exec(ctx, opts)
	if err != nil {
		return err
	}
	if f.jsonO {
		r := execResult{ExecResult: res}
		r.Stdout, r.StdoutBase64 = textOr(outBuf.Bytes())
		r.Stderr, r.StderrBase64 = textOr(errBuf.Bytes())
		if err := a.printJSON(r); err != nil {
			return err
		}
	}
	return a.finish(res, sb.Name)
}

// streams gives the command dsec's output, its stdin with -i and its
// terminal's size with -t; with -it the terminal is raw until restore.
func (a *app) streams(opts *sdk.ExecOptions, f execFlags) (restore func()) {
	opts.Stdout, opts.Stderr, opts.TTY = a.stdout, a.stderr, f.tty
	if f.stdin {
		opts.Stdin = a.stdin
	}
	restore = func() {}
	if in, ok := a.stdin.(*os.File); ok && f.tty && term.IsTerminal(int(in.Fd())) {
		if cols, rows, err := term.GetSize(int(in.Fd())); err == nil {
			opts.Rows, opts.Cols = rows, cols
		}
		if f.stdin {
			if old, err := term.MakeRaw(int(in.Fd())); err == nil {
				restore = func() { term.Restore(int(in.Fd()), old) }
			}
		}
	}
	return restore
}

// finish turns a command's end in sandbox into dsec's exit.
func (a *app) finish(res api.ExecResult, sandbox string) error {
	if res.Replayed {
		fmt.Fprintf(a.stderr, "dsec: exec %s ran before: replayed its recorded output and exit code\n", res.ID)
	}
	if res.OOM {
		fmt.Fprintf(a.stderr, "dsec: the command was killed: sandbox %s hit its memory limit (out of memory)\n", sandbox)
	}
	a.warnOutput(res)
	if res.ExitCode != 0 {
		return cmdExit{res.ExitCode}
	}
	return nil
}

// warnOutput says on stderr when the journal kept less than the command
// wrote: past the exec's cap, or emptied since to keep the sandbox's
// journal within its disk bound.
func (a *app) warnOutput(res api.ExecResult) {
	switch {
	case res.OutputDropped:
		fmt.Fprintf(a.stderr, "dsec: exec %s's output was dropped from the journal to keep the sandbox within its disk bound (older outputs go first)\n", res.ID)
	case res.OutputTruncated:
		fmt.Fprintf(a.stderr, "dsec: exec %s's output was truncated: %s past the cap (exec.max_output, or the sandbox's disk bound) was not kept\n",
			res.ID, humanBytes(res.OutputTruncatedBytes))
	}
}

func (a *app) completeSandboxes(cmd *cobra.Command, args []string, _ string) ([]string, cobra.ShellCompDirective) {
	c, err := sdk.New(a.sdkOptions())
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	list, _ := c.List(cmd.Context())
	var names []string
	for _, s := range list {
		names = append(names, s.Name)
	}
	return names, cobra.ShellCompDirectiveNoFileComp
}

func (a *app) psCommand() *cobra.Command {
	var asJSON, quiet, all bool
	cmd := &cobra.Command{
		Use:     "ps",
		Aliases: []string{"ls"},
		Short:   "List sandboxes",
		Long: `Ps lists the worker's sandboxes, oldest first: name, status (queued for admission,
creating, running, stopped, or dead when its init died), scheduling class, CPU time used,
memory charged now (a microVM's: what its guest uses, then what the host holds for it, its
freed pages given back by its balloon; "evicted": its guest saved to disk), disk used of its quota, how long no exec started or ended in it (IDLE),
journaled execs, age and layers. Warm sandboxes of FnCall pools only with --all.
--json prints every field.

` + exitCodesHelp,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			list := c.List
			if all {
				list = c.ListAll
			}
			sandboxes, err := list(cmd.Context())
			if err != nil {
				return err
			}
			switch {
			case asJSON:
				return a.printJSON(sandboxes)
			case quiet:
				for _, s := range sandboxes {
					fmt.Fprintln(a.stdout, s.Name)
				}
				return nil
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tSTATUS\tBACKEND\tCLASS\tCPU\tMEMORY\tDISK\tIDLE\tEXECS\tCREATED\tLAYERS")
			for _, s := range sandboxes {
				cpu, mem, idle := "-", "-", "-"
				if s.Status == api.StatusRunning {
					cpu = fmt.Sprintf("%.2fs", s.CPUSeconds)
					idle = time.Duration(s.IdleSeconds * float64(time.Second)).Round(time.Second).String()
				}
				if s.MemoryBytes > 0 {
					mem = humanBytes(s.MemoryBytes)
				}
				if s.MemoryLimit > 0 && s.Status == api.StatusRunning {
					mem += "/" + humanBytes(s.MemoryLimit)
				}
				switch vm := s.VM; {
				case vm != nil && vm.Evicted:
					mem = "evicted"
				case vm != nil && vm.GuestMemoryUsed > 0: // what the guest uses of what the host holds
					mem = "guest " + humanBytes(vm.GuestMemoryUsed) + ", host " + mem
				}
				disk := "-"
				switch {
				case s.DiskLimit > 0:
					disk = humanBytes(s.DiskUsed) + "/" + humanBytes(s.DiskLimit)
				case s.DiskUsed > 0:
					disk = humanBytes(s.DiskUsed)
				}
				class := s.Class
				if class == "" {
					class = "-"
				}
				backend := s.Backend
				if s.VM != nil { // and what runs it
					backend += "/" + s.VM.Accel
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s ago\t%s\n", s.Name, s.Status, backend, class, cpu, mem, disk, idle, s.Execs,
					time.Since(s.Created).Round(time.Second), shownLayers(s))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.Flags().BoolVarP(&quiet, "quiet", "q", false, "print names only")
	cmd.Flags().BoolVarP(&all, "all", "a", false, "list the warm sandboxes of FnCall pools too")
	return cmd
}

// shownLayers is what ps shows of a sandbox's layers: an image's by the
// image's name.
func shownLayers(s api.Sandbox) string {
	if s.Image == "" {
		return strings.Join(s.Layers, ",")
	}
	var out []string
	for _, l := range s.Layers {
		if !strings.HasPrefix(l, "oci/sha256/") { // an image's layer tags (internal/layer/image)
			out = append(out, l)
		}
	}
	return strings.Join(append(out, s.Image), ",")
}

func (a *app) inspectCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:               "inspect NAME",
		Short:             "Describe a sandbox as JSON",
		Long:              "Inspect prints the sandbox's spec and state as JSON.\n\n" + exitCodesHelp,
		Args:              exactArgs(1),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			info, err := c.Sandbox(args[0]).Inspect(cmd.Context())
			if err != nil {
				return err
			}
			return a.printJSON(info)
		},
	}
	return cmd
}

// lifecycleCommand is stop, start, pause, resume and rm: one call per
// named sandbox; the flag is rm's --force, pause's --evict.
func (a *app) lifecycleCommand(use, short, long string, call func(context.Context, *sdk.Sandbox, bool) error) *cobra.Command {
	var force, asJSON bool
	cmd := &cobra.Command{
		Use:               use + " NAME...",
		Short:             short,
		Long:              long + "\n\n" + exitCodesHelp,
		ValidArgsFunction: a.completeSandboxes,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError{fmt.Errorf("%s needs at least one sandbox name", use)}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			return a.eachName(args, asJSON, func(name string) error { return call(cmd.Context(), c.Sandbox(name), force) })
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print each sandbox's name and error (if any) as a JSON list")
	switch use {
	case "rm":
		cmd.Flags().BoolVarP(&force, "force", "f", false, "remove running sandboxes too (their processes are killed)")
	case "pause":
		cmd.Flags().BoolVar(&force, "evict", false, "save each microVM's guest to disk and give its memory back to the host")
	}
	return cmd
}

func (a *app) sandboxCommands() []*cobra.Command {
	return []*cobra.Command{
		a.runCommand(), a.execCommand(), a.psCommand(), a.inspectCommand(), a.logsCommand(), a.cpCommand(), a.gradeCommand(), a.idleCommand(),
		a.screenCommand(), a.inputCommand(), a.vncCommand(),
		a.lifecycleCommand("stop", "Stop sandboxes, keeping their files",
			"Stop kills every process of each sandbox and unmounts its root; its files (everything it\nwrote) stay, and dsec start runs it again on them.",
			func(ctx context.Context, s *sdk.Sandbox, _ bool) error { return s.Stop(ctx) }),
		a.lifecycleCommand("start", "Start stopped sandboxes again on their files",
			"Start mounts a stopped (or dead) sandbox's layers and upper again and starts its init.\nProcesses do not come back: only files persist across stop and start.",
			func(ctx context.Context, s *sdk.Sandbox, _ bool) error { return s.Start(ctx) }),
		a.lifecycleCommand("pause", "Freeze sandboxes' processes where they are",
			"Pause freezes every process of each running sandbox, its memory kept (its page cache is\ngiven back to the host), until dsec resume: a paused sandbox uses no CPU and runs no exec.\nIt stays paused across worker restarts; stop and rm work on it.\n\nA paused microVM's guest can be evicted: saved to the worker's disk, its memory and device\nstate as a memory snapshot holds them, and its QEMU ended, its memory given back to the\nhost; resume restores it. --evict does so now; the worker does so by itself, to the one\npaused longest, while the host's memory pressure lasts. --evict of another backend's\nsandbox is refused (exit 8).",
			func(ctx context.Context, s *sdk.Sandbox, evict bool) error {
				if evict {
					return s.Evict(ctx)
				}
				return s.Pause(ctx)
			}),
		a.lifecycleCommand("resume", "Let paused sandboxes run on where they were",
			"Resume thaws each paused sandbox: its processes continue where pause froze them. An\nevicted microVM's guest is restored from the worker's disk first.",
			func(ctx context.Context, s *sdk.Sandbox, _ bool) error { return s.Resume(ctx) }),
		a.lifecycleCommand("rm", "Remove sandboxes",
			"Rm removes each sandbox: its processes, mounts, cgroup, files and journal. A running\nsandbox needs -f.",
			func(ctx context.Context, s *sdk.Sandbox, force bool) error { return s.Remove(ctx, force) }),
	}
}

func (a *app) logsCommand() *cobra.Command {
	var id string
	var follow bool
	cmd := &cobra.Command{
		Use:   "logs NAME",
		Short: "Print the recorded output of a sandbox's command",
		Long: `Logs prints the journaled stdout and stderr of the command dsec run started in the sandbox
(exec id "run"), or of the exec --id names. With -f it follows the output until the
command ends and exits with its exit code. It says on stderr when the journal kept less
than the command wrote: past the cap (exec.max_output, or the sandbox's disk bound), or
dropped since to keep the sandbox's journal within its disk bound.

` + exitCodesHelp,
		Args:              exactArgs(1),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			res, err := c.Sandbox(args[0]).Logs(cmd.Context(), id, follow, a.stdout, a.stderr)
			if errors.Is(err, sdk.ErrRunning) {
				return nil
			}
			if err != nil {
				return err
			}
			a.warnOutput(res)
			if follow && res.ExitCode != 0 {
				return cmdExit{res.ExitCode}
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&id, "id", "run", "the exec whose output to print")
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "follow the output until the command ends")
	return cmd
}
