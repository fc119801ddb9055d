//go:build !front

package main

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/dsec-project/dsec/api"

	"github.com/dsec-project/dsec/internal/egress"
	"github.com/dsec-project/dsec/internal/layer/lazy"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/runtime/driver/vms"
	"github.com/dsec-project/dsec/internal/runtime/microvm"
	"github.com/dsec-project/dsec/internal/runtime/vm"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/internal/snap"
	"github.com/dsec-project/dsec/sdk"
)

func (a *app) daemonCommand() *cobra.Command {
	var f daemonFlags
	cmd := &cobra.Command{
		Use:         "daemon",
		Short:       "Run the host worker that owns the root's sandboxes",
		Annotations: map[string]string{localAnnotation: "true"},
		Long: `Daemon runs the worker: the one process that owns the sandboxes and mounts under --root
and serves the versioned HTTP/JSON API (package api) on <root>/dsec.sock, for the dsec CLI
and the Go SDK (package sdk). The CLI starts one on demand (with --exit-idle 10m); hosts
that prefer a supervised worker run it from systemd (contrib/systemd/dsec.service).

Sandboxes do not depend on the worker: each sandbox's init and each lazy layer's fetcher
is a process of its own. A worker that stops or dies (kill -9 included) leaves them
running, and the next worker on the root re-adopts them, collects the results of the
commands that ran meanwhile, and removes the sandboxes a dying worker left half-created.
What a worker made ahead of need (spare inits, primed sandboxes, FnCall pools' warm
sandboxes) goes with a worker stopped on purpose (SIGTERM, SIGINT, dsec daemon stop); the
next worker removes what a killed one left of it.
Layers missing from the local store are mounted lazily from the configured remote.

With --listen (or listen: in the config) it serves the same API on TCP too, for trainers on
other machines (dsec --host, DSEC_HOST; the SDKs' host option). Every TCP request carries a
token (dsec token create; DSEC_TOKEN on the client): none, or a wrong or expired one, is
refused 401. Off loopback it takes TLS only: --tls-cert and --tls-key (dsec daemon certs
makes them), and with --tls-client-ca only clients with a certificate that CA signed.

With --e2b-listen HOST:PORT (or e2b.listen in the config) it speaks E2B's API too, so the
official E2B SDKs and the agent frameworks built on them drive dsec sandboxes unchanged: set
E2B_API_URL and E2B_SANDBOX_URL to http://HOST:PORT (https:// with TLS, which it takes as the
TCP API does: HTTP/1.1, and HTTP/2 too with e2b.http2 in the config) and E2B_API_KEY to a token (dsec token create --e2b makes one shaped as E2B's
keys). A template ID is a name under e2b.templates in the config (layers, toolkit first, and
the sandboxes' cpu, memory, disk, pids, policy, backend, class, env, workdir, userns), a
snapshot (NAME:STEP, what createSnapshot answers) or one layer ref. The README's "Using dsec
with E2B-based frameworks" says what maps to what.

` + exitCodesHelp,
		Example: `  dsec daemon                  # in the foreground, logs on stderr
  dsec daemon stop             # ask the root's worker to exit; sandboxes run on
  dsec daemon --listen tcp://127.0.0.1:7070     # TCP on loopback (tokens, no TLS)
  dsec daemon certs /etc/dsec/tls --name worker1.example
  dsec daemon --listen tcp://0.0.0.0:7443 --tls-cert /etc/dsec/tls/server.pem --tls-key /etc/dsec/tls/server-key.pem
  dsec daemon --e2b-listen 127.0.0.1:3000     # E2B_API_URL=E2B_SANDBOX_URL=http://127.0.0.1:3000`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.runDaemon(cmd, f)
		},
	}
	f.register(cmd.Flags())
	cmd.AddCommand(a.certsCommand())
	cmd.AddCommand(a.daemonStop())
	return cmd
}

// daemonFlags are dsec daemon's flags: each one given overrides the
// config's.
type daemonFlags struct {
	exitIdle  time.Duration
	insecure  bool
	listen    []string
	tls       ServerTLSConfig
	e2bListen string
}

