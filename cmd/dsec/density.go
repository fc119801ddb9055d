//go:build !front

package main

import (
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime/worker"
)

// workerDensity is the worker's admission, reclaim and pool settings
// from the configuration.
func (a *app) workerDensity(cfg *worker.Config) error {
	ad := a.cfg.Admission
	cfg.Admission = worker.Admission{CPUOvercommit: ad.CPUOvercommit, MemoryOvercommit: ad.MemoryOvercommit,
		MaxCreating: ad.MaxCreating, QueueTimeout: ad.QueueTimeout, Spares: ad.Spares, Primed: ad.Primed}
	cfg.Admission.InodeFloor = ad.InodeFloor
	// Sizes, or negative for none.
	for _, f := range []struct {
		key, v string
		to     *int64
	}{{"admission.disk_floor", ad.DiskFloor, &cfg.Admission.DiskFloor},
		{"admission.worker_memory_min", ad.WorkerMemoryMin, &cfg.Admission.WorkerMemoryMin},
		{"admission.worker_memory_low", ad.WorkerMemoryLow, &cfg.Admission.WorkerMemoryLow}} {
		if f.v == "" {
			continue
		}
		n, err := parseBytes(strings.TrimPrefix(f.v, "-"))
		if err != nil {
			return usageError{fmt.Errorf("%s %q: give a size, such as 256M, or -1 for none", f.key, f.v)}
		}
		if strings.HasPrefix(f.v, "-") {
			n = -1
		}
		*f.to = n
	}
	if ad.UppersSize != "" {
		n, err := parseBytes(ad.UppersSize)
		if err != nil || n < 256<<20 {
			return usageError{fmt.Errorf("admission.uppers_size %q: give a size of at least 256M, such as 100G", ad.UppersSize)}
		}
		cfg.Admission.UppersSize = n
	}
	if ad.HostReserve != "" {
		n, err := parseBytes(ad.HostReserve)
		if err != nil {
			return usageError{fmt.Errorf("admission.host_reserve: %w", err)}
		}
		cfg.Admission.HostReserve = n
	}
	if err := cfg.Admission.Validate(); err != nil {
		return usageError{err}
	}
	cfg.Reclaim = worker.Reclaim{IdleAfter: a.cfg.Reclaim.IdleAfter, KSM: a.cfg.Reclaim.KSM, Pressure: a.cfg.Reclaim.Pressure, HintMin: a.cfg.Reclaim.HintMin}
	if p := cfg.Reclaim.Pressure; p > 100 {
		return usageError{fmt.Errorf("reclaim.pressure %g: give a percent of time stalled (PSI some avg10), 0-100, or negative for never", p)}
	}
	switch d := a.cfg.Defaults; {
	case d.Memory == "unlimited" || d.Memory == "-1":
		cfg.Defaults.Memory = api.Unlimited
	case d.Memory != "":
		n, err := parseBytes(d.Memory)
		if err != nil || n < 4<<20 {
			return usageError{fmt.Errorf("defaults.memory %q: give a size of at least 4M, such as 2G, or unlimited", d.Memory)}
		}
		cfg.Defaults.Memory = n
	}
	switch d := a.cfg.Defaults; {
	case d.Disk == "unlimited" || d.Disk == "-1":
		cfg.Defaults.Disk = api.Unlimited
	case d.Disk != "":
		n, err := parseBytes(d.Disk)
		if err != nil || n < api.MinDisk {
			return usageError{fmt.Errorf("defaults.disk %q: give a size of at least %dM, such as 10G, or unlimited", d.Disk, api.MinDisk>>20)}
		}
		cfg.Defaults.Disk = n
	}
	if p := a.cfg.Defaults.Pids; p < api.Unlimited {
		return usageError{fmt.Errorf("defaults.pids %d: give a count, or -1 for none", p)}
	} else {
		cfg.Defaults.Pids = p
	}
	for name, p := range a.cfg.Pools {
		spec := api.SandboxSpec{Backend: p.Backend, CPU: p.CPU, Class: p.Class, PolicyName: p.Policy, Env: p.Env, Workdir: p.Workdir, User: p.User, UserNS: p.UserNS}
		spec.Layers = layerStack(p.Toolkit, p.Workspace, p.Base)
		if p.Memory != "" {
			n, err := parseBytes(p.Memory)
			if err != nil {
				return usageError{fmt.Errorf("pools.%s.memory: %w", name, err)}
			}
			spec.Memory = n
		}
		cfg.Pools = append(cfg.Pools, worker.PoolConfig{Name: name, Size: p.Size, Spec: spec})
	}
	return nil
}

