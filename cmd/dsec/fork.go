//go:build !front

package main

import (
	"cmp"
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/dsec-project/dsec/api"
)

const leaseNote = `A lease holds fork groups, the sandboxes kept of them and their snapshots until it expires or
is removed: then each member and kept sandbox is removed and each snapshot untagged (its blobs go
at the next dsec layer gc), unless something else stands on it. A trainer renews its leases
(dsec lease renew); one that dies leaves nothing behind past their TTLs. Leases survive a
worker's restart, and expire all the same.`

func (a *app) forkCommand() *cobra.Command {
	var req api.ForkRequest
	var ttl time.Duration
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "fork SANDBOX -n K [--lease TTL | --lease-id ID]",
		Short: "Snapshot a sandbox and start K sandboxes on it: a group, held by a lease",
		Long: `Fork packs the sandbox's changes into a snapshot (as pack-diff: the sandbox runs on) and starts K
sandboxes on it (as branch: each with the sandbox's spec and policy), in one call: a group, named
group-..., with its snapshot (--tag, default fork-SANDBOX:N) and members (--name-prefix, default
the tag's, as a branch's). --lease TTL holds the group by a new lease of that duration, --lease-id
by one dsec lease create made; neither holds it until dsec group rm. A group whose members are all
removed by other means goes, with its snapshot.

dsec group ls and show list the members with their state and last exec; dsec group keep keeps one
(the next step's parent) and removes the others; dsec group rm removes them all.

` + leaseNote + "\n\n" + exitCodesHelp,
		Example: `  dsec snap fork rollout-7 -n 8 --lease 10m          # a GRPO group of 8, gone 10 minutes after the last renewal
  dsec lease renew lease-3f2a... --ttl 10m
  dsec group keep group-9c1e... fork-rollout-7-1-3   # the branch that becomes the next step's parent`,
		Args:              exactArgs(1),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, args []string) error {
			if req.N < 1 {
				return usageError{errors.New("fork needs -n K, the number of sandboxes (at least 1)")}
			}
			if ttl != 0 && req.Lease != "" {
				return usageError{errors.New("fork takes --lease TTL (a new lease) or --lease-id ID, not both")}
			}
			if ttl < 0 || ttl != 0 && ttl < time.Second {
				return usageError{fmt.Errorf("--lease %s: give a duration of a second or more, e.g. 10m", ttl)}
			}
			req.TTL = int(ttl.Round(time.Second).Seconds())
			c, err := a.client()
			if err != nil {
				return err
			}
			g, err := c.Sandbox(args[0]).Fork(cmd.Context(), req)
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(g)
			}
			return a.printGroup(g)
		},
	}
	fl := cmd.Flags()
	fl.IntVarP(&req.N, "n", "n", 0, "how many sandboxes (required)")
	fl.DurationVar(&ttl, "lease", 0, "hold the group by a new lease of this duration, e.g. 10m")
	fl.StringVar(&req.Lease, "lease-id", "", "hold the group by this lease (dsec lease create)")
	fl.StringVarP(&req.Tag, "tag", "t", "", "the snapshot's tag, NAME:STEP (default fork-SANDBOX:N)")
	fl.StringVar(&req.NamePrefix, "name-prefix", "", "name the members PREFIX-1 ... PREFIX-K")
	fl.BoolVar(&req.Memory, "memory", false, "a memory snapshot (a microVM): the members continue its processes")
	fl.BoolVar(&asJSON, "json", false, "print the group as JSON")
	return cmd
}

func (a *app) printGroup(g *api.Group) error {
	lease := g.Lease
	if lease == "" {
		lease = "none (held until dsec group rm)"
	}
	fmt.Fprintf(a.stdout, "group %s: %d members on %s, of %s; lease %s\n", g.ID, len(g.Members), g.Snapshot, g.Sandbox, lease)
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MEMBER\tSTATUS\tEXECS\tLAST EXEC")
	for _, m := range g.Members {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\n", m.Name, m.Status, m.Execs, cmp.Or(m.LastExec, "-"))
	}
	return tw.Flush()
}

func (a *app) printReleased(r *api.Released) {
	fmt.Fprintf(a.stdout, "removed %s; untagged %s", dash(r.Sandboxes), dash(r.Snapshots))
	if len(r.Kept) > 0 {
		fmt.Fprintf(a.stdout, "; kept %s", strings.Join(r.Kept, ","))
	}
	fmt.Fprintln(a.stdout)
}

