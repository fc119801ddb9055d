package main

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"
)

// helpCommand is cobra's help command, but a topic or command it does
// not know is a usage error (exit 2), not a message and exit 0.
func helpCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "help [command or topic]",
		Short: "Help about any command or topic",
		Long:  "Help prints the help of any command (dsec help snap branch) or topic (dsec help policies).",
		ValidArgsFunction: func(c *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
			cmd, _, err := c.Root().Find(args)
			if err != nil {
				return nil, cobra.ShellCompDirectiveNoFileComp
			}
			var names []string
			for _, sub := range cmd.Commands() {
				if (sub.IsAvailableCommand() || sub.IsAdditionalHelpTopicCommand()) && strings.HasPrefix(sub.Name(), toComplete) {
					names = append(names, sub.Name())
				}
			}
			return names, cobra.ShellCompDirectiveNoFileComp
		},
		RunE: func(c *cobra.Command, args []string) error {
			cmd, rest, err := c.Root().Find(args)
			if err != nil || cmd == nil || len(rest) > 0 {
				return usageError{fmt.Errorf("no command or help topic %q: dsec help lists them", strings.Join(args, " "))}
			}
			if cmd.Context() == nil { // its help reads the settings, as cobra's help does
				cmd.SetContext(c.Context())
			}
			cmd.InitDefaultHelpFlag()
			cmd.InitDefaultVersionFlag()
			return cmd.Help()
		},
	}
}

// helpTopics are dsec help TOPIC: a task's page of docs/, in a line or
// two (cobra lists them as additional help topics; they run nothing).
func helpTopics() []*cobra.Command {
	topics := []struct{ name, short, page, long string }{
		{"getting-started", "A first sandbox, step by step", "getting-started.md",
			"Build a base layer from a directory, run a sandbox, exec in it with ids, copy files, stop, start and remove it."},
		{"concepts", "Layers, the store, sandboxes, exec ids, snapshots, backends", "concepts.md",
			"The words the other pages use: layers and their kinds, the store and remotes, lazy mounts, sandboxes and\ntheir lifecycle, exec ids, snapshots and branches, backends, classes and admission."},
		{"layers", "Building layers, images from registries, remotes and lazy mounts", "layers.md",
			"dsec layer build from a directory, a tar stream or a container image; dsec image pull; push and pull to\ndir:// and oci:// remotes; lazy mounts and the profile-guided layout."},
		{"sandboxes", "Running sandboxes, resources, classes, FnCall pools", "sandboxes.md",
			"dsec run, exec, cp, ps, logs, stop, start, pause, resume and rm; resources and their defaults, scheduling\nclasses, admission, and warm FnCall pools."},
		{"snapshots", "Snapshots and branching", "snapshots.md",
			"dsec snap pack-diff, branch, restore, ls --tree, squash and rm; snapshots on another host."},
		{"policies", "File, syscall and network policies; allowing one domain", "policies.md",
			"The policy document (files, syscalls, network, resources), egress by address or domain name (pypi.org\nonly, say), dsec policy validate, save, show and apply, live."},
		{"security", "What holds against a root agent, and what does not", "security.md",
			"The security model: the isolation each backend gives, the attack suite, tenants."},
		{"remote", "The API over TCP, TLS, tokens, tenants, gateways, Kubernetes", "remote.md",
			"dsec daemon --listen with TLS, dsec token, a sandbox from Python on another machine, quotas, dsec gateway\nand the Kubernetes manifests and Helm chart."},
		{"python", "The Python SDK", "python.md", "The sync and asyncio clients (python/, standard library only)."},
		{"go", "The Go SDK", "go.md", "The package github.com/dsec-project/dsec/sdk."},
		{"e2b", "E2B compatibility: what maps, what is not served", "e2b.md",
			"The E2B API a worker or a gateway serves (dsec daemon --e2b-listen), for the official E2B SDKs."},
		{"microvms", "The microVM backend", "microvms.md", "--backend microvm: QEMU guests, their kernel, memory snapshots, pause and eviction."},
		{"operations", "Configuration, systemd, resources, upgrades, troubleshooting", "operations.md",
			"Running dsec on a host: configuration and its precedence, the systemd unit, resources and defaults,\nupgrades, cgroup v1 and v2, dsec version's report, and errors by message with what to do."},
		{"config", "Every setting: its key, type, default and DSEC_* variable", "reference/config.md",
			"Settings come from flags, then DSEC_* variables, then the config file, then the defaults. The generated\nreference lists every key of the config file with its type, default and variable."},
		{"architecture", "The packages and the paths a request takes, for contributors", "architecture.md",
			"How dsec is built: its packages, the path of a create and of an exec, how to add a backend, an API route\nor a policy rule, and the kernel facts it rests on."},
	}
	out := make([]*cobra.Command, len(topics))
	for i, t := range topics {
		out[i] = &cobra.Command{Use: t.name, Short: t.short,
			Long: t.long + "\n\nThe page: docs/" + t.page + " in dsec's source tree (make install puts docs/ in\nPREFIX/share/doc/dsec, /usr/local/share/doc/dsec by default)."}
	}
	return out
}
