//go:build !front

package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/snap"
	"github.com/dsec-project/dsec/sdk"
)

const snapNote = `A snapshot holds files: a branch or a restore starts fresh processes on the captured disk
state. A memory snapshot (pack-diff --memory, of a microVM or a full VM) holds the guest whole too,
its processes and memory (a full VM's screen too): its branches (and a microVM's restores)
continue where it stopped (--disk-only: on its files alone, booted), each told it was cloned
(clock stepped, RNG reseeded, host name and network its own). A host whose QEMU build, guest
kernel, firmware or VM agent differs refuses it.`

func (a *app) snapCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "snap",
		Short: "Snapshot sandboxes, branch them and keep their lineage",
		Long: `Snapshots capture a sandbox's changes as an incremental layer (pack-diff) and start new
sandboxes from it (branch, restore), sharing every read-only layer; ls shows the lineage,
rm and squash keep it tidy. A snapshot is a layer: dsec layer push, pull and mount apply.

` + snapNote,
	}
	cmd.AddCommand(a.packDiffCommand(), a.branchCommand(), a.forkCommand(), a.restoreCommand(), a.snapLsCommand(), a.snapRmCommand(), a.squashCommand())
	return cmd
}

func (a *app) packDiffCommand() *cobra.Command {
	var tag string
	var asJSON, memory bool
	var maxBytes string
	var maxEntries, maxDepth int
	cmd := &cobra.Command{
		Use:   "pack-diff SANDBOX -t NAME:STEP",
		Short: "Snapshot a running sandbox's changes as a layer",
		Long: `Pack-diff freezes the sandbox (cgroup freezer), packs what it wrote into an EROFS layer
tagged NAME:STEP and thaws it; the sandbox runs on. Its first snapshot holds everything it
wrote over its layers; each later one only what changed since the previous, which is its
parent. Whiteouts, opaque directories, xattrs, hard links, modes and owners are kept:
stacked over its parents, a snapshot reproduces the sandbox's files exactly. Device nodes
and trusted.* xattrs other than overlay's markers are dropped (and listed); sizes, entry
count and depth are bounded by --max-bytes, --max-entries and --max-depth. A pack with
nothing changed since the previous snapshot is refused (exit 8): that snapshot holds the
state already, and a snapshot is never its own parent.

--memory (a microVM) adds the guest whole: its memory and device state, saved with the
guest paused for as short as QEMU allows (its RAM is a shared memory file, written out as a
sparse image; its device state goes through migration to a file), and its disk. Its diff is
whole, never an increment. No command may run in it meanwhile (exit 9 if one does); a
sandbox of another backend is refused (exit 8).

A full VM's snapshot (--backend vm) is a block diff of its disk: what the guest wrote since
it started or was last snapshotted, its root file system frozen meanwhile, as a qcow2 image
over the disk's chain. The snapshot is a VM image (dsec vm image ls lists it) that its
branches boot; --max-bytes bounds the diff (one over it is refused before anything is taken).

` + snapNote + "\n\n" + exitCodesHelp,
		Example: `  dsec snap pack-diff rollout-7 -t rollout-7:12
  dsec snap pack-diff rollout-7 -t rollout-7:13 --json
  dsec snap pack-diff vm-7 -t vm-7:3 --memory      # a microVM, processes and all
  dsec snap pack-diff desk -t desk:1               # a full VM: a block diff of its disk`,
		Args:              exactArgs(1),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, args []string) error {
			if tag == "" {
				return usageError{errors.New("pack-diff needs -t NAME:STEP, the snapshot's tag")}
			}
			req := api.PackRequest{Tag: tag, MaxEntries: maxEntries, MaxDepth: maxDepth, Memory: memory}
			if maxBytes != "" {
				n, err := parseBytes(maxBytes)
				if err != nil {
					return err
				}
				req.MaxBytes = n
			}
			if maxEntries < 0 || maxDepth < 0 {
				return usageError{errors.New("--max-entries and --max-depth must be positive")}
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			s, err := c.Sandbox(args[0]).PackDiff(cmd.Context(), req)
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(s)
			}
			kind := "whole"
			if s.Incremental {
				kind = "increment"
			}
			if s.BlockDiff {
				what := kind + " over " + s.Parent + ": a block diff of the VM's disk"
				if s.Parent == "" {
					what = "whole: the VM's disk, its chain flattened"
				}
				fmt.Fprintf(a.stdout, "%s\t%s, %s; frozen %s\n", s.Name, what,
					humanBytes(s.Size), time.Duration(s.FrozenSeconds*float64(time.Second)).Round(time.Millisecond))
				return nil
			}
			fmt.Fprintf(a.stdout, "%s\t%s over %s: %d paths, %s of files, %d whiteouts, %s layer; frozen %s\n", s.Name, kind,
				s.Parent, s.Entries-s.Unchanged, humanBytes(s.Bytes), s.Whiteouts, humanBytes(s.Size),
				time.Duration(s.FrozenSeconds*float64(time.Second)).Round(time.Millisecond))
			if m := s.Memory; m != nil {
				fmt.Fprintf(a.stdout, "%s\tmemory: %s guest, %d vCPUs; RAM %s, disk %s, device state %s; paused %s\n", s.Name,
					humanBytes(m.MemoryBytes), m.CPUs, humanBytes(m.RAMBytes), humanBytes(m.DiskBytes), humanBytes(m.StateBytes),
					time.Duration(m.PausedSeconds*float64(time.Second)).Round(time.Millisecond))
			}
			for _, d := range s.Dropped {
				fmt.Fprintf(a.stderr, "dsec: dropped %s\n", d)
			}
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVarP(&tag, "tag", "t", "", "the snapshot's tag, NAME:STEP (required, new)")
	fl.BoolVar(&asJSON, "json", false, "print the snapshot as JSON")
	fl.BoolVar(&memory, "memory", false, "a memory snapshot: the guest's memory, device state and disk too (a microVM or a full VM)")
	fl.StringVar(&maxBytes, "max-bytes", "", fmt.Sprintf("refuse more file data than this, e.g. 10G (default %s)", humanBytes(snap.DefaultMaxBytes)))
	fl.IntVar(&maxEntries, "max-entries", 0, fmt.Sprintf("refuse more changed paths than this (default %d)", snap.DefaultMaxEntries))
	fl.IntVar(&maxDepth, "max-depth", 0, fmt.Sprintf("refuse directories nested deeper than this (default %d)", snap.DefaultMaxDepth))
	return cmd
}

type branchFlags struct {
	n                int
	prefix, name     string
	cpu              float64
	memory, disk     string
	pids             int64
	env              []string
	workdir, backend string
	user             string
	policy           string
	asJSON, userns   bool
	diskOnly         bool
}

func (f *branchFlags) spec(a *app) (api.SandboxSpec, error) {
	spec := api.SandboxSpec{Backend: f.backend, CPU: f.cpu, Pids: f.pids, Env: f.env, Workdir: f.workdir, User: f.user, UserNS: f.userns, DiskOnly: f.diskOnly}
	var err error
	if spec.Policy, spec.PolicyName, err = a.policyArg(f.policy); err != nil {
		return spec, err
	}
	if err := sizes(&spec, f.memory, f.disk); err != nil {
		return spec, err
	}
	return spec, checkEnv(f.env)
}

func (f *branchFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringVar(&f.backend, "backend", "", "the backend to run them on (default: microvm for a memory snapshot, else the worker's default, container)")
	fl.BoolVar(&f.diskOnly, "disk-only", false, "start on a memory snapshot's files (a full VM's: its disk) alone, fresh processes (default: continue its guest)")
	fl.Float64Var(&f.cpu, "cpu", 0, "CPU limit of each, in CPUs")
	fl.StringVar(&f.memory, "memory", "", "memory limit of each, e.g. 512M")
	fl.StringVar(&f.disk, "disk", "", "disk quota of each on what it writes, on a file system of its own, e.g. 10G; unlimited: none of its own (default: the worker's bound, defaults.disk)")
	fl.Int64Var(&f.pids, "pids", 0, "limit on the processes and threads of each (its init's not counted)")
	fl.StringArrayVarP(&f.env, "env", "e", nil, "K=V for every command (repeatable)")
	fl.StringVarP(&f.workdir, "workdir", "w", "", "every command's default working directory")
	fl.StringVarP(&f.user, "user", "u", "", "every command's default user (default: the snapshot's sandbox's)")
	fl.StringVar(&f.policy, "policy", "", "a policy file, or the name of a stored one (default: the secure default)")
	fl.BoolVar(&f.asJSON, "json", false, "print the sandboxes as JSON")
	fl.BoolVar(&f.userns, "userns", false, "run each in a user namespace of its own")
}

// printSandboxes prints the names of sbs, or with asJSON each described.
func (a *app) printSandboxes(ctx context.Context, sbs []*sdk.Sandbox, asJSON bool) error {
	if !asJSON {
		for _, sb := range sbs {
			fmt.Fprintln(a.stdout, sb.Name)
		}
		return nil
	}
	list := make([]api.Sandbox, 0, len(sbs))
	for _, sb := range sbs {
		d, err := sb.Inspect(ctx)
		if err != nil {
			return err
		}
		list = append(list, d)
	}
	return a.printJSON(list)
}

func (a *app) branchCommand() *cobra.Command {
	var f branchFlags
	cmd := &cobra.Command{
		Use:   "branch SNAPSHOT -n K",
		Short: "Start K sandboxes on one snapshot",
		Long: `Branch starts K sandboxes on a snapshot, named PREFIX-1 ... PREFIX-K (default prefix: the
snapshot's tag with '/' and ':' as '-', numbered on after the highest such branch already
there, so a second branch never collides; a --name-prefix any of whose names is taken is
refused, exit 5, before anything starts), with the environment and working directory of the
sandbox the snapshot came from unless --env or --workdir is given. Each stacks its own empty upper over the snapshot and
the layers under it, which all branches share: one mount, one page cache, and for lazily
mounted layers one fetcher and one cache. Either all K start or none is kept.

` + snapNote + "\n\n" + exitCodesHelp,
		Example: `  # 8 rollouts from step 12 of rollout-7
  dsec snap branch rollout-7:12 -n 8 --name-prefix r7s12
  dsec exec r7s12-3 -- pytest -x
  # 3 microVMs that continue a memory snapshot, their processes running
  dsec snap branch vm-7:3 -n 3`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if f.n < 1 {
				return usageError{errors.New("branch needs -n K, the number of sandboxes (at least 1)")}
			}
			spec, err := f.spec(a)
			if err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			sbs, err := c.Branch(cmd.Context(), api.BranchRequest{Snapshot: args[0], N: f.n, NamePrefix: f.prefix, Spec: spec})
			if err != nil {
				return err
			}
			return a.printSandboxes(cmd.Context(), sbs, f.asJSON)
		},
	}
	cmd.Flags().IntVarP(&f.n, "n", "n", 0, "how many sandboxes (required)")
	cmd.Flags().StringVar(&f.prefix, "name-prefix", "", "name them PREFIX-1 ... PREFIX-K")
	f.register(cmd)
	return cmd
}

