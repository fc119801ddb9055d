//go:build !front

package main

import (
	"errors"
	"os"

	"github.com/spf13/cobra"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/agent"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms/vmm"
)

// This file is the complete binary's: dsecd as make build names it, and
// dsec as plain go build makes it. front.go is the client build's.

// beforeMain: a sandbox's init, a microVM's shim and its guest's agent
// are this binary re-executed.
func beforeMain() {
	container.MaybeInit()
	vmm.MaybeRun()
	agent.MaybeRun()
}

// fullCommands are the commands the client build hands to this binary.
func (a *app) fullCommands() []*cobra.Command {
	return []*cobra.Command{a.layerCommand(), a.imageCommand(), a.daemonCommand(), a.snapCommand(), a.groupCommand(), a.leaseCommand(), a.policyCommand(), a.poolCommand(), a.tokenCommand(), a.gatewayCommand(), a.nodeCommand(), a.vmCommand()}
}

// handles: this binary runs every command itself.
func (a *app) handles(*cobra.Command, []string) bool { return true }

// handOver is never reached here: nothing in this binary needs another.
func handOver([]string) error {
	return errors.New("internal error: the complete binary has no binary to hand over to")
}

// workerBinary is what runs dsec daemon: this binary.
func workerBinary() (string, error) { return os.Executable() }

func isNoSpace(err error) bool  { return errors.Is(err, store.ErrNoSpace) }
func isBadInput(err error) bool { return errors.Is(err, layer.ErrBadSource) }
