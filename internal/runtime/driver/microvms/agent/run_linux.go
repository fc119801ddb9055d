package agent

import (
	"os"

	"github.com/dsec-project/dsec/internal/runtime/initproto"
)

// MaybeRun runs the guest's agent and never returns if this process is
// a microVM guest's pid 1 (the kernel's command line names GuestEnv) or
// a full VM's agent service (GuestEnv is GuestSystem); otherwise it
// returns at once.
func MaybeRun() {
	switch {
	case os.Getenv(initproto.GuestEnv) == "1" && os.Getpid() == 1:
		initproto.Run("dsec guest", runGuest)
	case os.Getenv(initproto.GuestEnv) == initproto.GuestSystem:
		initproto.Run("dsec guest", func() error { return serve(setupSystem, false) })
	}
}