func (a *app) restoreCommand() *cobra.Command {
	var f branchFlags
	cmd := &cobra.Command{
		Use:   "restore SNAPSHOT [--name NAME]",
		Short: "Start one sandbox on a snapshot",
		Long: `Restore starts one sandbox on a snapshot (branch with K=1), with its own empty upper over the
snapshot and the layers under it.

` + snapNote + "\n\n" + exitCodesHelp,
		Example: `  dsec snap restore rollout-7:12 --name debug-r7
  dsec exec -it debug-r7 -- sh`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			spec, err := f.spec(a)
			if err != nil {
				return err
			}
			spec.Name, spec.Snapshot = f.name, args[0]
			c, err := a.client()
			if err != nil {
				return err
			}
			sb, err := c.Create(cmd.Context(), spec)
			if err != nil {
				return err
			}
			if f.asJSON { // one object, as dsec inspect prints
				d, err := sb.Inspect(cmd.Context())
				if err != nil {
					return err
				}
				return a.printJSON(d)
			}
			return a.printSandboxes(cmd.Context(), []*sdk.Sandbox{sb}, false)
		},
	}
	cmd.Flags().StringVar(&f.name, "name", "", "the sandbox's name (default: generated)")
	f.register(cmd)
	return cmd
}

func (a *app) snapLsCommand() *cobra.Command {
	var tree, asJSON bool
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "List snapshots and their lineage",
		Long: `Ls lists the snapshots, oldest first: tag, parent, the sandbox it was packed from, whether it
is an increment (+memory: a memory snapshot, its size its guest's too), its size, the
snapshots taken over it and the sandboxes standing on it.
--tree draws the lineage as a tree under the layers the first snapshots stand on; --json
prints every field (branches: sandboxes started on it; sandboxes: all standing on it).

` + exitCodesHelp,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			nodes, err := c.Snapshots(cmd.Context())
			if err != nil {
				return err
			}
			if asJSON {
				if nodes == nil {
					nodes = []api.SnapshotNode{}
				}
				return a.printJSON(nodes)
			}
			if tree {
				return a.printTree(nodes)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "SNAPSHOT\tPARENT\tFROM\tKIND\tSIZE\tCREATED\tCHILDREN\tSANDBOXES")
			for _, n := range nodes {
				kind := "whole"
				if n.Incremental {
					kind = "increment"
				}
				if n.MemoryBytes > 0 {
					kind += "+memory"
					n.Size += n.MemoryBytes
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", n.Name, n.Parent, n.Sandbox, kind, humanBytes(n.Size),
					n.Created.Local().Format(time.DateTime), dash(n.Children), dash(n.Sandboxes))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&tree, "tree", false, "draw the lineage as a tree")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func dash(s []string) string {
	if len(s) == 0 {
		return "-"
	}
	return strings.Join(s, ",")
}

// printTree draws each snapshot under its parent, and the sandboxes
// started on a snapshot under it; roots are the layers the first
// snapshots were taken over.
func (a *app) printTree(nodes []api.SnapshotNode) error {
	byName := map[string]*api.SnapshotNode{}
	for i := range nodes {
		byName[nodes[i].Name] = &nodes[i]
	}
	var roots []string
	seen := map[string]bool{}
	for _, n := range nodes {
		if byName[n.Parent] == nil && !seen[n.Parent] {
			seen[n.Parent] = true
			roots = append(roots, n.Parent)
		}
	}
	// Each snapshot is drawn once: one met again (a store whose lineage
	// an older dsec made cyclic, or a node under two parents) is named,
	// not walked, so the drawing is bounded by the nodes.
	drawn := map[string]bool{}
	var draw func(name, indent string, last bool, top bool)
	draw = func(name, indent string, last, top bool) {
		n := byName[name]
		label := name
		if n != nil {
			label = fmt.Sprintf("%s  (%s, from %s)", name, humanBytes(n.Size), n.Sandbox)
			if len(n.HeldBy) > 0 {
				label += "  held by " + strings.Join(n.HeldBy, ", ")
			}
			if drawn[name] {
				n, label = nil, name+"  (drawn above)"
			}
			drawn[name] = true
		} else if !top {
			label = name + "  (sandbox)"
		}
		branch, next := "├── ", "│   "
		if last {
			branch, next = "└── ", "    "
		}
		if top {
			branch, next = "", ""
		}
		fmt.Fprintln(a.stdout, indent+branch+label)
		var kids []string
		if n != nil {
			kids = append(kids, n.Children...)
			kids = append(kids, n.Branches...)
		} else if top {
			for _, m := range nodes {
				if m.Parent == name {
					kids = append(kids, m.Name)
				}
			}
		}
		for i, k := range kids {
			draw(k, indent+next, i == len(kids)-1, false)
		}
	}
	for _, r := range roots {
		draw(r, "", true, true)
	}
	return nil
}

func (a *app) snapRmCommand() *cobra.Command {
	var force, asJSON bool
	cmd := &cobra.Command{
		Use:   "rm SNAPSHOT...",
		Short: "Remove snapshots nothing stands on",
		Long: `Rm untags snapshots; their blobs go at the next dsec layer gc. It refuses to remove a
snapshot that another snapshot or a sandbox still stands on, unless --force: then only
the tag goes, and gc keeps the snapshot, untagged, while they stand on it.

` + exitCodesHelp,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError{errors.New("rm needs at least one snapshot (dsec snap ls lists them)")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			return a.eachName(args, asJSON, func(ref string) error { return c.RemoveSnapshot(cmd.Context(), ref, force) })
		},
	}
	cmd.Flags().BoolVarP(&force, "force", "f", false, "remove even what others stand on")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print each snapshot's name and error (if any) as a JSON list")
	return cmd
}

func (a *app) squashCommand() *cobra.Command {
	var tag string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "squash SNAPSHOT -t NAME:STEP",
		Short: "Fold a chain of snapshots into one",
		Long: `Squash folds SNAPSHOT and the snapshots under it (down to the first layer that is not a
snapshot) into one snapshot layer tagged NAME:STEP over the same base layers. Long chains
slow lookups, and overlay stacks a bounded number of layers. The chain stays until
dsec snap rm removes it.

` + exitCodesHelp,
		Example: `  dsec snap squash rollout-7:40 -t rollout-7:40-flat
  dsec snap branch rollout-7:40-flat -n 16`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if tag == "" {
				return usageError{errors.New("squash needs -t NAME:STEP, the new snapshot's tag")}
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			sq, err := c.Squash(cmd.Context(), args[0], tag)
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(sq)
			}
			_, err = fmt.Fprintf(a.stdout, "%s\t%d snapshots folded over %s, %s\n", sq.Name, sq.Folded, sq.Parent, humanBytes(sq.Size))
			return err
		},
	}
	cmd.Flags().StringVarP(&tag, "tag", "t", "", "the new snapshot's tag, NAME:STEP (required)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the new snapshot as JSON")
	return cmd
}
