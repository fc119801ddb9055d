//go:build !front

package main

import (
	"errors"
	"fmt"
	"github.com/containerd/errdefs"
	"io"
	"io/fs"
	"os"

	"github.com/spf13/cobra"
	"sigs.k8s.io/yaml"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/policy"
)

const policyNote = `A policy has four sections; one left out keeps the secure default's (dsec policy show):
  files      readOnly and hidden paths (read-only nosuid or empty mounts the sandbox cannot
             undo); readWrite, the only trees writable (Landlock); the toolkit layer's paths
             are read-only and nosuid unless toolkitWritable
  syscalls   more system calls to deny, on top of the seccomp allowlist every sandbox has
  network    the egress allowlist: CIDRs, addresses or domain rules (pypi.org, "*.github.com"
             one label deep, "**.githubusercontent.com" any depth; needs mode: nat), ports,
             tcp/udp; everything else fails with EPERM. A sandbox with domain rules resolves
             through its own resolver in the worker (all its DNS goes there, whatever server
             it names): only allowed names are answered (NXDOMAIN for the rest, never asked
             upstream), and each answer opens its addresses, on the rule's ports, until its
             TTL (dns.min_ttl at least) and dns.grace pass; not 853 or UDP 443. TCP 443 to
             an address its resolver answered goes on in the kernel once the worker has read
             its hello's server name and found it allowed and answered with that address;
             other TCP 80 and 443 go through its proxy, by the TLS server name or HTTP Host,
             dialled by name (no name, an encrypted hello, a name no rule allows: refused). Its
             /etc/resolv.conf, if it names no server it may use (none, only loopback), is
             written to name 192.0.2.53, which the redirect answers. mode: nat gives
             the sandbox eth0, a veth pair to the host masqueraded out (default: loopback
             only); the allowlist holds either way. No rule opens the deny set: link-local
             (169.254.0.0/16 with the metadata address, fe80::/10), the NAT pool 10.200.0.0/16
             (the host's gateways, other sandboxes), multicast, broadcast and, in nat mode,
             the host's own addresses (the host also drops what sandboxes send it); private
             ranges (10/8, 172.16/12, 192.168/16, 100.64/10, fc00::/7) open only to a rule
             naming them or a part of them, not to 0.0.0.0/0
  resources  pids, memory, cpu caps; disk, the bound on what the sandbox writes (its upper on a
             file system of that size: past it, writes fail with ENOSPC)
The network allowlist, resources, read-only and hidden paths change at once for every process
of a running sandbox (a disk quota can grow, never shrink, and a sandbox made without one
cannot get one; growing a running sandbox's needs CAP_SYS_RESOURCE, else stop it first); file and syscall rules can only be tightened there, and readWrite and
syscall rules hold for processes started from then on (the kernel cannot add them to running
ones). apply says which took effect how.
Whatever the policy, every sandbox opens only the devices of its /dev (null, zero, full,
random, urandom, tty, ptmx, its pseudo-terminals): a node root makes of any other device
(a loop device, a disk, /dev/kvm, /dev/fuse, /dev/net/tun, /dev/mem) is made but its open
fails with EPERM (a cgroup device program, and the v1 devices controller where mounted),
and its root and writable mounts are nodev. Netlink opens for NETLINK_ROUTE, SOCK_DIAG and
GENERIC only (ip, getifaddrs and ss work); raw and packet sockets are refused, and so are
the ioctls that exchange or commit file contents (XFS, ext4, Btrfs, clone and dedupe).`

func (a *app) policyCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "policy",
		Short: "Check, store and apply sandbox policies",
		Long: `Policies hold a sandbox's processes (root in the sandbox included) to file, system call and
network rules. Every sandbox runs under the secure default unless run --policy names another.

` + policyNote,
	}
	cmd.AddCommand(a.policyValidateCommand(), a.policyApplyCommand(), a.policySaveCommand(), a.policyLsCommand(),
		a.policyShowCommand(), a.policyRmCommand())
	return cmd
}