func (f *daemonFlags) register(fl *pflag.FlagSet) {
	fl.DurationVar(&f.exitIdle, "exit-idle", 0, "exit after this long without sandboxes or requests (0: never)")
	fl.BoolVar(&f.insecure, "insecure", false, "no longer needed: a registry on localhost is spoken to over plain HTTP without it")
	fl.StringArrayVar(&f.listen, "listen", nil, "serve the API on tcp://HOST:PORT too, with tokens (repeatable; config listen)")
	fl.StringVar(&f.tls.Cert, "tls-cert", "", "the TCP API's TLS certificate (config tls.cert; needed off loopback)")
	fl.StringVar(&f.tls.Key, "tls-key", "", "its key (config tls.key)")
	fl.StringVar(&f.tls.ClientCA, "tls-client-ca", "", "take only clients with a certificate this CA signed (config tls.client_ca)")
	fl.StringVar(&f.e2bListen, "e2b-listen", "", "serve E2B's API on HOST:PORT, for the E2B SDKs (config e2b.listen)")
}

// runDaemon is dsec daemon: the worker, as the config and the flags
// given over it say, until cmd's context ends.
func (a *app) runDaemon(cmd *cobra.Command, f daemonFlags) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	var target remote.Target
	if a.cfg.Remote != "" {
		if target, err = a.openRemote("", f.insecure); err != nil {
			return err
		}
	}
	registries, err := a.registryOptions("", nil)
	if err != nil {
		return err
	}
	if m := a.cfg.VM.MaxChain; m < 0 || m > vm.MaxChain {
		return usageError{fmt.Errorf("vm.max_chain %d: give 1 to %d images (0: %d)", m, vm.MaxChain, vm.MaxChain)}
	}
	cfg := worker.Config{
		Registries: registries,
		Root:       a.cfg.Root, AdminTokenFile: a.cfg.AdminTokenFile, Version: version, Remote: target, Insecure: f.insecure, Cache: a.cfg.Cache.tuning(),
		Fetcher:          lazy.Start{Path: exe, Args: []string{"--root", a.cfg.Root, "--log-level", "info", "layer", "fetcher"}},
		Log:              a.log,
		ExitIdle:         f.exitIdle,
		KeepLayers:       a.cfg.Cache.KeepMounted,
		MaxOutput:        a.cfg.Exec.MaxOutput,
		PublishSnapshots: a.cfg.Snap.Publish,
		SnapLimits:       snap.Limits{MaxBytes: a.cfg.Snap.MaxBytes, MaxEntries: a.cfg.Snap.MaxEntries, MaxDepth: a.cfg.Snap.MaxDepth},
		Listen:           a.cfg.Listen,
		TLS:              worker.TLS{Cert: a.cfg.TLS.Cert, Key: a.cfg.TLS.Key, ClientCA: a.cfg.TLS.ClientCA},
		MaxRequests:      a.cfg.API.MaxRequests, MaxRequestsPerToken: a.cfg.API.MaxRequestsPerToken,
		MicroVM: microvm.Settings{Kernel: a.cfg.MicroVM.Kernel, Accel: a.cfg.MicroVM.Accel, QEMU: a.cfg.MicroVM.QEMU,
			Agent: a.cfg.MicroVM.Agent, BootTimeout: a.cfg.MicroVM.BootTimeout},
		VM: vms.Settings{Accel: a.cfg.VM.Accel, QEMU: a.cfg.VM.QEMU, Agent: a.cfg.MicroVM.Agent, BootTimeout: a.cfg.VM.BootTimeout,
			MaxChain: a.cfg.VM.MaxChain},
		DNS: egress.Config{Upstream: a.cfg.DNS.Upstream, MinTTL: a.cfg.DNS.MinTTL, Grace: a.cfg.DNS.Grace},
	}
	fl := cmd.Flags()
	if fl.Changed("listen") {
		cfg.Listen = f.listen
	}
	if fl.Changed("tls-cert") {
		cfg.TLS.Cert = f.tls.Cert
	}
	if fl.Changed("tls-key") {
		cfg.TLS.Key = f.tls.Key
	}
	if fl.Changed("tls-client-ca") {
		cfg.TLS.ClientCA = f.tls.ClientCA
	}
	cfg.E2B.Listen, cfg.E2B.Domain, cfg.E2B.ImageKeys, cfg.E2B.HTTP2 = a.cfg.E2B.Listen, a.cfg.E2B.Domain, a.cfg.E2B.ImageKeys, a.cfg.E2B.HTTP2
	if fl.Changed("e2b-listen") {
		cfg.E2B.Listen = f.e2bListen
	}
	if cfg.E2B.Templates, err = a.e2bTemplates(); err != nil {
		return err
	}
	if err := a.workerDensity(&cfg); err != nil {
		return err
	}
	return worker.Serve(cmd.Context(), cfg)
}