func (a *app) groupCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "group",
		Short: "List, show, keep one of and remove fork groups",
		Long: `A fork group is what dsec snap fork made: a snapshot of a sandbox and the sandboxes started on it.

` + leaseNote,
	}
	ls := a.groupLs()
	var showJSON bool
	show := &cobra.Command{
		Use:   "show GROUP",
		Short: "Show a fork group's members: state, execs, last exec id",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			g, err := c.Group(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if showJSON {
				return a.printJSON(g)
			}
			return a.printGroup(g)
		},
	}
	show.Flags().BoolVar(&showJSON, "json", false, "print JSON")
	rm := &cobra.Command{
		Use:   "rm GROUP",
		Short: "Remove a fork group's members, and its snapshot unless something else stands on it",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			r, err := c.RemoveGroup(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			a.printReleased(r)
			return nil
		},
	}
	keep := &cobra.Command{
		Use:   "keep GROUP MEMBER",
		Short: "Keep one member of a fork group and remove the others",
		Long: `Keep keeps MEMBER, the branch that becomes the next step's parent, and removes the group's other
members; the group is no more. The member, and the snapshot it stands on, stay held by the group's
lease (a group without one: they stay until removed).`,
		Args: exactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			r, err := c.KeepMember(cmd.Context(), args[0], args[1])
			if err != nil {
				return err
			}
			a.printReleased(r)
			return nil
		},
	}
	cmd.AddCommand(ls, show, rm, keep)
	return cmd
}

func (a *app) groupLs() *cobra.Command {
	var asJSON bool
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List fork groups and their members",
		Args:  exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			gs, err := c.Groups(cmd.Context())
			if err != nil {
				return err
			}
			if asJSON {
				if gs == nil {
					gs = []api.Group{}
				}
				return a.printJSON(gs)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "GROUP\tSANDBOX\tSNAPSHOT\tLEASE\tMEMBERS\tCREATED")
			for _, g := range gs {
				var ms []string
				for _, m := range g.Members {
					ms = append(ms, m.Name+"("+m.Status+")")
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", g.ID, g.Sandbox, g.Snapshot, cmp.Or(g.Lease, "-"), dash(ms), g.Created.Local().Format(time.DateTime))
			}
			return tw.Flush()
		},
	}
	ls.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return ls
}

func (a *app) leaseCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "lease",
		Short: "Make, list, renew and end leases, which hold fork groups",
		Long:  leaseNote,
	}
	cmd.AddCommand(a.leaseCreate(), a.leaseLs(), a.leaseRenew(), a.leaseRm())
	return cmd
}

// leaseTTL is a --ttl in whole seconds.
func leaseTTL(d time.Duration) (int, error) {
	if d < time.Second {
		return 0, usageError{errors.New("give --ttl, a duration of a second or more (e.g. 10m)")}
	}
	return int(d.Round(time.Second).Seconds()), nil
}

func (a *app) printLease(l *api.Lease) {
	fmt.Fprintf(a.stdout, "%s\texpires %s (in %s)\n", l.ID, l.Expires.Local().Format(time.DateTime), time.Until(l.Expires).Round(time.Second))
}

func (a *app) leaseCreate() *cobra.Command {
	var ttl time.Duration
	var asJSON bool
	create := &cobra.Command{
		Use:     "create --ttl TTL",
		Short:   "Make a lease for forks to name (--lease-id)",
		Example: "  dsec lease create --ttl 10m",
		Args:    exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, err := leaseTTL(ttl)
			if err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			l, err := c.CreateLease(cmd.Context(), s)
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(l)
			}
			a.printLease(l)
			return nil
		},
	}
	create.Flags().DurationVar(&ttl, "ttl", 0, "how long the lease lives unless renewed (required)")
	create.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return create
}

func (a *app) leaseRenew() *cobra.Command {
	var renewTTL time.Duration
	renew := &cobra.Command{
		Use:   "renew LEASE --ttl TTL",
		Short: "Make a lease expire TTL from now",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := leaseTTL(renewTTL)
			if err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			l, err := c.RenewLease(cmd.Context(), args[0], s)
			if err != nil {
				return err
			}
			a.printLease(l)
			return nil
		},
	}
	renew.Flags().DurationVar(&renewTTL, "ttl", 0, "the lease expires this long from now (required)")
	return renew
}

func (a *app) leaseLs() *cobra.Command {
	var lsJSON bool
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List leases and what each holds",
		Args:  exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			ls, err := c.Leases(cmd.Context())
			if err != nil {
				return err
			}
			if lsJSON {
				if ls == nil {
					ls = []api.Lease{}
				}
				return a.printJSON(ls)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "LEASE\tEXPIRES IN\tGROUPS\tKEPT\tSNAPSHOTS")
			for _, l := range ls {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", l.ID, time.Until(l.Expires).Round(time.Second), dash(l.Groups), dash(l.Kept), dash(l.Holds))
			}
			return tw.Flush()
		},
	}
	ls.Flags().BoolVar(&lsJSON, "json", false, "print JSON")
	return ls
}

func (a *app) leaseRm() *cobra.Command {
	rm := &cobra.Command{
		Use:   "rm LEASE",
		Short: "End a lease now: what it holds is removed",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			r, err := c.RemoveLease(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			a.printReleased(r)
			return nil
		},
	}
	return rm
}