// readPolicy reads and checks a policy file ("-": stdin).
func (a *app) readPolicy(file string) (*api.Policy, error) {
	var b []byte
	var err error
	if file == "-" {
		b, err = io.ReadAll(io.LimitReader(a.stdin, policy.MaxSize+1))
	} else {
		b, err = os.ReadFile(file)
	}
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("policy file %s does not exist: give the path of a policy file (saved policies go by name: dsec policy ls): %w", file, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	p, err := policy.Parse(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return p, nil
}

// policyArg turns --policy's value into a policy (a file) or a name.
func (a *app) policyArg(v string) (*api.Policy, string, error) {
	if v == "" {
		return nil, "", nil
	}
	if isPolicyFile(v) {
		p, err := a.readPolicy(v)
		return p, "", err
	}
	return nil, v, nil
}

func (a *app) policyValidateCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "validate FILE...",
		Short: "Check policy documents",
		Long: `Validate parses each policy document (YAML or JSON; "-" reads stdin) and checks it: the
apiVersion and kind, every field known, paths absolute, CIDRs, ports and protocols valid,
system calls known on this architecture. It prints each file's effective policy with --json.
The JSON schema is docs/policy.schema.json.

` + exitCodesHelp,
		Example: `  dsec policy validate ci.yaml
  dsec policy validate --json ci.yaml | jq .network`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError{errors.New("validate needs at least one policy file")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			var out []*api.Policy
			for _, f := range args {
				p, err := a.readPolicy(f)
				if err != nil {
					return err
				}
				eff := policy.Effective(p)
				if _, err := policy.Seccomp(eff.Syscalls.Deny); err != nil {
					return fmt.Errorf("%s: %w", f, err)
				}
				out = append(out, eff)
				if !asJSON {
					fmt.Fprintf(a.stdout, "%s: ok\n", f)
				}
			}
			if asJSON {
				return a.printJSON(out)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the effective policies as JSON")
	return cmd
}

func (a *app) policyApplyCommand() *cobra.Command {
	var file, name string
	var asJSON, reset bool
	cmd := &cobra.Command{
		Use:   "apply SANDBOX (-f FILE | --name NAME)",
		Short: "Apply a policy to a sandbox",
		Long: `Apply makes a policy (a file, or one stored with dsec policy save) the sandbox's and says
exactly what took effect: the network allowlist and resources change at once for every
process; added file and syscall rules hold for the processes started from now on. A policy
that would loosen the sandbox's file or syscall rules is refused (exit 8): the kernel cannot
take them back from a running process.

` + policyNote + "\n\n" + exitCodesHelp,
		Example: `  dsec policy apply rollout-7 -f allow-pypi.yaml
  dsec policy apply rollout-7 --name ci-strict --json
  dsec policy apply rollout-7 -f no-github.yaml --reset   # and end the connections it no longer allows`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if (file == "") == (name == "") {
				return usageError{errors.New("apply needs a policy: -f FILE or --name NAME")}
			}
			req := api.PolicyRequest{Name: name, Reset: reset}
			if file != "" {
				p, err := a.readPolicy(file)
				if err != nil {
					return err
				}
				req.Policy = p
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			rep, err := c.Sandbox(args[0]).ApplyPolicy(cmd.Context(), req)
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(rep)
			}
			for _, s := range rep.Now {
				fmt.Fprintf(a.stdout, "now, for every process:    %s\n", s)
			}
			for _, s := range rep.NewProcesses {
				fmt.Fprintf(a.stdout, "for processes started now: %s\n", s)
			}
			for _, s := range rep.Unchanged {
				fmt.Fprintf(a.stdout, "unchanged:                 %s\n", s)
			}
			return nil
		},
	}
	cmd.Flags().StringVarP(&file, "file", "f", "", "the policy document (\"-\": stdin)")
	cmd.Flags().BoolVar(&reset, "reset", false, "end the connections the new policy no longer allows (a container's sockets, its proxy's relays and fast-path flows; a microVM's flows are dropped); without it they live on")
	cmd.Flags().StringVar(&name, "name", "", "a stored policy")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the report as JSON")
	return cmd
}

func (a *app) policySaveCommand() *cobra.Command {
	var file string
	cmd := &cobra.Command{
		Use:   "save NAME -f FILE",
		Short: "Store a policy under a name",
		Long: `Save checks a policy document and stores it with the worker under NAME, for run --policy NAME
and policy apply --name NAME. Saving over a name replaces the stored policy; sandboxes keep
the policy they were given.

` + exitCodesHelp,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if file == "" {
				return usageError{errors.New("save needs -f FILE, the policy document")}
			}
			p, err := a.readPolicy(file)
			if err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			if err := c.SavePolicy(cmd.Context(), args[0], p); err != nil {
				return err
			}
			_, err = fmt.Fprintln(a.stdout, args[0])
			return err
		},
	}
	cmd.Flags().StringVarP(&file, "file", "f", "", "the policy document (\"-\": stdin)")
	return cmd
}

func (a *app) policyLsCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "List the stored policies",
		Args:  exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			ps, err := c.Policies(cmd.Context())
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(ps)
			}
			for _, p := range ps {
				eff := policy.Effective(&p)
				fmt.Fprintf(a.stdout, "%s\t%d egress rules, %d read-only, %d hidden, %d read-write paths, %d more syscalls denied\n", p.Metadata.Name,
					len(eff.Network.Egress), len(eff.Files.ReadOnly), len(eff.Files.Hidden), len(eff.Files.ReadWrite), len(eff.Syscalls.Deny))
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func (a *app) policyShowCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "show [NAME]",
		Short: "Print a stored policy, or the secure default",
		Long: `Show prints the stored policy NAME, with the default's sections filled in, as YAML (or JSON);
without NAME, the secure default every sandbox runs under.`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) > 1 {
				return usageError{errors.New("show takes at most one policy name")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			p := policy.Default()
			if len(args) == 1 {
				c, err := a.client()
				if err != nil {
					return err
				}
				if p, err = c.Policy(cmd.Context(), args[0]); err != nil {
					return err
				}
				p = policy.Effective(p)
			}
			if asJSON {
				return a.printJSON(p)
			}
			b, err := yaml.Marshal(p)
			if err != nil {
				return err
			}
			_, err = a.stdout.Write(b)
			return err
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func (a *app) policyRmCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "rm NAME...",
		Short: "Remove stored policies",
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError{errors.New("rm needs at least one policy name (dsec policy ls lists them)")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			for _, n := range args {
				if err := c.RemovePolicy(cmd.Context(), n); err != nil {
					return err
				}
				fmt.Fprintln(a.stdout, n)
			}
			return nil
		},
	}
}