// daemonStop is dsec daemon stop.
func (a *app) daemonStop() *cobra.Command {
	return &cobra.Command{
		Use:   "stop",
		Short: "Ask the root's worker to exit (its sandboxes run on)",
		Long: `Stop asks the root's worker to exit, waits until it has, and prints its pid. Its
sandboxes run on, for the next worker to adopt. What it made ahead of need goes with it: its
spare inits, primed sandboxes and FnCall pools' warm sandboxes (the next worker makes its
own); creates under way, and those being made ahead, are finished first. Stop waits ` + stopWait.String() + `
at most; a worker still busy then is an error: kill -9 stops it at once, and the next worker
on the root removes what it made ahead.

` + exitCodesHelp,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := sdk.New(sdk.Options{Root: a.cfg.Root})
			if err != nil {
				fmt.Fprintf(a.stderr, "dsec: no worker serves %s\n", a.cfg.Root)
				return nil
			}
			v, err := c.Version(cmd.Context())
			if err != nil {
				return err
			}
			if err := c.Shutdown(cmd.Context()); err != nil {
				return err
			}
			if err := waitExit(cmd.Context(), v.Pid, stopWait); err != nil {
				return fmt.Errorf("the worker of %s (pid %d) %w", a.cfg.Root, v.Pid, err)
			}
			fmt.Fprintln(a.stdout, v.Pid)
			return nil
		},
	}
}

// stopWait bounds dsec daemon stop's wait for the worker to exit: it
// removes what it made ahead, each thing once it is made (a microVM's
// boot under TCG takes up to its 90 s timeout), and unmounts the layers
// it kept mounted for reuse.
const stopWait = 3 * time.Minute

// waitExit waits until process pid has exited, for up to d.
func waitExit(ctx context.Context, pid int, d time.Duration) error {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	deadline := time.After(d)
	for !exited(pid) {
		select {
		case <-ctx.Done():
			return fmt.Errorf("was still exiting when the wait was cut short: %w", ctx.Err())
		case <-deadline:
			return fmt.Errorf("has not exited after %v: kill -9 it to stop it now (the next worker removes what it made ahead)", d)
		case <-t.C:
		}
	}
	return nil
}

// e2bTemplates are the config's e2b.templates as sandbox specs.
func (a *app) e2bTemplates() (map[string]api.SandboxSpec, error) {
	out := map[string]api.SandboxSpec{}
	for name, t := range a.cfg.E2B.Templates {
		if len(t.Layers) == 0 && t.Image == "" {
			return nil, usageError{fmt.Errorf("e2b.templates.%s: give its layers (a list of refs, toolkit first), or an image, or both", name)}
		}
		spec := api.SandboxSpec{Layers: t.Layers, Image: t.Image, Pull: t.Pull, CPU: t.CPU, Pids: t.Pids, PolicyName: t.Policy, Backend: t.Backend, Class: t.Class,
			Env: t.Env, Workdir: t.Workdir, UserNS: t.UserNS}
		for _, size := range []struct {
			key, v string
			to     *int64
		}{{"memory", t.Memory, &spec.Memory}, {"disk", t.Disk, &spec.Disk}} {
			if size.v == "" {
				continue
			}
			n, err := parseBytes(size.v)
			if err != nil {
				return nil, usageError{fmt.Errorf("e2b.templates.%s.%s: %w", name, size.key, err)}
			}
			*size.to = n
		}
		if err := api.CheckClass(spec.Class); err != nil {
			return nil, usageError{fmt.Errorf("e2b.templates.%s: %w", name, err)}
		}
		if err := spec.Validate(); err != nil {
			return nil, usageError{fmt.Errorf("e2b.templates.%s: %w", name, err)}
		}
		out[name] = spec
	}
	return out, nil
}

// tuning is the lazy mounts' settings from the configuration.
func (c CacheConfig) tuning() lazy.Tuning {
	return lazy.Tuning{MaxBytes: c.MaxBytes, ReadAheadKB: c.ReadAheadKB}
}

// exited says whether process pid is gone (or a zombie nobody reaped).
func exited(pid int) bool {
	if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
		return true
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return errors.Is(err, fs.ErrNotExist)
	}
	_, rest, _ := strings.Cut(string(b), ") ")
	return strings.HasPrefix(rest, "Z")
}
