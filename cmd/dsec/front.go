//go:build front

package main

// The client build (make build's bin/dsec, go build -tags front): the
// commands a rollout runs at every step (run, exec, ps, inspect, logs,
// cp, stop, start, rm) only talk to the worker, and need none of the
// packages that build, mount and enforce, whose initialisers alone took
// ~3 ms of each start here. This build has just those commands and
// hands every other one (help, completion and unknown commands too) to
// the complete binary, dsecd, next to it: execve with the same arguments,
// so the output, exit code and signals are dsecd's own.

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/dsec-project/dsec/api"
)

// fullName is the complete binary's name.
const fullName = "dsecd"

func beforeMain() {}

func (a *app) fullCommands() []*cobra.Command { return nil }

// handles says whether this build has the command args name.
func (a *app) handles(root *cobra.Command, args []string) bool {
	cmd, _, err := root.Find(args)
	return err == nil && cmd != root
}

// handOver runs args in the complete binary, in this process's place.
func handOver(args []string) error {
	full, err := fullBinary()
	if err != nil {
		return err
	}
	err = syscall.Exec(full, append([]string{"dsec"}, args...), os.Environ())
	return fmt.Errorf("run %s: %w", full, err)
}

// fullBinary finds dsecd: next to this binary, else on PATH.
func fullBinary() (string, error) {
	self, err := os.Executable()
	if err == nil {
		p := filepath.Join(filepath.Dir(self), fullName)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	if p, err := exec.LookPath(fullName); err == nil {
		return p, nil
	}
	return "", fmt.Errorf("this needs %s, dsec's complete binary, which is neither next to %s nor on PATH: install it beside dsec (make build and make install do)", fullName, self)
}

// workerBinary is what runs dsec daemon.
func workerBinary() (string, error) { return fullBinary() }

// policyArg: a policy file is parsed by the complete binary (the
// parser comes with the enforcement code); a stored policy's name is
// passed on.
func (a *app) policyArg(v string) (*api.Policy, string, error) {
	if v == "" {
		return nil, "", nil
	}
	if isPolicyFile(v) {
		return nil, "", errNeedFull
	}
	return nil, v, nil
}

// completeRefs is never called here: completion is the complete binary's.
func (a *app) completeRefs(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
	return nil, cobra.ShellCompDirectiveNoFileComp
}

func isNoSpace(error) bool  { return false } // the local store's: not in this build
func isBadInput(error) bool { return false }
