package main

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/pflag"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/sdk"
)

// layerStack lists the layers given, topmost first.
func layerStack(toolkit, workspace, base string) []string {
	var out []string
	for _, l := range []string{toolkit, workspace, base} {
		if l != "" {
			out = append(out, l)
		}
	}
	return out
}

// specFlags are the flags that describe a sandbox: run's, and a pool's
// template.
type specFlags struct {
	base, workspace, toolkit string
	image, pull              string
	hostname                 string
	cpu, cpuRequest          float64
	memory, memoryRequest    string
	disk                     string
	pids                     int64
	class                    string
	env                      []string
	workdir                  string
	user                     string
	policy                   string
	userns                   bool
}

func (f *specFlags) register(fl *pflag.FlagSet) {
	fl.StringVar(&f.base, "base", "", "the base layer (NAME:VERSION or digest)")
	fl.StringVar(&f.image, "image", "", "a container image (python:3.12, ghcr.io/org/env:v1) whose layers go under the others, pulled on first use")
	fl.StringVar(&f.pull, "pull", "", "when --image is fetched from its registry: missing (when neither the store nor the shared remote holds it, the default), never, or always (its tag resolved again)")
	fl.StringVar(&f.workspace, "workspace", "", "the workspace layer")
	fl.StringVar(&f.toolkit, "toolkit", "", "the toolkit layer")
	fl.StringVar(&f.hostname, "hostname", "", "hostname in the sandbox (default: its name)")
	fl.Float64Var(&f.cpu, "cpu", 0, "CPU limit in CPUs, e.g. 0.5 (default: none)")
	fl.Float64Var(&f.cpuRequest, "cpu-request", 0, "CPUs reserved at admission (default: the limit)")
	fl.StringVar(&f.memory, "memory", "", "memory limit, e.g. 512M or 2G, or unlimited (default: the worker's, defaults.memory: 2G)")
	fl.StringVar(&f.memoryRequest, "memory-request", "", "memory reserved at admission (default: the limit)")
	fl.StringVar(&f.disk, "disk", "", "disk quota on what the sandbox writes, on a file system of its own, e.g. 10G, at least 16M; unlimited: none of its own (default: the worker's bound, defaults.disk, 10G, on the file system sandboxes share)")
	fl.Int64Var(&f.pids, "pids", 0, "limit on the sandbox's own processes and threads (its init's are not counted; -1: none; default: the worker's, defaults.pids: 4096)")
	fl.StringVar(&f.class, "class", "", "scheduling class: latency (interactive steps, the default) or batch (runs only on CPU nothing else wants)")
	fl.StringArrayVarP(&f.env, "env", "e", nil, "K=V for every command of the sandbox (repeatable)")
	fl.StringVarP(&f.workdir, "workdir", "w", "", "every command's default working directory")
	fl.StringVarP(&f.user, "user", "u", "", "every command's default user: a name of the sandbox's /etc/passwd, uid or uid:gid (default: an image's USER, else root)")
	fl.StringVar(&f.policy, "policy", "", "a policy file, or the name of a stored one (default: the secure default)")
	fl.BoolVar(&f.userns, "userns", false, "run in a user namespace of its own: root in the sandbox is nobody on the host")
}

// spec is the sandbox the flags describe.
func (a *app) spec(f specFlags) (api.SandboxSpec, error) {
	spec := api.SandboxSpec{CPU: f.cpu, CPURequest: f.cpuRequest, Pids: f.pids, Env: f.env, Workdir: f.workdir, User: f.user, Hostname: f.hostname,
		Class: f.class, Layers: layerStack(f.toolkit, f.workspace, f.base), UserNS: f.userns, Image: f.image, Pull: f.pull}
	if f.image != "" && f.base != "" {
		return spec, usageError{fmt.Errorf("--image and --base are both a sandbox's bottom: give one (a workspace and a toolkit stack on either)")}
	}
	switch {
	case f.pull != "" && f.pull != api.PullMissing && f.pull != api.PullNever && f.pull != api.PullAlways:
		return spec, usageError{fmt.Errorf("bad --pull %q: give missing (the default), never or always", f.pull)}
	case f.pull != "" && f.image == "":
		return spec, usageError{fmt.Errorf("--pull says when --image is fetched: give --image too")}
	}
	if err := sizes(&spec, f.memory, f.disk); err != nil {
		return spec, err
	}
	if f.memoryRequest != "" {
		n, err := parseBytes(f.memoryRequest)
		if err != nil {
			return spec, fmt.Errorf("--memory-request: %w", err)
		}
		spec.MemoryRequest = n
	}
	for _, n := range []struct {
		flag string
		v    float64
	}{{"cpu", f.cpu}, {"cpu-request", f.cpuRequest}, {"pids", float64(f.pids)}} {
		if n.v == api.Unlimited && n.flag == "pids" {
			continue
		}
		if n.v < 0 {
			return spec, usageError{fmt.Errorf("--%s %g is negative: give 0 (the default) or more (--pids -1: no limit of its own)", n.flag, n.v)}
		}
	}
	switch f.class {
	case "", api.SchedLatency, api.SchedBatch:
	default:
		return spec, usageError{fmt.Errorf("bad --class %q: use latency or batch", f.class)}
	}
	if err := checkEnv(f.env); err != nil {
		return spec, err
	}
	var err error
	spec.Policy, spec.PolicyName, err = a.policyArg(f.policy)
	return spec, err
}

// call runs a command in a sandbox the worker discards after it: a warm
// one of a FnCall pool (run --backend fncall), or one made for it (run
// --rm: rm).
func (a *app) call(ctx context.Context, pool string, spec *api.SandboxSpec, rm bool, f execFlags, args []string) error {
	c, err := a.client()
	if err != nil {
		return err
	}
	opts := sdk.CallOptions{Pool: pool, Spec: spec, Run: rm, ExecOptions: sdk.ExecOptions{ID: f.id, Args: args}}
	if pool != "" && len(spec.Layers) == 0 && spec.Image == "" {
		opts.Spec = nil
	}
	defer a.streams(&opts.ExecOptions, f)()
	res, err := c.Call(ctx, opts)
	if err != nil {
		return err
	}
	return a.finish(res.ExecResult, res.Sandbox)
}

// isPolicyFile says whether a --policy value names a file (else a stored
// policy).
func isPolicyFile(v string) bool {
	if _, err := os.Stat(v); err == nil {
		return true
	}
	return strings.ContainsAny(v, "/") || strings.HasSuffix(v, ".yaml") || strings.HasSuffix(v, ".yml") || strings.HasSuffix(v, ".json")
}