func (a *app) poolCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "pool",
		Short: "Manage the FnCall backend's pools of warm sandboxes",
		Long: `The FnCall backend runs short calls (dsec run --backend fncall, the SDK's Call) in sandboxes
made ahead of time: each pool keeps SIZE sandboxes of one template warm (layers mounted,
init running), a call takes one, runs its command and discards it (a call never sees what
an earlier call left), and the worker makes a new one in the background. A call whose
template matches no pool gets a sandbox made for it.

Pools come from the config file (pools.NAME.size, .base, ...) and from pool resize, which
the worker keeps across restarts.

` + exitCodesHelp,
	}
	cmd.AddCommand(a.poolLsCommand(), a.poolResizeCommand(), a.poolRmCommand())
	return cmd
}

func (a *app) poolLsCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the pools: size, warm sandboxes, calls",
		Args:    exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			pools, err := c.Pools(cmd.Context())
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(pools)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tSIZE\tWARM\tFILLING\tCALLS\tMISSES\tLAYERS\tERROR")
			for _, p := range pools {
				fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\n", p.Name, p.Size, p.Warm, p.Filling, p.Calls, p.Misses,
					strings.Join(p.Spec.Layers, ","), p.Error)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func (a *app) poolResizeCommand() *cobra.Command {
	var f specFlags
	var asJSON bool
	var backend string
	cmd := &cobra.Command{
		Use:   "resize NAME SIZE [--base REF ...]",
		Short: "Create a pool, or change how many warm sandboxes it keeps",
		Long: `Resize sets how many warm sandboxes the pool NAME keeps. A new pool needs its template:
the layers and resources of its sandboxes, as dsec run takes them; its first sandbox is
made before resize returns, so a template that cannot run is refused at once. SIZE 0
keeps the pool with no warm sandbox (calls then wait for one to be made).

` + exitCodesHelp,
		Example: `  dsec pool resize py 8 --base debian:12 --toolkit harness:3 --memory 512M
  dsec pool resize py 32
  dsec pool resize vms 4 --backend microvm --base debian:12 --memory 1G
  dsec run --backend fncall --pool py -- python3 -c 'print(1+1)'`,
		Args: exactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			var size int
			if _, err := fmt.Sscan(args[1], &size); err != nil || size < 0 {
				return usageError{fmt.Errorf("bad pool size %q: give a number of sandboxes, 0 or more", args[1])}
			}
			ps := api.PoolSpec{Size: size}
			if f.base != "" {
				spec, err := a.spec(f)
				if err != nil {
					return err
				}
				spec.Backend = backend
				ps.Spec = &spec
			} else {
				var given []string
				cmd.LocalNonPersistentFlags().VisitAll(func(fl *pflag.Flag) {
					if fl.Changed && fl.Name != "json" {
						given = append(given, "--"+fl.Name)
					}
				})
				if len(given) > 0 {
					return usageError{fmt.Errorf("%s describe a new pool's sandboxes: give --base REF too (an existing pool keeps its template)", strings.Join(given, ", "))}
				}
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			p, err := c.ResizePool(cmd.Context(), args[0], ps)
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(p)
			}
			_, err = fmt.Fprintf(a.stdout, "pool %s: size %d, %d warm\n", p.Name, p.Size, p.Warm)
			return err
		},
	}
	f.register(cmd.Flags())
	cmd.Flags().StringVar(&backend, "backend", "", "the backend of the pool's sandboxes: container (the default) or microvm (its guests wait booted and paused)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the pool as JSON")
	return cmd
}

func (a *app) poolRmCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "rm NAME...",
		Short: "Remove pools and discard their warm sandboxes",
		Long:  "Rm removes each pool and discards its warm sandboxes; it prints each name removed.\n\n" + exitCodesHelp,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError{errors.New("pool rm needs at least one pool name (dsec pool ls lists them)")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			return a.eachName(args, asJSON, func(name string) error { return c.RemovePool(cmd.Context(), name) })
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print each pool's name and error (if any) as a JSON list")
	return cmd
}
